"""Real-scale memory plans: `python -m benchmarks.memory_plan --config configs/qwen3_mopd.py`.

Lowers and compiles (never runs) the four programs of a MOPD step at the config's real shapes
on a simulated mesh of CPU devices, and prints what XLA's buffer assignment needs per device
next to the accelerator's memory:

  * sampler prefill      the student prefills B_dec prompts of P tokens into a KV cache of
                         P + N slots (cache donated);
  * sampler decode step  one token for all B_dec rows against the full cache, each row at its
                         own cache slot (the body of the continuous sampler's `while_loop`,
                         which dominates sampling memory);
  * teacher prefill      the nine stacked teachers score a stratified [K, b, T] batch
                         (`teachers.score_stratified`), co-located on the student's mesh or on
                         their own sub-mesh (`placement.teachers`);
  * MOPD train step      the Trainer's jitted step (state donated) on K * b rows of T tokens,
                         with the student's activation rematerialisation (`model.remat`) and
                         gradient accumulation over `plan.microbatches` equal slices of the
                         rows (`OptimConfig.microbatches`), as the header line reports.

Every argument is a `jax.ShapeDtypeStruct` carrying its `NamedSharding`, so nothing is
allocated: a 9 x 1.7B bank plans on a laptop. Numbers come from
`compiled.memory_analysis()`: argument, output and temp bytes of one device's program;
`peak = args + outputs + temp - aliased` (donated buffers counted once). CPU buffer
assignment is close to, not identical with, the TPU/GPU one (fusion decisions differ), so read
the table as a plan with a margin, not a guarantee.

Flags: `--config path[:variant]`, `--devices N` (overrides `plan.devices`),
`--only name,...` (a subset of prefill,decode,teacher,train), `--placement disaggregated`
(teachers on `plan.teacher_mesh`, extra devices), `--remat none|block|dots` (overrides
`model.remat`), `--microbatches M` (overrides `plan.microbatches`), `--json`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def load_config(spec: str):
  """`path/to/config.py[:arg]` -> its get_config(arg) (the config_flags convention)."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_plan_config", path)
  if module_spec is None:
    raise FileNotFoundError(f"no config file at {path}")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def _force_devices(n: int) -> None:
  """Simulated CPU devices; must run before JAX initialises a backend."""
  if "jax" in sys.modules:
    import jax
    if jax.device_count() < n:
      raise RuntimeError(f"JAX is already initialised with {jax.device_count()} devices; the "
                         f"plan needs {n}: run it as its own process")
    return
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={n}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


# --------------------------------------------------------------------- library (JAX imported)

def _abstract(tree, shardings):
  import jax
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _stats(compiled) -> dict:
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError("this backend reports no memory analysis")
  args, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
  temp, alias = int(m.temp_size_in_bytes), int(m.alias_size_in_bytes)
  return {"args": args, "out": out, "temp": temp, "alias": alias,
          "peak": args + out + temp - alias}


# LLVM code generation at -O0: buffer assignment (what the table reports) happens on the
# HLO before it and is unchanged (measured: identical bytes for the 0.6B train step), while
# compilation on CPU gets ~1.5x faster. The programs are never run, so slow code is free.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                    "xla_llvm_disable_expensive_passes": True}


def _lower(name, fn, args, in_shardings, out_shardings, donate=(), what="") -> dict:
  import jax
  t = time.perf_counter()
  compiled = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                     donate_argnums=donate).lower(*args).compile(COMPILER_OPTIONS)
  return {"name": name, "shapes": what, **_stats(compiled),
          "compile_s": time.perf_counter() - t}


def _cache_shardings(mesh, cache):
  """KV cache [B, KV, S, hd]: rows over the batch axes, kv heads over `tensor` (when they
  divide), as the attention einsums want them."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from mopd_jax.runtime import sharding
  kv = cache.layers[0]["k"].shape[1]
  b = cache.valid.shape[0]
  tensor = "tensor" if kv % mesh.shape["tensor"] == 0 and mesh.shape["tensor"] > 1 else None
  rows = sharding.BATCH_AXES if b % sharding._axis_size(mesh, sharding.BATCH_AXES) == 0 else None
  layer = NamedSharding(mesh, P(rows, tensor, None, None))
  return type(cache)(layers=tuple({"k": layer, "v": layer} for _ in cache.layers),
                     valid=NamedSharding(mesh, P(rows, None)), index=NamedSharding(mesh, P()))


def sampler_programs(cfg, mesh, batch: int, prompt_len: int, new_tokens: int) -> list:
  """Rows for the student's prefill and one decode step (params sharded as in training)."""
  import jax
  import jax.numpy as jnp

  from mopd_jax import models
  from mopd_jax.rollout import sampling, token_draw
  from mopd_jax.runtime import sharding
  p_sh = sharding.param_shardings(cfg, mesh)
  params = _abstract(jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0))),
                     p_sh)
  cache_shape = jax.eval_shape(lambda: models.init_cache(cfg, batch, prompt_len + new_tokens))
  c_sh = _cache_shardings(mesh, cache_shape)
  cache = _abstract(cache_shape, c_sh)
  row = sharding.batch_sharding(mesh, 2)
  row1 = sharding.batch_sharding(mesh, 1)
  scfg = sampling.SamplingConfig(max_new_tokens=new_tokens)

  def prefill(params, cache, tokens, mask):
    qcfg, qparams = models.materialize(cfg, params)
    hidden, cache = models.forward_with_cache(qcfg, qparams, tokens,
                                              positions=models.default_positions(mask),
                                              input_mask=mask, cache=cache)
    return cache, models.logits_from_hidden(qcfg, qparams, hidden[:, -1])

  def decode(params, cache, token, positions, live, u, write_at):
    # The sampler quantises once outside its loop; the decode body sees float weights. The
    # step of continuous batching (the rollouts' default): each row writes its k/v at its
    # own cache slot.
    qcfg, qparams = models.materialize(cfg, params)
    hidden, cache = models.forward_at_slots(qcfg, qparams, token[:, None],
                                            positions=positions[:, None],
                                            input_mask=live[:, None], cache=cache,
                                            row_slots=write_at)
    logits = models.logits_from_hidden(qcfg, qparams, hidden[:, 0])
    return cache, token_draw.sample_token(logits, u, scfg)

  sds = lambda shape, dt, s: jax.ShapeDtypeStruct(shape, dt, sharding=s)
  dec = f"B={batch}, cache {prompt_len + new_tokens} slots"
  return [
      _lower("sampler prefill", prefill,
             (params, cache, sds((batch, prompt_len), jnp.int32, row),
              sds((batch, prompt_len), jnp.bool_, row)),
             (p_sh, c_sh, row, row), (c_sh, row1), donate=(1,),
             what=f"B={batch}, P={prompt_len}"),
      _lower("sampler decode step", decode,
             (params, cache, sds((batch,), jnp.int32, row1), sds((batch,), jnp.int32, row1),
              sds((batch,), jnp.bool_, row1), sds((batch,), jnp.float32, row1),
              sds((batch,), jnp.int32, row1)),
             (p_sh, c_sh, row1, row1, row1, row1, row1), (c_sh, (row1, row1)), donate=(1,),
             what=dec),
  ]


def teacher_program(teacher_cfg, mesh, num_teachers: int, rows_per_teacher: int,
                    seq_len: int, chunk_size: int = 64) -> dict:
  """Row for the stacked bank scoring a stratified [K, b, T] batch on `mesh`."""
  import jax
  import jax.numpy as jnp

  from mopd_jax import models
  from mopd_jax.runtime import sharding
  from mopd_jax.teachers import bank as teachers, placement
  one = jax.eval_shape(lambda: models.init_params(teacher_cfg, jax.random.PRNGKey(0)))
  stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct((num_teachers,) + x.shape, x.dtype), one)
  p_sh = sharding.param_shardings(teacher_cfg, mesh, num_stacked=num_teachers)
  names = tuple(f"t{k}/e" for k in range(num_teachers))
  bank = teachers.TeacherBank(params=_abstract(stacked, p_sh), model_cfg=teacher_cfg,
                              router=teachers.Router(names))
  bank_sh = teachers.TeacherBank(params=p_sh, model_cfg=teacher_cfg,
                                 router=teachers.Router(names))
  rows = placement.stratified_sharding(mesh, num_teachers)
  shape = (num_teachers, rows_per_teacher, seq_len)
  fn = lambda bank, t, m: teachers.score_stratified(bank, t, m, chunk_size=chunk_size)
  return _lower(f"teacher prefill ({num_teachers} stacked)", fn,
                (bank, jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
                 jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=rows)),
                (bank_sh, rows, rows), rows, what=f"[K={num_teachers}, b={rows_per_teacher}, "
                                                  f"T={seq_len}]")


def train_program(cfg, mesh, batch: int, seq_len: int, loss_kind: str = "mopd",
                  microbatches: int = 1) -> dict:
  """Row for the Trainer's own jitted MOPD step (the function training runs), with the
  student config's `remat` and gradient accumulation over `microbatches` slices."""
  import jax
  import jax.numpy as jnp

  from mopd_jax import models
  from mopd_jax.training import step as train
  trainer = train.Trainer(cfg, train.LossConfig(kind=loss_kind),
                          train.OptimConfig(microbatches=microbatches), mesh=mesh)
  state = jax.eval_shape(lambda: train.init_state(
      models.init_params(cfg, jax.random.PRNGKey(0)), trainer.optimizer))
  state = _abstract(state, trainer.state_sharding)
  shape = (batch, seq_len)
  batch_tree = train.TrainBatch(
      tokens=jax.ShapeDtypeStruct(shape, jnp.int32),
      input_mask=jax.ShapeDtypeStruct(shape, jnp.bool_),
      loss_mask=jax.ShapeDtypeStruct(shape, jnp.bool_),
      sampler_logprobs=jax.ShapeDtypeStruct(shape, jnp.float32),
      teacher_logprobs=jax.ShapeDtypeStruct(shape, jnp.float32))
  batch_tree = _abstract(batch_tree, train.batch_shardings(mesh, batch_tree))
  t = time.perf_counter()
  compiled = trainer.jitted_step(batch_tree).lower(state, batch_tree).compile(COMPILER_OPTIONS)
  rows = f"B={batch}" if microbatches == 1 else (f"B={batch} ({microbatches} microbatches of "
                                                  f"{batch // microbatches})")
  return {"name": f"{loss_kind.upper()} train step",
          "shapes": f"{rows}, T={seq_len}, remat={cfg.remat}",
          **_stats(compiled), "compile_s": time.perf_counter() - t}


PROGRAMS = ("prefill", "decode", "teacher", "train")


def plan(config, only=PROGRAMS, devices=None) -> dict:
  """Compile the selected programs for `config` (a run config with a `plan` block) on
  `devices` (default: the first `plan.devices` JAX devices). Returns the table as a dict."""
  import jax

  from mopd_jax.io import hf
  from mopd_jax.runtime import sharding
  from mopd_jax.teachers import placement
  p = config.plan
  unknown = sorted(set(only) - set(PROGRAMS))
  if unknown:
    raise ValueError(f"unknown programs {unknown}; known: {PROGRAMS}")
  devices = list(jax.devices()[:p.devices] if devices is None else devices)
  if len(devices) < p.devices:
    raise ValueError(f"plan.devices={p.devices} but only {len(devices)} devices exist")
  student = hf.resolve_model_config(config.model, _preset_vocab(config.model))
  teacher = hf.resolve_model_config(config.teacher, student.vocab_size)
  student_mesh, teacher_mesh = placement.make_meshes(p.mesh, p.get("teacher_mesh"),
                                                     p.placement, devices=devices)
  k, b = p.num_teachers, p.rows_per_teacher
  sharding.check_batch_divisible(k * b, student_mesh, "plan batch (num_teachers * "
                                 "rows_per_teacher)")
  microbatches = int(p.get("microbatches", 1))
  if microbatches < 1 or (k * b) % microbatches:
    raise ValueError(f"plan.microbatches={microbatches} does not split the plan batch of "
                     f"{k * b} rows into equal microbatches")
  # Each microbatch is sharded over the batch axes like the whole batch: uneven shards would
  # pad (and plan memory for rows that do not exist).
  sharding.check_batch_divisible(k * b // microbatches, student_mesh,
                                 f"plan microbatch ({k * b} rows / {microbatches})")
  rows = []
  if "prefill" in only or "decode" in only:
    got = sampler_programs(student, student_mesh, p.decode_batch, p.prompt_len,
                           p.seq_len - p.prompt_len)
    rows += [r for r, key in zip(got, ("prefill", "decode")) if key in only]
  if "teacher" in only:
    rows.append(teacher_program(teacher, teacher_mesh, k, b, p.seq_len))
  if "train" in only:
    rows.append(train_program(student, student_mesh, k * b, p.seq_len,
                              microbatches=microbatches))
  return {"student": _describe(student), "teacher": _describe(teacher),
          "remat": student.remat, "microbatches": microbatches,
          "placement": p.placement, "student_mesh": dict(student_mesh.shape),
          "teacher_mesh": dict(teacher_mesh.shape), "devices": len(devices),
          "accelerator": p.accelerator, "accelerator_bytes": int(p.accelerator_gib * 2**30),
          "rows": rows}


def _preset_vocab(block) -> int:
  from mopd_jax import models
  return int(block.get("vocab_size") or models.PRESETS[block.preset]["vocab_size"])


def _describe(cfg) -> str:
  return (f"{cfg.num_params() / 1e9:.2f}B params, d={cfg.d_model}, L={cfg.num_layers}, "
          f"V={cfg.vocab_size}, {cfg.param_dtype}, quant={cfg.quant}")


def _mesh_size(shape) -> int:
  n = 1
  for v in dict(shape).values():
    n *= int(v)
  return n


def format_table(result: dict) -> str:
  gib = lambda x: f"{x / 2**30:.2f}"
  acc = result["accelerator_bytes"]
  lines = [f"student {result['student']}; mesh {result['student_mesh']}",
           f"teachers {result['teacher']}; {result['placement']}, mesh {result['teacher_mesh']}",
           f"train step: activation remat {result.get('remat', 'none')}, "
           f"{result.get('microbatches', 1)} microbatch(es) of gradient accumulation",
           f"per-device GiB on {result['devices']} simulated devices; accelerator "
           f"{result['accelerator']} = {gib(acc)} GiB", "",
           "| program | shapes | args | outputs | temp | aliased | peak | % of accelerator |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
  for r in result["rows"]:
    lines.append(f"| {r['name']} | {r['shapes']} | {gib(r['args'])} | {gib(r['out'])} | "
                 f"{gib(r['temp'])} | {gib(r['alias'])} | {gib(r['peak'])} | "
                 f"{100 * r['peak'] / acc:.0f}% |")
  return "\n".join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--config", required=True, help="path/to/config.py[:variant]")
  ap.add_argument("--devices", type=int, default=0, help="override plan.devices")
  ap.add_argument("--only", default=",".join(PROGRAMS), help="subset of " + ",".join(PROGRAMS))
  ap.add_argument("--placement", default="", help="override plan.placement: colocated | "
                  "disaggregated (then the teachers get plan.teacher_mesh's extra devices)")
  ap.add_argument("--remat", default="", help="override model.remat: none | block | dots")
  ap.add_argument("--microbatches", type=int, default=0, help="override plan.microbatches")
  ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
  args = ap.parse_args(argv)
  config = load_config(args.config)
  if args.remat:
    config.model.remat = args.remat
  if args.microbatches:
    config.plan.microbatches = args.microbatches
  if args.placement:
    config.plan.placement = args.placement
    if args.placement == "disaggregated" and not args.devices:
      config.plan.devices = sum(_mesh_size(config.plan[k]) for k in ("mesh", "teacher_mesh"))
  if args.devices:
    config.plan.devices = args.devices
  _force_devices(config.plan.devices)
  result = plan(config, only=tuple(s for s in args.only.split(",") if s))
  print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
  main()
