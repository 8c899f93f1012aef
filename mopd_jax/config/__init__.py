"""The run config: its typed, validated schema (`schema`: `RunConfig`; `blocks`: one frozen
dataclass per stage block), the checkers of its fields (`checks`), the named choices the
algorithms also switch on (`choices`) and the config's value types (`endpoints`: teacher
servers and their retry policy; `tokenizer_options`). It sits at the bottom of the import
graph: nothing here imports another part of mopd_jax, so every module may import it.
Resolving a ConfigDict against the registered tasks and the algorithms' own rules is
`mopd_jax.configure`'s job, at the top.
"""
