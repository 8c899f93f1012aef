"""What a run saved, read back for the tests that compare runs: the arrays of an orbax
params tree, keyed by their leaf paths."""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def arrays(path) -> dict:
  """{leaf path: numpy array} of a saved orbax params tree (read as saved, no target)."""
  tree = ocp.StandardCheckpointer().restore(os.path.abspath(path))
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
