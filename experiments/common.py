"""What the measurement scripts share: a finished run's context and one of its policies, and
each policy's next-token or next-character distribution after given prefixes."""
import numpy as np
from absl import app


def run_of(argv, *, config, workdir: str):
  """The stages.context.Run of the run in `workdir` made with `config` (the locked
  ConfigDict with its overrides); UsageError for stray arguments or a missing workdir."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not workdir:
    raise app.UsageError("--workdir is required")
  import jax  # pylint: disable=g-import-not-at-top  (after absl's flags are parsed)
  from mopd_jax import configure  # pylint: disable=g-import-not-at-top
  from mopd_jax.stages.context import Run  # pylint: disable=g-import-not-at-top
  return Run(configure.build(config, jax.device_count()), workdir)


def run_and_params(argv, *, config, workdir: str, params: str):
  """(`run_of`'s Run, the policy saved under `workdir/<params>`, e.g. `sft/params`)."""
  from mopd_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
  ctx = run_of(argv, config=config, workdir=workdir)
  return ctx, checkpoint.load_params(ctx.path(*params.split("/")), ctx.policies.like())


def next_logprobs(model_cfg, params, rows, *, pad_id: int) -> np.ndarray:
  """[N, V] log-probs of the token after each id list of `rows` (left-padded, one batch)."""
  import jax  # pylint: disable=g-import-not-at-top
  from mopd_jax import models  # pylint: disable=g-import-not-at-top
  width = max(map(len, rows))
  arr = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width), bool)
  for r, x in enumerate(rows):
    arr[r, width - len(x):], mask[r, width - len(x):] = x, True
  h = models.hidden_states(model_cfg, params, arr, input_mask=mask)
  return np.asarray(jax.nn.log_softmax(models.logits_from_hidden(model_cfg, params, h[:, -1]),
                                       -1))


def char_logprobs(teacher_cfg, teacher, trajs, exs, *, toks: tuple, shown, cell: str) -> tuple:
  """([N, T, V_s] the teacher's next-character log-probs at each position of the student's
  trajectories `trajs` of examples `exs`, [N] each response's start in them): the rows laid
  out for the teacher (`alignment.cross_view`, its prompt with the effort `shown` gives) and
  read by `char_marginal.targets`. `toks`: (the student's tokenizer, the teacher's)."""
  from mopd_jax.rollout import turns  # pylint: disable=g-import-not-at-top
  from mopd_jax.teachers import alignment, bank, char_marginal  # pylint: disable=g-import-not-at-top
  from mopd_jax.training import mopd  # pylint: disable=g-import-not-at-top
  tok, ttok = toks
  n = len(trajs)
  arr = turns.pad_batch(list(trajs), tok.pad_id, turns.padded_width(
      max(len(t.prompt_ids) + t.num_tokens for t in trajs), 32))
  t_arr, spans, aligned = alignment.cross_view(tok, ttok, trajs, examples=exs,
                                               width_multiple=32, shown=[shown] * n)
  index = bank.stratify(np.zeros(n, int), 1, n)
  zeros = np.zeros(n)
  sampled = mopd.SampledBatch(
      arr=arr, index=index, tokens=bank.gather_stratified(t_arr["tokens"], index),
      input_mask=bank.gather_stratified(t_arr["input_mask"], index, False),
      cell_ids=zeros.astype(int), accuracy=zeros, lengths=zeros, over=zeros.astype(bool),
      spans=spans, alignments=aligned, tokenizers=(tok, ttok))
  lp, ok, _ = char_marginal.targets(bank.build_bank(teacher_cfg, [teacher], names=[cell]),
                                    sampled, char_marginal.table_for(tok, ttok),
                                    student_tok=tok, teacher_tok=ttok)
  return lp, ok, np.asarray([s[0] for s in spans])


def claim_split(probs_NxM, *, claimed, true) -> dict:
  """How a policy's choice among M values relates to a value its prompt claims (`claimed`,
  [N]) and the true one (`true`, [N]), from its probabilities of the M values (`probs_NxM`,
  renormalised over them). Per group of prompts ("stale": the claim is wrong, "fresh": it is
  right) the prompts, the mean probability of the claimed value, of the true one and of the
  others; on the stale prompts the share whose most likely value is the true one and the
  claimed one."""
  p = np.asarray(probs_NxM, np.float64)
  p = p / p.sum(-1, keepdims=True)
  claimed, true = np.asarray(claimed), np.asarray(true)
  rows = np.arange(len(p))
  out = {}
  for name, sel in (("stale", claimed != true), ("fresh", claimed == true)):
    if not sel.any():
      continue
    pc, pt = p[rows, claimed][sel], p[rows, true][sel]
    out[name] = {"prompts": int(sel.sum()), "claimed": float(pc.mean()), "true": float(pt.mean()),
                 "other": float((1 - pc - (pt if name == "stale" else 0)).mean())}
  stale = claimed != true
  if stale.any():
    top = p.argmax(-1)[stale]
    out["stale"]["argmax"] = {"true": float(np.mean(top == true[stale])),
                              "claimed": float(np.mean(top == claimed[stale]))}
  return out
