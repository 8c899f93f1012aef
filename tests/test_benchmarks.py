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
