"""Sync vs asynchronous teacher scoring: `python -m benchmarks.async_scoring [--steps 6]
[--placement disaggregated|server] [--server_batched]`.

A student and a bank of deeper teachers, the teachers either disaggregated on a second
simulated CPU device of the same process (device 1; the student on device 0) or, with
`--placement server`, in a teacher server process of their own (`mopd_jax.teachers.server`, on
loopback) scored through `teacher_client.EndpointScorer` (its batch-invariant scoring, or one
[K, b, T] block per round with `--server_batched`). Each MOPD step samples K * b
rollouts, has the bank score them and updates the student; the benchmark prints the per-step
time of each phase (sample, time blocked on teachers, train) and of the whole step for
staleness 0 (sync) and 1 (teachers score batch k while the student samples batch k+1). On 2
shared CPU cores the student and the teachers compete for the same cores, so the overlap
gain here is a lower bound of what separate accelerators or hosts give.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

if __name__ == "__main__":  # two simulated devices, before JAX starts
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=2").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from mopd_jax import models
from mopd_jax.rollout import sampling
from mopd_jax.teachers import async_scoring, bank as teachers, client as teacher_client, placement
from mopd_jax.training import step as train


def teacher_bank(teacher_cfg, num_teachers: int) -> teachers.TeacherBank:
  """The benchmark's bank: the same params in this process and in a server process."""
  plist = [models.init_params(teacher_cfg, jax.random.PRNGKey(100 + i))
           for i in range(num_teachers)]
  return teachers.build_bank(teacher_cfg, plist,
                             names=[f"d{i}/e" for i in range(num_teachers)])


def build(student_cfg, teacher_cfg, *, num_teachers=3, rows_per_teacher=2, prompt_len=8,
          new_tokens=16, staleness=0, is_bounds=(0.5, 2.0), devices=None, seed=0,
          server_url=None):
  """(initial state, sample, submit, train) for `async_scoring.run` on a disaggregated pair
  of devices (or one shared device when only one is given); `server_url`: the teachers are
  scored by the teacher server there instead (the student on the first device)."""
  devices = list(jax.devices()[:2] if devices is None else devices)
  if server_url:
    devices = devices[:1]
  if len(devices) == 2:
    s_mesh, t_mesh = placement.make_meshes({"data": 1}, {"data": 1}, "disaggregated",
                                           devices=devices)
  else:
    s_mesh, t_mesh = placement.make_meshes({"data": 1}, None, "colocated", devices=devices)
  k, b = num_teachers, rows_per_teacher
  if server_url:
    names = [f"d{i}/e" for i in range(k)]
    scorer = teacher_client.EndpointScorer(names, {n: server_url for n in names})
  else:
    scorer = placement.TeacherScorer(teacher_bank(teacher_cfg, k), s_mesh, t_mesh)
  loss_cfg = train.LossConfig(kind="mopd", is_bounds=tuple(is_bounds) if staleness else None)
  trainer = train.Trainer(student_cfg, loss_cfg, train.OptimConfig(lr=1e-3, warmup_steps=0),
                          mesh=s_mesh)
  state = trainer.init(jax.device_put(models.init_params(student_cfg, jax.random.PRNGKey(seed)),
                                      trainer.state_sharding.params))
  sampler = sampling.Sampler(student_cfg, sampling.SamplingConfig(
      max_new_tokens=new_tokens, buckets=(prompt_len,)))
  prompts = np.random.RandomState(seed).randint(3, student_cfg.vocab_size, (k * b, prompt_len))

  def sample(params, step):
    r = sampler(params, prompts, jax.random.PRNGKey(1000 + step))
    strat = lambda x: np.asarray(x).reshape((k, b) + x.shape[1:])  # rows are teacher-major
    return {"tokens": strat(r.tokens), "input_mask": strat(r.input_mask),
            "loss_mask": strat(r.loss_mask), "sampler_logprobs": strat(r.logprobs)}

  def submit(batch):
    return scorer.submit(batch["tokens"], batch["input_mask"])

  def train_fn(state, batch, teacher_lp):
    flat = lambda x: np.asarray(x).reshape((k * b,) + x.shape[2:])
    lp = flat(jax.device_get(scorer.fetch(teacher_lp)))
    tb = train.TrainBatch(tokens=flat(batch["tokens"]), input_mask=flat(batch["input_mask"]),
                          loss_mask=flat(batch["loss_mask"]),
                          sampler_logprobs=flat(batch["sampler_logprobs"]),
                          teacher_logprobs=lp)
    return trainer.step(state, tb)

  return state, sample, submit, train_fn


def _configs():
  student = models.get_preset("toy", vocab_size=256, num_layers=2)
  teacher = models.get_preset("toy", vocab_size=256, num_layers=6, d_model=256, mlp_dim=768,
                              num_heads=8, num_kv_heads=4)
  return student, teacher


def _start_server(batch_invariant: bool = True):
  """This module's bank in a teacher server process of its own: (process, base URL)."""
  extra = [] if batch_invariant else ["--server_batched"]
  proc = subprocess.Popen([sys.executable, "-m", "benchmarks.async_scoring", "--serve", *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
  line = proc.stdout.readline()
  while line and "listening on" not in line:
    line = proc.stdout.readline()
  if not line:
    raise RuntimeError("the benchmark's teacher server did not start")
  return proc, line.split("listening on")[1].strip()


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--json", action="store_true")
  ap.add_argument("--placement", choices=("disaggregated", "server"), default="disaggregated")
  ap.add_argument("--serve", action="store_true", help="be the teacher server (internal)")
  ap.add_argument("--server_batched", action="store_true",
                  help="the server scores a round's rows in one block (batch_invariant=False)")
  args = ap.parse_args(argv)
  student, teacher = _configs()
  if args.serve:
    from mopd_jax.teachers import server as serve  # pylint: disable=g-import-not-at-top
    from mopd_jax.io import tokenizer
    serve.TeacherServer(teacher_bank(teacher, 3), tokenizer.CharTokenizer(),
                        batch_invariant=not args.server_batched).serve("127.0.0.1", 0)
    return
  server, url = ((_start_server(not args.server_batched) if args.placement == "server"
                  else (None, None)))
  try:
    out = _measure(student, teacher, args.steps, url)
  finally:
    if server is not None:
      server.terminate()
      server.wait(timeout=60)
  if args.json:
    print(json.dumps(out, indent=2))
    return
  print("| mode | sample s | teacher wait s | train s | step s |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for name, r in out.items():
    where = args.placement + (" (batched)" if args.server_batched else "")
    print(f"| {where}, {name} | {r['sample']:.3f} | {r['teacher_wait']:.3f} | "
          f"{r['train']:.3f} | {r['step']:.3f} |")


def _measure(student, teacher, steps: int, server_url) -> dict:
  out = {}
  for staleness in (0, 1):
    state, sample, submit, train_fn = build(student, teacher, staleness=staleness,
                                            rows_per_teacher=4, new_tokens=32,
                                            server_url=server_url)
    # Untimed steps compile every program (a teacher server compiles one prefill per rows
    # and length bucket that the arrival of requests happens to form).
    state, _, _ = async_scoring.run(state, 3, sample=sample, submit=submit, train=train_fn)
    _, hist, times = async_scoring.run(state, steps, sample=sample, submit=submit,
                                       train=train_fn, staleness=staleness)
    out[f"staleness_{staleness}"] = {**{k: round(v, 4) for k, v in times.per_step().items()},
                                     "final_loss": float(hist[-1]["loss"])}
  return out


if __name__ == "__main__":
  main()
