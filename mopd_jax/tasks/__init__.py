"""Toy task domains (`gen`, `agt`, `cod`), their registry and the shared task interface.

    task = get_task("gen")
    examples = task.generate(seed=0, n=100)
    reward = task.verify(examples[0], examples[0].solutions["brief"])  # 1.0

TFDS builders and the resumable iterator live in `mopd_jax.tasks.datasets` (imported on
demand: it pulls in tensorflow_datasets); bring-your-own JSONL data in `mopd_jax.tasks.jsonl`.
"""
from mopd_jax.tasks.base import (B0_MARGIN, DOMAINS, STYLES, DataError, Example, Task, budget,
                                 check_prompt_length, check_text, compute_b0, effort_budget,
                                 final_answer, num_tokens, validate_domain, validate_effort)
from mopd_jax.tokenizer import EFFORTS


def get_task(name: str, **kwargs) -> Task:
  """A fresh task instance (its own verifier counters) for a domain name."""
  from mopd_jax.tasks import agt, cod, gen  # pylint: disable=g-import-not-at-top
  tasks = dict(gen=gen.GenTask, agt=agt.AgtTask, cod=cod.CodTask)
  if name not in tasks:
    raise ValueError(f"unknown domain {name!r}; expected one of {DOMAINS}")
  return tasks[name](**kwargs)
