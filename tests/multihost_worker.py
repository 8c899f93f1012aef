"""A few SFT and MOPD train steps on a global mesh, run by one process of a multi-host job
(`python tests/multihost_worker.py --process_id I ...`) or, as the reference, by the test
process itself on 4 of its devices (`run_steps`). Each process reads only its rows of every
batch, checkpoints from every process and logs from process 0 only."""
from __future__ import annotations

import argparse
import os
import sys

CFG_KW = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=64, max_seq_len=64, qk_norm=True)
MESH = dict(fsdp=2, tensor=2)
NUM_TEACHERS, ROWS_PER_TEACHER, T = 3, 4, 16
STEPS = 2


def _dataset(seed: int, lead: tuple, rows: int):
  """The same global data on every process: what a sharded file set would hold."""
  import numpy as np
  r = np.random.RandomState(seed)
  tokens = r.randint(0, CFG_KW["vocab_size"], lead + (rows, T)).astype(np.int32)
  pos = np.arange(T)
  lengths = r.randint(8, T + 1, lead + (rows, 1))
  prompt = r.randint(2, 6, lead + (rows, 1))
  input_mask = pos < lengths
  loss_mask = input_mask & (pos >= prompt)
  sampler_lp = (-r.rand(*lead, rows, T) * 3).astype(np.float32)
  return tokens, input_mask, loss_mask, sampler_lp


def _tick(what: str, _t=[None]) -> None:
  """Phase times on stderr: the test prints them when a process fails or is slow."""
  import time
  now = time.perf_counter()
  _t[0] = _t[0] or now
  print(f"[{now - _t[0]:6.1f}s] {what}", file=sys.stderr, flush=True)


def relayed_scores(url: str) -> dict:
  """Teacher servers in a run of several processes (`teachers/relayed.py`): process 0 asks
  the server at `url` (holding this module's teachers), every process gets its answers;
  an error on process 0 (a server that is not there, a start-up check) is raised on every
  process with its type."""
  import numpy as np

  from mopd_jax.config import endpoints, schema
  from mopd_jax.teachers import client, relayed
  names = tuple(f"d{k}/e" for k in range(NUM_TEACHERS))
  scorer = relayed.Relayed(lambda: client.EndpointScorer(
      names, {n: (url,) for n in names}, top_k=2))
  tokens, im, _, _ = _dataset(300, (NUM_TEACHERS,), ROWS_PER_TEACHER)
  lp, tk_lp, tk_ids = scorer(tokens, im)
  scorer.close()
  dead = relayed.Relayed(lambda: client.EndpointScorer(
      names, {n: ("http://127.0.0.1:9",) for n in names},
      policy=endpoints.RetryPolicy(timeout_s=5.0, retries=0)))
  out = {"relayed_lp": lp, "relayed_tk_lp": tk_lp, "relayed_tk_ids": tk_ids}
  try:
    dead(tokens, im)
  except client.TeacherUnavailable as e:
    out["relayed_down"] = np.asarray(str(e))
  dead.close()

  def refuse():
    raise schema.ConfigError("a start-up check refused")
  try:
    relayed.Relayed(refuse)
  except schema.ConfigError as e:
    out["relayed_refused"] = np.asarray(str(e))
  _tick("served scores relayed")
  return out


def serve_teachers():
  """This module's teachers behind a teacher server (started; the caller stops it)."""
  import jax
  import jax.numpy as jnp

  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.teachers import bank as teachers, server
  cfg = models.ModelConfig(**CFG_KW)
  keys = jnp.stack([jax.random.PRNGKey(10 + k) for k in range(NUM_TEACHERS)])
  bank = teachers.TeacherBank(params=jax.vmap(lambda r: models.init_params(cfg, r))(keys),
                              model_cfg=cfg, router=teachers.Router(tuple(
                                  f"d{k}/e" for k in range(NUM_TEACHERS))))
  s = server.TeacherServer(bank, CharTokenizer())
  s.start()
  return s


def run_steps(mesh, workdir: str) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from mopd_jax import models
  from mopd_jax.io import checkpoint, metrics
  from mopd_jax.runtime import distributed, sharding
  from mopd_jax.teachers import bank as teachers, placement
  from mopd_jax.training import step as train
  cfg = models.ModelConfig(**CFG_KW)
  params = sharding.init_sharded_params(cfg, jax.random.PRNGKey(0), mesh)
  log = metrics.MetricsLogger(os.path.join(workdir, "logs"))
  out = {"sft_loss": [], "mopd_loss": [], "teacher_lp": []}
  _tick("params initialised")

  # SFT: each process reads its rows of each global batch.
  b = NUM_TEACHERS * ROWS_PER_TEACHER
  rows = distributed.process_rows(mesh, b)
  # lr 1e-4: Adam's first updates are about lr * g / |g| per element, so an element whose
  # gradient is ~0 turns a rounding-level difference of the cross-process reduction into a
  # sizeable fraction of lr; at 1e-3 one such element of 13k differed by 7e-5.
  sft = train.Trainer(cfg, train.LossConfig(kind="sft"),
                      train.OptimConfig(lr=1e-4, warmup_steps=0), mesh=mesh)
  state = sft.init(params)
  for step in range(STEPS):
    tokens, im, lm, _ = _dataset(step, (), b)
    batch = distributed.global_batch(mesh, train.TrainBatch(
        tokens=tokens[rows], input_mask=im[rows], loss_mask=lm[rows]), b)
    state, m = sft.step(state, batch)
    out["sft_loss"].append(float(m["loss"]))
    log.scalars(step, {"loss": float(m["loss"])}, prefix="sft/")
    _tick(f"sft step {step}")

  # MOPD: a co-located bank of three teachers scores stratified [K, b, T] batches whose b
  # axis is split over the processes; the student trains on the K * b rows.
  t_sh = sharding.param_shardings(cfg, mesh, num_stacked=NUM_TEACHERS)
  keys = jnp.stack([jax.random.PRNGKey(10 + k) for k in range(NUM_TEACHERS)])
  stacked = jax.jit(jax.vmap(lambda r: models.init_params(cfg, r)), out_shardings=t_sh)(keys)
  _tick("teachers initialised")
  bank = teachers.TeacherBank(params=stacked, model_cfg=cfg,
                              router=teachers.Router(tuple(f"d{k}/e" for k in range(
                                  NUM_TEACHERS))))
  scorer = placement.TeacherScorer(bank, mesh, mesh)
  # [K, b, T] -> [K * b, T] for all four arrays in one program (one compilation).
  flat = jax.jit(lambda xs: [x.reshape((-1,) + x.shape[2:]) for x in xs],
                 out_shardings=sharding.batch_sharding(mesh, 2))
  # Same optimizer settings, so the SFT state (params and moments) carries straight on.
  mopd = train.Trainer(cfg, train.LossConfig(kind="mopd"),
                       train.OptimConfig(lr=1e-4, warmup_steps=0), mesh=mesh)
  srows = distributed.process_rows(mesh, ROWS_PER_TEACHER)
  for step in range(STEPS):
    tokens, im, lm, slp = _dataset(100 + step, (NUM_TEACHERS,), ROWS_PER_TEACHER)
    local = [x[:, srows] for x in (tokens, im, lm, slp)]
    tokens_g, im_g, lm_g, slp_g = distributed.global_batch(mesh, local, ROWS_PER_TEACHER,
                                                           leading=(None,))
    lp_t = scorer(tokens_g, im_g)
    out["teacher_lp"].append(np.asarray(distributed.gather(lp_t)))
    tok, imf, lmf, slpf, lpf = flat([tokens_g, im_g, lm_g, slp_g, lp_t])
    batch = train.TrainBatch(tokens=tok, input_mask=imf, loss_mask=lmf, sampler_logprobs=slpf,
                             teacher_logprobs=lpf)
    state, m = mopd.step(state, batch)
    out["mopd_loss"].append(float(m["loss"]))
    log.scalars(step, {"loss": float(m["loss"])}, prefix="mopd/")
    _tick(f"mopd step {step}")
  log.close()

  # Every process writes its shards; every process restores them onto the mesh.
  ckpt = os.path.join(workdir, "ckpt")
  checkpoint.save_params(ckpt, state.params)
  restored = checkpoint.load_params(ckpt, like=state.params,
                                    sharding=jax.tree.map(lambda x: x.sharding, state.params))
  _tick("checkpoint saved and restored")
  final = distributed.gather(state.params)
  again = distributed.gather(restored)
  out["restored_equal"] = all(np.array_equal(a, c) for a, c in
                              zip(jax.tree.leaves(final), jax.tree.leaves(again)))
  out["params"] = [np.asarray(x) for x in jax.tree.leaves(final)]
  out["mixed_lp"], out["hf_equal"] = _other_families(cfg, stacked, mesh, workdir)
  return out


def _other_families(cfg, stacked, mesh, workdir: str):
  """What a run with teachers of several families does on several processes: a MixedBank
  (the bank's first two teachers beside a teacher of another vocabulary) scores a
  stratified batch that every process holds, and a Hugging Face checkpoint is read onto
  the mesh, each process its own shards (the eval's teachers). Returns (the mixed scores
  gathered, whether the placed read equals what was written)."""
  import dataclasses
  import jax
  import numpy as np

  from mopd_jax import models
  from mopd_jax.io import hf
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.runtime import distributed, sharding
  from mopd_jax.teachers import bank as teachers, families
  other = dataclasses.replace(cfg, vocab_size=96)
  part_a = teachers.TeacherBank(params=jax.tree.map(lambda x: x[:2], stacked), model_cfg=cfg,
                                router=teachers.Router(("d0/e", "d2/e")))
  part_b = teachers.build_bank(other, [models.init_params(other, jax.random.PRNGKey(7))],
                               names=("d1/e",), sharding=sharding.param_shardings(
                                   other, mesh, num_stacked=1))
  mixed = families.MixedBank(
      parts=(part_a, part_b), router=teachers.Router(("d0/e", "d1/e", "d2/e")),
      families=(families.Family(tok=CharTokenizer(), path="", model_cfg=cfg,
                                cells=("d0/e", "d2/e"), cross=False),
                families.Family(tok=CharTokenizer(), path="x", model_cfg=other,
                                cells=("d1/e",), cross=True)))
  tokens, im, _, _ = _dataset(200, (NUM_TEACHERS,), ROWS_PER_TEACHER)
  tokens[1] = tokens[1] % (other.vocab_size - cfg.vocab_size) + cfg.vocab_size  # its own ids
  scored = families.MixedScorer(mixed, mesh, mesh)(tokens, im)
  mixed_lp = np.asarray(distributed.gather(scored))
  _tick("mixed families scored")
  params = jax.tree.map(lambda x: x[0], part_b.params)
  path = os.path.join(workdir, "hf_other")
  hf.save_checkpoint(other, params, path)  # process 0 writes
  distributed.sync("hf written")
  _, placed = hf.load_checkpoint(path, sharding=sharding.param_shardings(other, mesh))
  equal = all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(distributed.gather(params)), jax.tree.leaves(distributed.gather(placed))))
  _tick("hf checkpoint read onto the mesh")
  return mixed_lp, equal


def grain_batches() -> dict:
  """Record-domain batches through datasets.GrainIterator: each process reads only its own
  shard (the keys it read), every process gets the same global batches, and a restored
  iterator continues exactly."""
  import numpy as np
  from mopd_jax.tasks import datasets, get_task

  class Spy(list):  # a data source that records which examples this process read
    read = []

    def __getitem__(self, i):
      Spy.read.append(int(i))
      return list.__getitem__(self, i)

  source = Spy(get_task("gen").generate(0, 40))
  it = datasets.GrainIterator(source, 8, seed=5)
  first = [next(it) for _ in range(3)]
  state = it.state()
  more = [next(it) for _ in range(3)]
  again = datasets.GrainIterator(source, 8, seed=5)
  again.restore(state)
  resumed = [next(again) for _ in range(3)]
  position = {e.uid: i for i, e in enumerate(list.__iter__(source))}
  uids = lambda batches: np.asarray([[position[e.uid] for e in b] for b in batches])
  return {"grain_global": uids(first + more), "grain_resumed_equal": resumed == more,
          "grain_read": np.asarray(sorted(set(Spy.read)))}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--process_id", type=int, required=True)
  ap.add_argument("--num_processes", type=int, required=True)
  ap.add_argument("--coordinator", required=True)
  ap.add_argument("--local_devices", type=int, default=2)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--server", default="", help="A teacher server of this module's teachers.")
  args = ap.parse_args()
  import suite_cli  # beside this file: the suite's XLA flags (LLVM at -O0)
  os.environ["XLA_FLAGS"] = suite_cli.xla_flags(args.local_devices)
  os.environ["JAX_PLATFORMS"] = "cpu"
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  import numpy as np

  from mopd_jax.runtime import distributed, sharding
  jax.config.update("jax_default_matmul_precision", "highest")
  started = distributed.initialize(dict(coordinator_address=args.coordinator,
                                        num_processes=args.num_processes,
                                        process_id=args.process_id))
  if not started or jax.process_count() != args.num_processes:
    raise RuntimeError(f"expected {args.num_processes} processes, got {jax.process_count()}")
  _tick("runtime started")
  mesh = sharding.make_mesh(MESH)
  os.makedirs(args.workdir, exist_ok=True)
  np.savez(os.path.join(args.workdir, f"grain_{args.process_id}.npz"), **grain_batches())
  out = run_steps(mesh, args.workdir)
  if args.server:  # what each process received, in a file of its own
    np.savez(os.path.join(args.workdir, f"relayed_{args.process_id}.npz"),
             **relayed_scores(args.server))
  if distributed.is_main():
    np.savez(os.path.join(args.workdir, "result.npz"),
             sft_loss=out["sft_loss"], mopd_loss=out["mopd_loss"],
             teacher_lp=np.stack(out["teacher_lp"]), restored_equal=out["restored_equal"],
             mixed_lp=out["mixed_lp"], hf_equal=out["hf_equal"],
             **{f"param_{i}": p for i, p in enumerate(out["params"])})
  distributed.sync("done")


if __name__ == "__main__":
  main()
