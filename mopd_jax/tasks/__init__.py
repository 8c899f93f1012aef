"""Task domains, their registry and the shared task interface.

    task = get_task("gen")
    examples = task.generate(seed=0, n=100)
    reward = task.verify(examples[0], examples[0].solutions["brief"])  # 1.0

A task registers itself by name next to its definition (`@register("gen")`); a run's config
names the domains it trains (`config.domains`, see `mopd_jax.tasks.grid`). The toy's `gen`, `agt`
and `cod` are three registered tasks. TFDS builders and the resumable iterator live in
`mopd_jax.tasks.datasets` (imported on demand: it pulls in tensorflow_datasets);
bring-your-own JSONL data in `mopd_jax.tasks.jsonl`; domains of JSONL or Parquet record
files run the `records` task (`mopd_jax.tasks.records`). Beside the tasks: the run's task
grid (`grid`), what each party's prompt shows of the effort (`views`) and the length
budgets measured from samples (`budgets`).
"""
from mopd_jax.tasks.base import (B0_MARGIN, STYLES, DataError, Example, Task, budget,
                                 check_prompt_length, check_text, compute_b0, effort_budget,
                                 final_answer, get_task, num_tokens, register, registered,
                                 validate_domain)
from mopd_jax.tasks import agt, cod, gen  # noqa: E402,F401  (the toy tasks register themselves)
from mopd_jax.tasks import records  # noqa: E402,F401  (the task of record files registers itself)

