"""Programs per second through the code sandbox, per backend and pool size, in one run.

    python -m benchmarks.sandbox_throughput [--programs 64] [--workers 1,2]

Each program is a small honest solution with standard-library imports allowed by the backend
(`math` under bubblewrap; none for the in-process barrier, which refuses imports), checked
against 8 hidden tests: the cost is the sandbox's start-up and teardown, not the program.
Prints one line per (backend, workers) and the bubblewrap / in-process ratio at each pool
size, all measured in this one process on this machine.
"""
from __future__ import annotations

import argparse
import time

from mopd_jax.tasks import sandbox

TESTS = tuple((x, 3 * x + 1) for x in range(8))
PROGRAMS = {"bwrap": "import math\ndef f(x):\n    return math.prod([3, x]) + 1\n",
            "inprocess": "def f(x):\n    return 3 * x + 1\n"}


def measure(backend: str, workers: int, n: int) -> float:
  jobs = [(PROGRAMS[backend], sandbox.IOTests("f", TESTS))] * n
  sandbox.run_many(jobs[:2], backend=backend, workers=1)  # warm the file cache
  t0 = time.perf_counter()
  out = sandbox.run_many(jobs, backend=backend, workers=workers)
  dt = time.perf_counter() - t0
  if not all(r.passed for r in out):
    raise RuntimeError(f"{backend}: an honest program failed: {out[0]}")
  return n / dt


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--programs", type=int, default=64)
  ap.add_argument("--workers", default="1,2")
  args = ap.parse_args()
  backends = ["bwrap"] if sandbox.bwrap_available() else []
  backends.append("inprocess")
  rates = {}
  for w in [int(x) for x in args.workers.split(",")]:
    for b in backends:
      rates[b, w] = measure(b, w, args.programs)
      print(f"{b:10s} workers={w}: {rates[b, w]:7.1f} programs/s ({args.programs} programs)")
  for w in sorted({w for _, w in rates}):
    if ("bwrap", w) in rates:
      print(f"workers={w}: bwrap / inprocess = {rates['bwrap', w] / rates['inprocess', w]:.2f}")


if __name__ == "__main__":
  main()
