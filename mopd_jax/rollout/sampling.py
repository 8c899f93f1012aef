"""The sampler: one jitted pure function, prefill then a `lax.while_loop` decode.

    rollout = Sampler(model_cfg, SamplingConfig(max_new_tokens=64, stop_tokens=(eos,)))(
        params, prompts, rng)

Layout of a rollout (every per-token array is [B, P + N], aligned with `tokens`):
    [ pads | prompt | generated ... stop | pads ]
      P = prompt bucket (prompts are left-aligned to it), N = max_new_tokens.
`logprobs[b, t]` is the log-prob of `tokens[b, t]` under the distribution it was sampled
from; `loss_mask` is 1 exactly on generated tokens, the stop token included.

Which distribution the log-probs belong to (the "actually sampled from" convention):
  * temperature 1, no top-k/top-p: the model's own softmax, so they equal teacher-forced
    `token_logprobs` of the same params (tested to 1e-5);
  * temperature / top-k / top-p: the tempered, truncated and renormalised distribution that
    the token was drawn from (what an importance ratio needs);
  * greedy: a point mass, so the log-prob is exactly 0.

One token per row is drawn by `mopd_jax.rollout.token_draw` (inverse CDF, one uniform per row).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.models import KVCache, ModelConfig
from mopd_jax.rollout.token_draw import sample_token, uniform_table
from mopd_jax.runtime import distributed

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

DECODE_DTYPES = ("float32", "bfloat16")


def decode_model(model_cfg: ModelConfig, scfg: "SamplingConfig") -> ModelConfig:
  """The model config the sampler decodes with: bf16 activations and cache with
  `scfg.dtype="bfloat16"` (the params are cast inside the jitted sampler)."""
  return model_cfg if scfg.dtype == "float32" else model_cfg.replace(dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampler settings (hashable: one compilation per distinct config)."""

  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1.0 = off
  greedy: bool = False
  stop_tokens: tuple = ()
  pad_id: int = 0
  max_prompt_len: Optional[int] = None  # None: model max_seq_len - max_new_tokens
  buckets: tuple = DEFAULT_BUCKETS
  # "bfloat16": decode weights, activations and the KV cache in bf16 (the sampler's own
  # log-probs then differ from fp32 teacher forcing by bf16 rounding; the losses recompute
  # the policy's log-probs in fp32 anyway). "float32": the model's own dtypes.
  dtype: str = "float32"
  # Layout of the block projections the decode multiplies (`ModelConfig.weight_layout`):
  # "auto" = "out_in" on CPU (a decode step's few rows make XLA:CPU's [rows, in] @ [in, out]
  # ~1.7x slower than [out, in] @ [in, rows]; the transposed copy lives for the call) and
  # "in_out" on accelerators (no such gap, and no second copy of the weights in memory).
  weight_layout: str = "auto"

  def __post_init__(self):
    """Errors: ValueError naming the field, its value and the allowed range, for a
    non-int or non-positive max_new_tokens, a NaN, infinite or negative temperature, top_p
    outside (0, 1], a non-int or negative top_k, a non-bool greedy, a negative or non-int
    pad_id, stop token or bucket, or a max_prompt_len < 1. (pad_id and stop tokens are
    checked against the vocabulary by `Sampler`, which knows the model.)"""
    def is_int(v):
      return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))

    def is_num(v):
      return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(
          v, (bool, np.bool_)) and math.isfinite(v)

    if not is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
      raise ValueError(f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}")
    if not is_num(self.temperature) or self.temperature < 0:
      raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
    if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
    if not is_int(self.top_k) or self.top_k < 0:
      raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
    if not isinstance(self.greedy, (bool, np.bool_)):
      raise ValueError(f"greedy must be True or False, got {self.greedy!r}")
    if not is_int(self.pad_id) or self.pad_id < 0:
      raise ValueError(f"pad_id must be an int >= 0, got {self.pad_id!r}")
    if self.dtype not in DECODE_DTYPES:
      raise ValueError(f"dtype must be one of {DECODE_DTYPES}, got {self.dtype!r}")
    if self.weight_layout not in ("auto", "in_out", "out_in"):
      raise ValueError(f"weight_layout must be auto, in_out or out_in, got "
                       f"{self.weight_layout!r}")
    if self.max_prompt_len is not None and (not is_int(self.max_prompt_len) or
                                            self.max_prompt_len < 1):
      raise ValueError(f"max_prompt_len must be None or an int >= 1, got "
                       f"{self.max_prompt_len!r}")
    for name in ("stop_tokens", "buckets"):
      vals = getattr(self, name)
      if isinstance(vals, (str, bytes)) or not all(is_int(v) and v >= (0 if name[0] == "s"
                                                                       else 1) for v in vals):
        raise ValueError(f"{name} must be a tuple of ints >= {0 if name[0] == 's' else 1}, "
                         f"got {vals!r}")
    object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
    object.__setattr__(self, "top_k", int(self.top_k))
    object.__setattr__(self, "pad_id", int(self.pad_id))
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
    object.__setattr__(self, "buckets", tuple(sorted(int(b) for b in self.buckets)))

  @property
  def is_greedy(self) -> bool:
    return self.greedy or self.temperature == 0.0


@flax.struct.dataclass
class Rollout:
  tokens: jax.Array  # [B, P+N] int32
  input_mask: jax.Array  # [B, P+N] bool: prompt or generated (not padding)
  loss_mask: jax.Array  # [B, P+N] bool: generated by the policy (stop token included)
  logprobs: jax.Array  # [B, P+N] float32: sampler log-prob of each generated token, else 0
  prompt_lengths: jax.Array  # [B] int32
  lengths: jax.Array  # [B] int32: generated tokens
  stopped: jax.Array  # [B] bool: emitted a stop token (else hit max_new_tokens)


@flax.struct.dataclass
class _State:
  step: jax.Array  # [] int32: number of generated slots written
  token: jax.Array  # [B] the token to write at slot P + step
  logprob: jax.Array  # [B]
  done: jax.Array  # [B] bool: row already finished before this step
  tokens: jax.Array  # [B, N]
  logprobs: jax.Array  # [B, N]
  written: jax.Array  # [B, N] bool
  positions: jax.Array  # [B] RoPE position of `token`
  cache: KVCache


def decode_layout(scfg: SamplingConfig) -> str:
  """`scfg.weight_layout` with "auto" resolved for the default backend."""
  if scfg.weight_layout != "auto":
    return scfg.weight_layout
  return "out_in" if jax.default_backend() == "cpu" else "in_out"


def decode_config(model_cfg: ModelConfig, scfg: SamplingConfig) -> ModelConfig:
  """The config of `decode_weights`' params."""
  return model_cfg.replace(quant="none", weight_layout=decode_layout(scfg))


def decode_weights(model_cfg: ModelConfig, scfg: SamplingConfig, params,
                   *, layout: Optional[str] = None):
  """(config, params) a decode runs with: fake-quantised once (QAT), not in every step, the
  projections in `layout` (default `decode_layout(scfg)`; transposed inside the caller's
  program, once per call, outside its decode loop), and cast to bf16 with
  `scfg.dtype="bfloat16"`."""
  model_cfg, params = models.materialize(model_cfg, params)
  if scfg.dtype == "bfloat16":
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  if (layout or decode_layout(scfg)) == "out_in":
    model_cfg, params = models.to_out_in(model_cfg, params)
  return model_cfg, params


def prefill(model_cfg: ModelConfig, params, tokens, *, mask, cache: KVCache):
  """Run left-aligned prompts [B, P] into the first P slots of `cache`; (hidden, cache).

  The prompt runs against a P-slot cache of its own, so its attention costs P x P whatever
  the cache's size (a prompt of at most `DECODE_BLOCK` tokens takes the dense path), and
  is then copied into the large cache; decoding continues at slot P."""
  b, p = tokens.shape
  own = models.init_cache(model_cfg, b, p, dtype=cache.layers[0]["k"].dtype)
  hidden, own = models.forward_with_cache(model_cfg, params, tokens,
                                          positions=models.default_positions(mask),
                                          input_mask=mask, cache=own)
  put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, 0, axis=2)
  layers = tuple({k: put(big[k], small[k]) for k in big}
                 for big, small in zip(cache.layers, own.layers))
  valid = jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(cache.valid), own.valid, 0,
                                              axis=1)
  return hidden, cache.replace(layers=layers, valid=valid, index=jnp.asarray(p, jnp.int32))


def _generate(model_cfg: ModelConfig, scfg: SamplingConfig, params, *, cache: KVCache,
              prompt_tokens, prompt_mask, row_keys, row_limits):
  """Returns (final cache, rollout); the cache comes back so its donated buffer is reused.

  `row_limits` [B]: a row is finished once it has written that many tokens (its remaining
  length budget), so the loop ends when every row is stopped or at its limit instead of
  decoding tokens that would be cut anyway. A row's tokens within its limit do not depend
  on the limits."""
  b, p = prompt_tokens.shape
  n = scfg.max_new_tokens
  # The prefill runs B x P rows at once, where the stored layout is the faster one; only
  # the decode loop takes `decode_layout(scfg)`.
  pre_cfg, pre_params = decode_weights(model_cfg, scfg, params, layout="in_out")
  model_cfg, params = models.to_out_in(pre_cfg, pre_params) if decode_layout(
      scfg) == "out_in" else (pre_cfg, pre_params)
  tokens, mask = prompt_tokens, prompt_mask  # left-aligned by Sampler.prepare
  prompt_lengths = jnp.sum(mask, axis=-1).astype(jnp.int32)
  hidden, cache = prefill(pre_cfg, pre_params, tokens, mask=mask, cache=cache)
  logits = models.decode_logits(pre_cfg, pre_params, hidden[:, -1])
  # The draw for the token at sequence position p of a row is fold_in(row key, p): it depends
  # on neither the padding, the batch, nor how the trajectory was split into segments
  # (partial rollouts re-prefill the same prefix and continue with identical draws).
  uniforms = uniform_table(row_keys, prompt_lengths, n + 1)
  tok, lp = sample_token(logits, uniforms[:, 0], scfg)
  stop_ids = jnp.asarray(scfg.stop_tokens or (-1,), jnp.int32)

  state = _State(step=jnp.zeros((), jnp.int32), token=tok, logprob=lp,
                 done=jnp.zeros((b,), bool), tokens=jnp.full((b, n), scfg.pad_id, jnp.int32),
                 logprobs=jnp.zeros((b, n), jnp.float32), written=jnp.zeros((b, n), bool),
                 positions=prompt_lengths, cache=cache)

  def cond(s: _State):
    return (s.step < n) & ~jnp.all(s.done)

  def body(s: _State):
    live = ~s.done
    tok = jnp.where(live, s.token, scfg.pad_id)
    col = jax.lax.dynamic_update_slice_in_dim
    tokens = col(s.tokens, tok[:, None], s.step, axis=1)
    logprobs = col(s.logprobs, jnp.where(live, s.logprob, 0.0)[:, None], s.step, axis=1)
    written = col(s.written, live[:, None], s.step, axis=1)
    done = (s.done | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            | (s.step + 1 >= row_limits))
    hidden, cache = models.forward_with_cache(model_cfg, params, tok[:, None],
                                              positions=s.positions[:, None],
                                              input_mask=live[:, None], cache=s.cache)
    logits = models.decode_logits(model_cfg, params, hidden[:, 0])
    # A live row's next token is at position prompt length + step + 1: the table's column
    # step + 1 (finished rows' draws are never written).
    u = jax.lax.dynamic_index_in_dim(uniforms, s.step + 1, axis=1, keepdims=False)
    nxt, nlp = sample_token(logits, u, scfg)
    return _State(step=s.step + 1, token=nxt, logprob=nlp, done=done, tokens=tokens,
                  logprobs=logprobs, written=written, positions=s.positions + live,
                  cache=cache)

  s = jax.lax.while_loop(cond, body, state)
  gen_tok = jnp.where(s.written, s.tokens, scfg.pad_id)
  stopped = jnp.any(s.written & jnp.isin(gen_tok, stop_ids), axis=-1)
  return s.cache, Rollout(
      tokens=jnp.concatenate([tokens, gen_tok], axis=1),
      input_mask=jnp.concatenate([mask, s.written], axis=1),
      loss_mask=jnp.concatenate([jnp.zeros_like(mask), s.written], axis=1),
      logprobs=jnp.concatenate([jnp.zeros((b, p), jnp.float32), s.logprobs], axis=1),
      prompt_lengths=prompt_lengths,
      lengths=jnp.sum(s.written, axis=-1).astype(jnp.int32),
      stopped=stopped)


def _int_tokens(tokens: np.ndarray) -> np.ndarray:
  """Token ids as int64; float ids that are whole numbers are accepted, others refused
  (silently truncating 3.7 to 3 would sample from another prompt)."""
  if tokens.dtype == bool or not (np.issubdtype(tokens.dtype, np.integer) or
                                  np.issubdtype(tokens.dtype, np.floating)):
    raise ValueError(f"prompt token ids must be integers, got dtype {tokens.dtype}")
  if np.issubdtype(tokens.dtype, np.floating):
    bad = ~np.isfinite(tokens) | (tokens != np.round(tokens))
    if bad.any():
      raise ValueError(f"prompt token ids must be integers, got {float(tokens[bad][0])}")
  return tokens.astype(np.int64)


def _as_padded(prompts, prompt_mask, pad_id):
  """Ragged lists or a padded [B, T] array (+ mask) -> numpy tokens and mask."""
  if prompt_mask is not None:
    tokens = np.asarray(prompts)
    mask = np.asarray(prompt_mask)
    if tokens.shape != mask.shape or tokens.ndim != 2:
      raise ValueError(f"prompts {tokens.shape} and prompt_mask {mask.shape} must be the same "
                       "2-D shape")
    return _int_tokens(tokens), mask.astype(bool)
  if isinstance(prompts, (np.ndarray, jax.Array)):
    tokens = np.asarray(prompts)
    if tokens.ndim != 2:
      raise ValueError(f"prompts must be [B, T], got shape {tokens.shape}")
    tokens = _int_tokens(tokens)
    return tokens, tokens != pad_id
  if isinstance(prompts, (str, bytes)):
    raise ValueError("prompts must be token ids (a list of lists or a [B, T] array), got a "
                     "string; encode it with the tokenizer first")
  rows = []
  for i, r in enumerate(prompts):
    if isinstance(r, (str, bytes)) or not hasattr(r, "__len__"):
      raise ValueError(f"prompt {i} must be a sequence of token ids, got {r!r:.60}")
    rows.append(_int_tokens(np.asarray(list(r))) if len(r) else np.zeros(0, np.int64))
  width = max((len(r) for r in rows), default=0)
  tokens = np.full((len(rows), max(width, 1)), pad_id, np.int64)
  mask = np.zeros(tokens.shape, bool)
  for i, r in enumerate(rows):
    tokens[i, width - len(r):] = r
    mask[i, width - len(r):] = True
  return tokens, mask


class Sampler:
  """Holds the static configs and the jitted `_generate`; params are call arguments.

  `max_traces` (tests) wraps the generator in `chex.assert_max_traces`: the bucketing
  promises at most one compilation per (bucket, batch size).
  """

  def __init__(self, model_cfg: ModelConfig, scfg: SamplingConfig,
               max_traces: Optional[int] = None):
    model_cfg = decode_model(model_cfg, scfg)  # bf16 activations and cache when asked
    self.model_cfg = model_cfg
    self.scfg = scfg
    def fn(params, cache, prompt_tokens, *, prompt_mask, row_keys, row_limits):
      return _generate(model_cfg, scfg, params, cache=cache, prompt_tokens=prompt_tokens,
                       prompt_mask=prompt_mask, row_keys=row_keys, row_limits=row_limits)

    if max_traces is not None:
      fn = chex.assert_max_traces(fn, n=max_traces)
    # The cache is the largest buffer of decoding: donate it so the while_loop updates it in
    # place instead of holding an input copy alive.
    self._fn = jax.jit(fn, donate_argnames=("cache",))

  @property
  def max_prompt_len(self) -> int:
    limit = self.model_cfg.max_seq_len - self.scfg.max_new_tokens
    if self.scfg.max_prompt_len is not None:
      limit = min(limit, self.scfg.max_prompt_len)
    return limit

  def bucket(self, length: int) -> int:
    """The smallest configured bucket that holds `length`, capped at the maximum."""
    fits = [b for b in self.scfg.buckets if b >= length]
    return min(fits[0] if fits else self.max_prompt_len, self.max_prompt_len)

  def prepare(self, prompts, prompt_mask=None):
    """Validate on the host, left-align and pad to a bucket; errors before anything compiles.

    Left-aligning here (a stable sort of each row by its mask) is what makes left- and
    right-padded inputs identical to the compiled sampler, so they sample the same tokens.
    """
    tokens, mask = _as_padded(prompts, prompt_mask, self.scfg.pad_id)
    if tokens.shape[0] == 0:
      raise ValueError("empty batch: no prompts given")
    lengths = mask.sum(axis=1)
    if (lengths == 0).any():
      raise ValueError(f"empty prompt at row(s) {np.flatnonzero(lengths == 0).tolist()}")
    if self.max_prompt_len <= 0:
      raise ValueError(f"max_new_tokens={self.scfg.max_new_tokens} leaves no room for a prompt "
                       f"in max_seq_len={self.model_cfg.max_seq_len}")
    if lengths.max() > self.max_prompt_len:
      raise ValueError(f"prompt length {int(lengths.max())} exceeds the maximum "
                       f"{self.max_prompt_len} (max_seq_len={self.model_cfg.max_seq_len} - "
                       f"max_new_tokens={self.scfg.max_new_tokens})")
    vocab = self.model_cfg.vocab_size
    bad = mask & ((tokens < 0) | (tokens >= vocab))
    if bad.any():
      raise ValueError(f"token id {int(tokens[bad][0])} outside the vocabulary [0, {vocab})")
    for t in self.scfg.stop_tokens:
      if not 0 <= t < vocab:
        raise ValueError(f"stop token {t} outside the vocabulary [0, {vocab})")
    if not 0 <= self.scfg.pad_id < vocab:
      raise ValueError(f"pad_id {self.scfg.pad_id} outside the vocabulary [0, {vocab})")
    order = np.argsort(mask, axis=1, kind="stable")
    tokens = np.where(np.take_along_axis(mask, order, 1), np.take_along_axis(tokens, order, 1),
                      self.scfg.pad_id)
    width = self.bucket(int(lengths.max()))
    if tokens.shape[1] >= width:
      tokens = tokens[:, tokens.shape[1] - width:]
    else:
      tokens = np.pad(tokens, ((0, 0), (width - tokens.shape[1], 0)),
                      constant_values=self.scfg.pad_id)
    mask = np.arange(width)[None, :] >= (width - lengths)[:, None]
    # Host arrays: the programs take them as arguments (an eager `jnp.asarray` would compile
    # a copy program per shape; the continuous sampler reads them on the host anyway).
    return tokens.astype(np.int32), mask

  def row_args(self, b: int, rng, row_keys=None, *, max_new=None):
    """Each row's cap (`max_new`: checked, clipped to max_new_tokens) and PRNG key (given,
    or fold_in(rng, row)) for a batch of b prompts."""
    n = self.scfg.max_new_tokens
    if max_new is None:
      limits = np.full((b,), n, np.int32)
    else:
      limits = np.asarray(max_new)
      if limits.shape != (b,) or not np.issubdtype(limits.dtype, np.integer):
        raise ValueError(f"max_new must be {b} ints (one per prompt), got shape "
                         f"{limits.shape} of {limits.dtype}")
      if (limits < 1).any():
        raise ValueError(f"max_new must be >= 1, got {int(limits.min())}")
      limits = np.minimum(limits, n).astype(np.int32)
    if row_keys is None:
      row_keys = jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(b))
    row_keys = np.asarray(row_keys)  # host keys, like the prompts (`prepare`)
    if row_keys.shape[0] != b:
      raise ValueError(f"{row_keys.shape[0]} row keys for a batch of {b} prompts")
    return limits, row_keys

  def __call__(self, params, prompts, rng, *, prompt_mask=None, row_keys=None,
               max_new=None) -> Rollout:
    """`rng`: one key, split per row as fold_in(rng, row); or pass `row_keys` [B, 2] to pin
    each row's random stream (partial rollouts, batch-independent sampling).
    `max_new`: per-row caps [B] on generated tokens (<= max_new_tokens; a length budget):
    a row stops there, and decoding ends once every row has stopped or reached its cap."""
    tokens, mask = self.prepare(prompts, prompt_mask)
    b, p = tokens.shape
    n = self.scfg.max_new_tokens
    limits, row_keys = self.row_args(b, rng, row_keys, max_new=max_new)
    if jax.process_count() == 1:
      cache = models.init_cache(self.model_cfg, b, p + n)
      _, rollout = self._fn(params, cache, tokens, prompt_mask=mask, row_keys=row_keys,
                            row_limits=limits)
      return rollout
    # Multi-process: every process holds the same prompts; they enter as replicated global
    # arrays on the params' mesh, and the rollout comes back in full to every host.
    rep = jax.sharding.NamedSharding(distributed.mesh_of(params), jax.sharding.PartitionSpec())
    cache = _replicated_cache(self.model_cfg, b, p + n, rep=rep)()
    tokens, mask, row_keys, limits = distributed.to_global(
        (tokens, mask, row_keys, limits), rep)
    _, rollout = self._fn(params, cache, tokens, prompt_mask=mask, row_keys=row_keys,
                          row_limits=limits)
    return distributed.gather(rollout)


def sample(model_cfg: ModelConfig, params, prompts, *, rng, scfg: SamplingConfig,
           prompt_mask=None) -> Rollout:
  """Functional entry point; reuses one compiled Sampler per (model, sampling) config.

  Errors (ValueError, before anything compiles): a bad `scfg` field (SamplingConfig), and
  prompts that are empty, not integer token ids, outside the vocabulary or too long for
  max_seq_len - max_new_tokens; a pad_id or stop token outside the vocabulary."""
  return _sampler(model_cfg, scfg)(params, prompts, rng, prompt_mask=prompt_mask)


@functools.lru_cache(maxsize=64)
def _replicated_cache(model_cfg: ModelConfig, batch: int, length: int, *, rep):
  """A compiled allocator of an empty KV cache laid out `rep` (one per shape, not per call)."""
  return jax.jit(lambda: models.init_cache(model_cfg, batch, length), out_shardings=rep)


@functools.lru_cache(maxsize=32)
def _sampler(model_cfg: ModelConfig, scfg: SamplingConfig) -> Sampler:
  return Sampler(model_cfg, scfg)
