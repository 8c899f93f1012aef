"""MOPD prompt selection (mopd_jax/mopd.py): which prompts each (domain, effort) cell gets."""
import numpy as np


def test_mopd_cell_prompts_shared_or_distinct_across_efforts():
  from mopd_jax import grid as grid_mod, mopd
  from mopd_jax.tasks import TOY_DOMAINS as DOMAINS
  grid = grid_mod.Grid(DOMAINS, tuple(grid_mod.Effort(e, t) for e, t in
                                      (("low", 0.3), ("high", 0.7), ("max", 1.5))))

  def iters(n):
    return {d: iter([[f"{d}{i}" for i in range(n)]]) for d in DOMAINS}

  shared = mopd.cell_prompts(iters(2), grid, 2, shared=True)
  assert len(shared) == 9  # domain-major: (gen, low), (gen, high), (gen, max), (agt, low), ...
  assert shared[0] == shared[1] == shared[2] == ["gen0", "gen1"]
  assert shared[3] == shared[5] == ["agt0", "agt1"]
  distinct = mopd.cell_prompts(iters(6), grid, 2, shared=False)
  assert distinct[:3] == [["gen0", "gen1"], ["gen2", "gen3"], ["gen4", "gen5"]]
  assert distinct[8] == ["cod4", "cod5"]
  # An effort mix: every prompt in exactly one of its domain's cells, efforts as drawn.
  rng = np.random.RandomState(0)
  mixed = mopd.cell_prompts(iters(600), grid, 200, shared=False, mix=(0.0, 1.0, 3.0),
                            rng=rng)
  for i, d in enumerate(DOMAINS):
    low, high, top = mixed[3 * i:3 * i + 3]
    assert low == [] and sorted(high + top) == sorted(f"{d}{j}" for j in range(600))
    assert 0.2 < len(high) / 600 < 0.3  # weight 1 of 4
