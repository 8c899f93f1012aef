"""Continuous batching: a fixed number of decode slots fed from a queue of prompts.

    out = ContinuousSampler(model_cfg, SamplingConfig(...), slots=8)(
        params, prompts, rng, max_new=caps)   # the same `sampling.Rollout` as `Sampler`

A static batch decodes until its longest row stops, so rows whose lengths differ by one or
two orders of magnitude (a low-effort answer beside a max-effort trace) leave most of the
batch idle. Here each of `slots` rows decodes its own sequence; when one finishes (a stop
token or its cap), the host prefills the next waiting prompt into that slot and decoding
goes on, so the batch stays full until the queue is empty.

Exactness: a slot holds its row exactly as the static sampler lays it out (the prompt
left-aligned to the queue's bucket P at cache slots [0, P), generated token j at P + j,
RoPE positions from the prompt's own length), the draws are `fold_in(row key, position)`
(`token_draw.row_uniforms`), and attention masks every slot a row does not own. A row's
tokens are therefore those of `sampling.Sampler` for the same row key, and its log-probs
equal them up to float reassociation, whatever the order in which rows finish.

Programs, each jitted once per (prompt bucket, slots) and shared by every sampler of the
same model and decode settings (neither the queue length nor the temperature, a runtime
argument with 0 = greedy, `token_draw.sample_token_at`, is static): fill (one batched
prefill of the queue's first S rows into the empty slots), insert (the prefill of one prompt
into one free slot) and decode (a `while_loop` that runs until some slot is free while
prompts wait, or every slot is done). With params on a mesh the slots are split over its
batch axes (`data`, `fsdp`) when they divide; across processes every process drives the
same loop on replicated inputs, like `Sampler`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mopd_jax import models
from mopd_jax.models import KVCache, ModelConfig
from mopd_jax.rollout import sampling, token_draw
from mopd_jax.runtime import distributed, sharding


@flax.struct.dataclass
class SlotState:
  """Every decode slot's sequence; all arrays lead with the slot axis [S, ...]."""
  cache: KVCache  # [S, KV, P + N, hd] per layer; `index` unused (each slot has its own)
  token: jax.Array  # [S] int32: the next token to write
  logprob: jax.Array  # [S] float32: its log-prob
  count: jax.Array  # [S] int32: tokens written (the next one goes to cache slot P + count)
  limit: jax.Array  # [S] int32: the row's cap on generated tokens
  done: jax.Array  # [S] bool: finished, or holds no row
  positions: jax.Array  # [S] int32: RoPE position of `token`
  uniforms: jax.Array  # [S, N + 1] float32: the row's draws for generated tokens 0..N
  tokens: jax.Array  # [S, N] int32: generated tokens
  logprobs: jax.Array  # [S, N] float32


def _empty_state(model_cfg: ModelConfig, scfg: sampling.SamplingConfig, slots: int,
                 *, width: int) -> SlotState:
  n = scfg.max_new_tokens
  zi = jnp.zeros((slots,), jnp.int32)
  return SlotState(cache=models.init_cache(model_cfg, slots, width), token=zi,
                   logprob=jnp.zeros((slots,), jnp.float32), count=zi, limit=zi,
                   done=jnp.ones((slots,), bool), positions=zi,
                   uniforms=jnp.zeros((slots, n + 1), jnp.float32),
                   tokens=jnp.full((slots, n), scfg.pad_id, jnp.int32),
                   logprobs=jnp.zeros((slots, n), jnp.float32))


def _insert(model_cfg: ModelConfig, scfg: sampling.SamplingConfig, params, state: SlotState,
            row: tuple, temperature) -> SlotState:
  """Prefill one left-aligned prompt [1, P] into a slot and draw its first token. `row`:
  (slot, prompt [1, P], its mask, the row's key, its token limit).

  `sampling.prefill` (what the static sampler runs) fills a one-row cache; its first P
  slots and its validity (none past P) then replace the slot's row, so the previous row's
  k/v left beyond P are masked."""
  slot, prompt, mask, key, limit = row
  n = scfg.max_new_tokens
  b, p = prompt.shape
  own = models.init_cache(model_cfg, 1, p, dtype=state.cache.layers[0]["k"].dtype)
  prompt_len = jnp.sum(mask, axis=-1).astype(jnp.int32)  # [1]
  hidden, one = sampling.prefill(model_cfg, params, prompt, mask=mask, cache=own)
  one = one.replace(valid=jnp.pad(one.valid, ((0, 0), (0, state.cache.num_slots - p))))
  logits = models.decode_logits(model_cfg, params, hidden[:, -1])
  uniforms = token_draw.uniform_table(key[None], prompt_len, n + 1)  # [1, N + 1]
  tok, lp = token_draw.sample_token_at(logits, uniforms[:, 0], scfg, temperature=temperature)
  put = lambda big, small: jax.lax.dynamic_update_slice(
      big, small.astype(big.dtype), (slot,) + (0,) * (big.ndim - 1))
  layers = tuple({k: put(big[k], small[k]) for k in big}
                 for big, small in zip(state.cache.layers, one.layers))
  return SlotState(
      cache=state.cache.replace(layers=layers, valid=put(state.cache.valid, one.valid)),
      token=put(state.token, tok), logprob=put(state.logprob, lp),
      count=put(state.count, jnp.zeros((1,), jnp.int32)),
      limit=put(state.limit, limit[None]), done=put(state.done, jnp.zeros((1,), bool)),
      positions=put(state.positions, prompt_len), uniforms=put(state.uniforms, uniforms),
      tokens=put(state.tokens, jnp.full((1, n), scfg.pad_id, jnp.int32)),
      logprobs=put(state.logprobs, jnp.zeros((1, n), jnp.float32)))


def _fill(model_cfg: ModelConfig, scfg: sampling.SamplingConfig, params, state: SlotState,
          rows: tuple, temperature) -> SlotState:
  """Prefill S prompts [S, P] into the S (empty) slots at once: the start of every queue,
  one batched prefill like the static sampler's instead of S inserts. `rows`: (prompts,
  their mask, the rows' keys, their token limits, live [S]); slots where `live` is False (a
  queue shorter than the slots; their rows are copies) start done."""
  prompts, mask, keys, limits, live = rows
  n = scfg.max_new_tokens
  s = prompts.shape[0]
  hidden, cache = sampling.prefill(model_cfg, params, prompts, mask=mask, cache=state.cache)
  logits = models.decode_logits(model_cfg, params, hidden[:, -1])
  prompt_len = jnp.sum(mask, axis=-1).astype(jnp.int32)
  uniforms = token_draw.uniform_table(keys, prompt_len, n + 1)
  tok, lp = token_draw.sample_token_at(logits, uniforms[:, 0], scfg, temperature=temperature)
  return SlotState(cache=cache, token=tok, logprob=lp, count=jnp.zeros((s,), jnp.int32),
                   limit=limits, done=~live, positions=prompt_len,
                   uniforms=uniforms, tokens=jnp.full((s, n), scfg.pad_id, jnp.int32),
                   logprobs=jnp.zeros((s, n), jnp.float32))


def _decode(model_cfg: ModelConfig, scfg: sampling.SamplingConfig, params, state: SlotState,
            prompt_width, refill, temperature) -> SlotState:
  """Decode every live slot until one is done while `refill` (prompts wait), or all are.

  Step for step what `sampling._generate`'s loop body does for a row, with the row's own
  count in place of the batch's step."""
  n = scfg.max_new_tokens
  s_idx = jnp.arange(state.done.shape[0])
  stop_ids = jnp.asarray(scfg.stop_tokens or (-1,), jnp.int32)
  last_slot = state.cache.num_slots - 1

  def cond(s: SlotState):
    return ~jnp.all(s.done) & ~(refill & jnp.any(s.done))

  def body(s: SlotState):
    live = ~s.done
    tok = jnp.where(live, s.token, scfg.pad_id)
    col = jnp.minimum(s.count, n - 1)  # a done row's count may be n; it writes nothing
    tokens = s.tokens.at[s_idx, col].set(jnp.where(live, tok, s.tokens[s_idx, col]))
    logprobs = s.logprobs.at[s_idx, col].set(jnp.where(live, s.logprob, s.logprobs[s_idx, col]))
    done = (s.done | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            | (s.count + 1 >= s.limit))
    # A finished row still runs (its slot is refilled, or ignored); it writes its k/v one
    # past its last token, marked invalid, and never past the cache.
    write_at = jnp.minimum(prompt_width + s.count, last_slot)
    hidden, cache = models.forward_at_slots(model_cfg, params, tok[:, None],
                                            positions=s.positions[:, None],
                                            input_mask=live[:, None], cache=s.cache,
                                            row_slots=write_at)
    logits = models.decode_logits(model_cfg, params, hidden[:, 0])
    u = jnp.take_along_axis(s.uniforms, jnp.minimum(s.count + 1, n)[:, None], axis=1)[:, 0]
    nxt, nlp = token_draw.sample_token_at(logits, u, scfg, temperature=temperature)
    return s.replace(cache=cache, token=nxt, logprob=nlp, count=s.count + live, done=done,
                     positions=s.positions + live, tokens=tokens, logprobs=logprobs)

  return jax.lax.while_loop(cond, body, state)


# The order in which waiting prompts take free slots. Rows are independent (exactness above),
# so the order changes only the time: "longest_cap_first" admits rows by their cap, largest
# first (ties in queue order), the longest-processing-time rule, which keeps a long row from
# starting last and decoding alone while the queue is empty; "fifo" admits in queue order.
ADMISSION = ("longest_cap_first", "fifo")


class ContinuousSampler:
  """`slots` decode slots fed from the queue of a call's prompts; params are call arguments.

  Takes and returns what `sampling.Sampler` does (same validation and errors, a `Rollout`
  [Q, P + N] for Q prompts); `max_traces` (tests) wraps the fill, insert and decode programs
  in `chex.assert_max_traces`. `last_stats`: the last call's decode calls and rows."""

  def __init__(self, model_cfg: ModelConfig, scfg: sampling.SamplingConfig, slots: int,
               *, admission: str = "longest_cap_first", max_traces: Optional[int] = None):
    if not isinstance(slots, (int, np.integer)) or isinstance(slots, bool) or slots < 1:
      raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    if admission not in ADMISSION:
      raise ValueError(f"admission must be one of {ADMISSION}, got {admission!r}")
    self.admission = admission
    self.static = sampling.Sampler(model_cfg, scfg)  # validation, buckets, the decode model
    self.model_cfg, self.scfg, self.slots = self.static.model_cfg, scfg, int(slots)
    # The temperature is an argument of the programs (0 = greedy), not part of their static
    # config: every sampler of one model and decode setting runs the same programs,
    # whatever its temperature.
    self.temperature = np.float32(0.0 if scfg.is_greedy else scfg.temperature)
    self._pscfg = program_config(scfg)
    # The programs see the params `decode_params` returns (fake-quantised once, in the
    # decode layout), so they run the config's decode twin (`sampling.decode_config`).
    mcfg = sampling.decode_config(self.model_cfg, scfg)
    if max_traces is None:
      self._fill, self._insert, self._decode = _programs(mcfg, self._pscfg)
    else:  # a sampler of its own, each program wrapped in a trace counter
      self._fill, self._insert, self._decode = _programs.__wrapped__(mcfg, self._pscfg,
                                                                      max_traces=max_traces)
    self.last_stats = {}

  def decode_params(self, params):
    """The params the programs decode with: fake-quantised (QAT) and cast (bf16) once per
    call, not in every insert and decode."""
    return _decode_params(self.static.model_cfg, self._pscfg)(params)

  def _state(self, params, width: int, slots: int) -> SlotState:
    try:
      mesh = distributed.mesh_of(params)
    except ValueError:
      mesh = None
    if mesh is None:
      return _state_init(self.model_cfg, self._pscfg, slots, width=width, shard=None)()
    n = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES if a in mesh.shape]))
    spec = P(tuple(a for a in sharding.BATCH_AXES if a in mesh.shape)) if slots % n == 0 else P()
    return _state_init(self.model_cfg, self._pscfg, slots, width=width,
                       shard=NamedSharding(mesh, spec))()

  def __call__(self, params, prompts, rng, *, prompt_mask=None, row_keys=None,
               max_new=None) -> sampling.Rollout:
    tokens, mask = self.static.prepare(prompts, prompt_mask)
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    q, p = tokens.shape
    n = self.scfg.max_new_tokens
    limits, row_keys = self.static.row_args(q, rng, row_keys, max_new=max_new)
    row_keys = np.asarray(row_keys)
    if jax.process_count() > 1:
      rep = NamedSharding(distributed.mesh_of(params), P())
      put = lambda *xs: distributed.to_global(xs, rep)
    else:
      put = lambda *xs: xs
    dparams = self.decode_params(params)
    # A queue shorter than the slots decodes in the power of two of slots that holds it, but
    # never fewer than a quarter of the slots: at most three shapes per bucket (the static
    # engine's batch buckets follow the same rule), so the last turns of a multi-turn batch,
    # with few live rows, do not compile programs of 1, 2, 4 ... slots.
    slots = rollout_slots(q, self.slots)
    state = self._state(dparams, p + n, slots)
    out_tok = np.full((q, n), self.scfg.pad_id, np.int32)
    out_lp = np.zeros((q, n), np.float32)
    out_len = np.zeros((q,), np.int32)
    queue = (np.argsort(-limits, kind="stable") if self.admission == "longest_cap_first"
             else np.arange(q))
    decodes = 0
    width, temp = put(np.int32(p), self.temperature)
    # Every slot starts empty: one batched prefill of the first rows (copies of the first
    # row, left done, in slots a short queue does not fill).
    k = min(q, slots)
    first = np.concatenate([queue[:k], np.repeat(queue[:1], slots - k)])
    state = self._fill(dparams, state, put(tokens[first], mask[first], row_keys[first],
                                           limits[first].astype(np.int32),
                                           np.arange(slots) < k), temp)
    slot_row, nxt = [int(r) for r in queue[:k]] + [-1] * (slots - k), k
    while True:
      for sl in range(slots):
        if slot_row[sl] < 0 and nxt < q:
          r = int(queue[nxt])
          state = self._insert(dparams, state, put(
              np.int32(sl), tokens[r:r + 1], mask[r:r + 1], row_keys[r], np.int32(limits[r])),
              temp)
          slot_row[sl], nxt = r, nxt + 1
      if all(r < 0 for r in slot_row):
        break
      state = self._decode(dparams, state, width, *put(np.bool_(nxt < q)), temp)
      decodes += 1
      done, count = distributed.gather((state.done, state.count))
      finished = [sl for sl in np.flatnonzero(done) if slot_row[sl] >= 0]
      if finished:  # one transfer of every slot's tokens, not a slicing program per slot
        toks, lps = distributed.gather((state.tokens, state.logprobs))
      for sl in finished:
        r, c = slot_row[sl], int(count[sl])
        out_tok[r, :c], out_lp[r, :c], out_len[r] = toks[sl, :c], lps[sl, :c], c
        slot_row[sl] = -1
    self.last_stats = {"decode_calls": decodes, "rows": q}
    return _assemble(tokens, mask, out_tok, out_lp=out_lp, out_len=out_len, scfg=self.scfg)


def rollout_slots(rows: int, slots: int) -> int:
  """The slots a queue of `rows` decodes in: `slots`, or for a shorter queue the power of two
  that holds it, at least slots / 4."""
  return min(slots, max(1 << max(rows - 1, 0).bit_length(), -(-slots // 4)))


def _assemble(tokens, mask, out_tok, *, out_lp, out_len, scfg) -> sampling.Rollout:
  """The static sampler's layout [Q, P + N] from the prompts and each row's tokens."""
  q, n = out_tok.shape
  written = np.arange(n)[None, :] < out_len[:, None]
  stop = np.isin(out_tok, np.asarray(scfg.stop_tokens or (-1,))) & written
  return sampling.Rollout(
      tokens=np.concatenate([tokens, np.where(written, out_tok, scfg.pad_id)], 1).astype(np.int32),
      input_mask=np.concatenate([mask, written], 1),
      loss_mask=np.concatenate([np.zeros_like(mask), written], 1),
      logprobs=np.concatenate([np.zeros(mask.shape, np.float32),
                               np.where(written, out_lp, 0.0)], 1).astype(np.float32),
      prompt_lengths=mask.sum(1).astype(np.int32), lengths=out_len.copy(),
      stopped=stop.any(1))


def program_config(scfg: sampling.SamplingConfig) -> sampling.SamplingConfig:
  """The static config of the programs that serve `scfg`: its temperature set apart (the
  programs take it as an argument), so samplers that differ only there share them."""
  return dataclasses.replace(scfg, temperature=1.0, greedy=False)


@functools.lru_cache(maxsize=16)
def _programs(mcfg: ModelConfig, pscfg: sampling.SamplingConfig, *,
              max_traces: Optional[int] = None):
  """The jitted fill, insert and decode programs of one (decode model, program config),
  shared by every sampler of that pair."""
  # Three plain functions (chex.assert_max_traces counts per function code and does not
  # take partials).
  def fill(*args):
    return _fill(mcfg, pscfg, *args)

  def insert(*args):
    return _insert(mcfg, pscfg, *args)

  def decode(*args):
    return _decode(mcfg, pscfg, *args)

  programs = {"fill": fill, "insert": insert, "decode": decode}
  if max_traces is not None:
    programs = {k: chex.assert_max_traces(f, n=max_traces) for k, f in programs.items()}
  return tuple(jax.jit(programs[k], donate_argnums=1) for k in ("fill", "insert", "decode"))


@functools.lru_cache(maxsize=16)
def _decode_params(model_cfg: ModelConfig, scfg: sampling.SamplingConfig):
  return jax.jit(lambda params: sampling.decode_weights(model_cfg, scfg, params)[1])


@functools.lru_cache(maxsize=64)
def _state_init(model_cfg: ModelConfig, scfg: sampling.SamplingConfig, slots: int, *, width: int,
                shard):
  """A compiled allocator of the empty slot state (every slot done), laid out `shard`."""
  fn = lambda: _empty_state(model_cfg, scfg, slots, width=width)
  if shard is None:
    return jax.jit(fn)
  rep = NamedSharding(shard.mesh, P())
  return jax.jit(fn, out_shardings=jax.tree.map(lambda x: shard if x.ndim else rep,
                                                jax.eval_shape(fn)))
