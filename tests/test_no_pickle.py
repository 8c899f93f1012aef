"""No pickle on any load path: params via orbax or safetensors, metadata via JSON."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = [r"\bpickle\.loads?\(", r"allow_pickle\s*=\s*True", r"\bcloudpickle\b",
             r"\bdill\.load", r"torch\.load\(", r"\bjoblib\.load\("]


def test_package_never_unpickles():
  hits = []
  for folder in ("mopd_jax", "experiments", "configs", "benchmarks"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
      for name in files:
        if not name.endswith(".py"):
          continue
        path = os.path.join(dirpath, name)
        text = open(path, encoding="utf-8").read()
        for pattern in FORBIDDEN:
          for m in re.finditer(pattern, text):
            hits.append(f"{os.path.relpath(path, ROOT)}: {m.group(0)}")
  assert not hits, hits
