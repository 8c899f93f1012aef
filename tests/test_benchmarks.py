"""The benchmark's Tunix baseline wiring (the figures themselves are not timed tests)."""
import importlib.util
import sys

import pytest

from benchmarks import core


@pytest.mark.skipif(importlib.util.find_spec("tunix") is not None, reason="tunix is installed")
def test_tunix_baseline_without_tunix_fails_clearly():
  assert core.default_tunix_python() is None
  with pytest.raises(RuntimeError, match=r"(?s)Tunix baseline failed.*tunix"):
    core.tunix_decode(sys.executable, batch=1, prompt_len=4, new_tokens=2, vocab=64)


def test_length_groups_and_checkpoint_benchmarks_run_at_a_tiny_shape():
  """Both measurements run end to end (the default tier's guard of their code paths; the
  figures come from `python -m benchmarks.core`)."""
  import jax

  cfg = core.bench_config(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                          mlp_dim=64, vocab_size=128)
  out = core.length_groups_benchmark(cfg, core.models.init_params(cfg, jax.random.PRNGKey(0)),
                                     batch=6, seq=64, groups=(2, 3))
  assert set(out) == {"length_groups_step_s", "length_groups_2_speedup",
                      "length_groups_3_speedup"}
  assert all(v > 0 for v in out.values())
  ck = core.checkpoint_benchmark(leaf_counts=(2, 6), total_floats=600, saves=2)
  assert set(ck) == {f"checkpoint_{n}_arrays_{k}_s" for n in (2, 6) for k in ("save", "cpu")}
  assert all(v >= 0 for v in ck.values())


def test_cross_tokenizer_benchmark_runs_at_a_tiny_shape():
  """Whole MOPD steps with BPE teachers, the alignment's two parts timed inside them (the
  default tier's guard; the figures come from `python -m benchmarks.cross_tokenizer`)."""
  from benchmarks import cross_tokenizer
  out = cross_tokenizer.step_shares(steps=1, prompts_per_cell=1, vocab=300,
                                    max_response_tokens=16, d_model=32)
  assert out["step_s"] > out["alignment_s"] > 0 and out["cross_view_s"] > 0
  assert 0 < out["alignment_share_of_step"] < 1 and out["rollouts_per_step"] == 9


def test_cross_tokenizer_benchmark_times_the_char_kl_targets():
  """The same steps trained with `char_kl`: the next-character targets' part is timed."""
  from benchmarks import cross_tokenizer
  out = cross_tokenizer.step_shares(steps=1, prompts_per_cell=1, vocab=300,
                                    max_response_tokens=16, d_model=32, loss="char_kl")
  assert out["loss"] == "char_kl" and out["step_s"] > out["char_targets_s"] > 0
  assert 0 < out["char_targets_share_of_step"] < 1
