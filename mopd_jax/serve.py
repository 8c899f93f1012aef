"""The teacher server's entry point: the teacher bank a run config describes, served over HTTP
by `mopd_jax.teachers.server` (what it serves and how: documented there).

    python -m mopd_jax.serve --config configs/toy.py --teachers WORKDIR/teachers.json
    python -m mopd_jax.serve --config configs/qwen3_mopd.py --hf_path DIR --cell gen/max
    python -m mopd_jax.serve --config configs/toy.py --teachers WORKDIR/teachers.json \
        --export_dir DIR   # for vLLM or SGLang: each cell's checkpoint, temperature folded in
    python -m mopd_jax.serve --config ... --teachers ... --cells gen/low,gen/high  # some cells

Teachers of several families (`teacher.tokenizer_paths`): a server holds one family, named
by `--cells`; the export writes every family's cells.

It builds the bank through the run context (`stages.context.Run`: the same checks as the
trainer's bank), so it sits above the stages, beside the pipeline.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

import jax
import numpy as np

from mopd_jax import configure, models
from mopd_jax.io import hf, storage
from mopd_jax.runtime import allocator
from mopd_jax.stages.context import Run
from mopd_jax.teachers import bank as teachers, families
from mopd_jax.teachers.server import TeacherServer


def bank_from_config(config, *, teachers_path: str = "", hf_path: str = "",
                     cell: str = "") -> tuple:
  """(bank, tokenizer) a run config describes: the manifest's teachers (`teachers_path`),
  or one Hugging Face checkpoint served as `cell`, with their own tokenizer (the student's
  unless the config names the teachers' own). Checked like the trainer's bank; teachers of
  several families come as a `families.MixedBank` (tokenizer None): `family_banks` splits
  it."""
  if bool(teachers_path) == bool(hf_path):
    raise ValueError("give exactly one of --teachers (a teachers.json) and --hf_path")
  workdir = str(storage.path(teachers_path).parent) if teachers_path else os.getcwd()
  ctx = Run(configure.build(config, jax.device_count()), workdir)
  if teachers_path:
    bank = ctx.teachers.load_bank(teachers_path)
    return bank, (None if ctx.teachers.mixed else ctx.teachers.tok)
  if cell.count("/") != 1:
    raise ValueError(f"--cell must name the checkpoint's cell as 'domain/effort', got "
                     f"{cell!r}")
  tok = ctx.teachers.cell_toks.get(cell, (ctx.teachers.tok,))[0]
  cfg = ctx.teachers.resolve_hf(hf_path, tok)
  if tok is ctx.tok:
    teachers.check_compatible(ctx.model_cfg, cfg)
  _, params = hf.load_checkpoint(hf_path, vocab_size=cfg.vocab_size)
  return teachers.build_bank(cfg, [params], names=[cell]), tok


def family_banks(bank, tok, cells: Sequence[str] = ()) -> list:
  """[(TeacherBank, tokenizer)] of the teachers one server may hold: one per family of
  `bank` (a TeacherBank with its tokenizer `tok`, or a `families.MixedBank`), each kept to
  `cells` when given (default: every cell). A cell the bank does not hold: ValueError."""
  parts = ([(p, f.tok) for p, f in zip(bank.parts, bank.families)]
           if isinstance(bank, families.MixedBank) else [(bank, tok)])
  held = [c for p, _ in parts for c in p.router.names]
  unknown = sorted(set(cells) - set(held))
  if unknown:
    raise ValueError(f"--cells names {unknown}, which the teachers do not hold ({held})")
  out = []
  for part, part_tok in parts:
    names = [c for c in part.router.names if not cells or c in cells]
    if len(names) < len(part.router.names) and names:
      idx = np.asarray([list(part.router.names).index(c) for c in names])
      part = part.replace(params=jax.tree.map(lambda x, idx=idx: x[idx], part.params),
                          router=teachers.Router(tuple(names)))
    if names:
      out.append((part, part_tok))
  return out


def export_teachers(bank: teachers.TeacherBank, tok, *, temperature: float,
                    out_dir: str) -> dict:
  """{cell: directory}: each cell's teacher with the scoring `temperature` folded into its
  weights (`models.with_temperature`), written as a Hugging Face checkpoint
  `out_dir/<domain>_<effort>`, so that an engine scoring prompts from the raw logits (vLLM,
  SGLang) scores at that temperature."""
  params = models.with_temperature(bank.params, temperature)
  out = {}
  for k, cell in enumerate(bank.router.names):
    path = storage.join(out_dir, cell.replace("/", "_"))
    hf.save_checkpoint(bank.model_cfg, jax.tree.map(lambda x, k=k: x[k], params), path,
                       extra_config={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
    out[cell] = path
  return out


def main(argv=None) -> None:
  from absl import app, flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config = config_flags.DEFINE_config_file("config", None, "The run's config file.",
                                           lock_config=True)
  teachers_path = flags.DEFINE_string("teachers", "", "A teacher manifest (teachers.json).")
  hf_path = flags.DEFINE_string("hf_path", "", "One Hugging Face teacher checkpoint.")
  cell = flags.DEFINE_string("cell", "", "The cell (domain/effort) --hf_path serves.")
  cells = flags.DEFINE_string("cells", "", "Comma-separated cells of --teachers to serve "
                              "(default: all); teachers of several families: one family's.")
  host = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
  port = flags.DEFINE_integer("port", 8000, "Port to listen on (0 = any free one).")
  max_batch_rows = flags.DEFINE_integer("max_batch_rows", 256, "Most requests per round.")
  max_wait_ms = flags.DEFINE_float("max_wait_ms", 10.0,
                                   "How long a round's first request waits for others.")
  max_logprobs = flags.DEFINE_integer("max_logprobs", 20, "Largest prompt_logprobs accepted.")
  batch_invariant = flags.DEFINE_bool(
      "batch_invariant", True, "Score each row in a program of its own shape, so that its "
      "answer does not depend on the requests batched with it (bitwise reproducible runs).")
  api_key_env = flags.DEFINE_string(
      "api_key_env", "", "An environment variable holding the API key every /v1 request "
      "must carry as 'Authorization: Bearer <key>' (as vllm serve --api-key); '' = none.")
  export_dir = flags.DEFINE_string(
      "export_dir", "", "Instead of serving: write each cell's teacher, the config's "
      "mopd.teacher_temperature folded into its weights, as a Hugging Face checkpoint "
      "DIR/<domain>_<effort> for vLLM or SGLang, and print their launch lines.")

  def run(_):
    import logging  # pylint: disable=g-import-not-at-top
    logging.getLogger("tornado.access").setLevel(logging.WARNING)  # not a line per request
    api_key = None
    if api_key_env.value:
      api_key = os.environ.get(api_key_env.value)
      if not api_key:
        raise SystemExit(f"--api_key_env={api_key_env.value}: that environment variable is "
                         "unset or empty")
    bank, tok = bank_from_config(config.value, teachers_path=teachers_path.value,
                                 hf_path=hf_path.value, cell=cell.value)
    wanted = [c.strip() for c in cells.value.split(",") if c.strip()]
    try:
      parts = family_banks(bank, tok, wanted)
    except ValueError as e:
      raise SystemExit(f"config error: {e}") from None
    if export_dir.value:
      dirs = {}
      for part, part_tok in parts:
        dirs.update(export_teachers(part, part_tok, out_dir=export_dir.value,
                                    temperature=config.value.mopd.teacher_temperature))
      for number, (name, path) in enumerate(dirs.items(), 8001):
        print(f"vllm serve {path} --served-model-name {name} --dtype float32 "
              f"--skip-tokenizer-init --max-logprobs 20 --port {number}", flush=True)
      return
    if len(parts) > 1:
      raise SystemExit(
          "config error: the teachers are of " + str(len(parts)) + " families (" +
          "; ".join(",".join(p.router.names) for p, _ in parts) + "): a server holds one "
          "tokenizer, so serve each family with --cells")
    bank, tok = parts[0]
    server = TeacherServer(bank, tok, temperature=config.value.mopd.teacher_temperature,
                           max_batch_rows=max_batch_rows.value,
                           max_wait_s=max_wait_ms.value / 1000,
                           max_logprobs=max_logprobs.value,
                           batch_invariant=batch_invariant.value, api_key=api_key)
    print(f"[serve] {len(server.cells)} cell(s) {list(server.cells)} on "
          f"{jax.device_count()} {jax.default_backend()} device(s)", flush=True)
    server.serve(host.value, port.value)
    print("[serve] stopped", flush=True)

  flags.mark_flags_as_required(["config"])
  app.run(run, argv=argv)


if __name__ == "__main__":
  allocator.reexec("mopd_jax.serve", sys.argv)  # tcmalloc where the machine has it
  main()
