"""Everything that reads or writes bytes: the workdir and data-dir storage (local folders and
object storage, `storage`), checkpoints (`checkpoint`, orbax params and JSON metadata),
Hugging Face checkpoints (`hf`: safetensors, config.json, export), tokenizers (`tokenizer`,
`tokenizer_files`), what a run records about itself (`metrics`: TensorBoard and JSONL;
`profiling`: the JAX profiler over a step range, compile times).
"""
