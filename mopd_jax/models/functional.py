"""The model's functional API: every entry point a pure function of `(model_config, params,
...)` over a plain nested dict of params (the Flax modules behind it: transformer.py). Fresh
params (sharded at birth when given shardings), materialised (dequantised) params, the
cache-free forward, hidden states and logits, and the forward passes against a KV cache
(prefill, decode, slot-wise decode for continuous batching).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from mopd_jax.models import quant
from mopd_jax.models.cache import KVCache
from mopd_jax.models.config import ModelConfig
from mopd_jax.models.transformer import Transformer


def _module(cfg: ModelConfig) -> Transformer:
  return Transformer(cfg)


def _boxed_init(cfg: ModelConfig, rng):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return _module(cfg).init(rng, tokens, tokens, jnp.ones((1, 1), bool),
                           jnp.zeros((1,), jnp.int32), None)["params"]


def init_params(cfg: ModelConfig, rng, out_shardings=None) -> dict:
  """Fresh params as a plain nested dict of arrays (no logical-axis boxes).

  Jitted, so that with `out_shardings` (a pytree of shardings, see `mopd_jax.runtime.sharding`) each
  device only ever materialises its own shard.
  """
  if out_shardings is None:
    return _jitted_init(cfg)(rng)
  return jax.jit(lambda r: nn.meta.unbox(_boxed_init(cfg, r)), out_shardings=out_shardings)(rng)


@functools.lru_cache(maxsize=64)
def _jitted_init(cfg: ModelConfig):
  """One compiled initialiser per config (a fresh lambda per call would recompile)."""
  return jax.jit(lambda r: nn.meta.unbox(_boxed_init(cfg, r)))


def param_logical_axes(cfg: ModelConfig) -> dict:
  """The logical axis names of every parameter: a pytree of `PartitionSpec`s."""
  boxed = jax.eval_shape(lambda: _boxed_init(cfg, jax.random.PRNGKey(0)))
  return nn.get_partition_spec(boxed)


def materialize(cfg: ModelConfig, params):
  """(config, params) as the forward pass sees them: fake-quantised once when the config
  asks for QAT. Callers that run the model many times on the same params (the sampler's
  decode loop, the chunked head) call this once and pass the result on."""
  if cfg.quant == "none":
    return cfg, params
  return cfg.replace(quant="none"), quant.fake_quantize(params, cfg.quant, cfg.quant_group)


def default_positions(input_mask):
  """RoPE position of each token = number of valid tokens before it in its row."""
  return jnp.maximum(jnp.cumsum(input_mask.astype(jnp.int32), axis=-1) - 1, 0)


def hidden_states(cfg: ModelConfig, params, tokens, *, input_mask=None, positions=None):
  """Final-norm hidden states [B, T, D] of a full sequence, no cache.

  `input_mask` [B, T] marks real tokens (pads anywhere are ignored as keys); positions
  default to the count of real tokens before each one, so a left- or right-padded row gets
  exactly the positions of its unpadded self.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  if input_mask is None:
    input_mask = jnp.ones(tokens.shape, bool)
  input_mask = input_mask.astype(bool)
  if positions is None:
    positions = default_positions(input_mask)
  cfg, params = materialize(cfg, params)
  t = tokens.shape[1]
  h, _ = _module(cfg).apply({"params": params}, tokens, positions, input_mask,
                            jnp.arange(t, dtype=jnp.int32), None)
  return h


def head_weight(cfg: ModelConfig, params):
  """The vocabulary projection as a [D, V] matrix in the compute dtype (the transposed
  embedding when tied): what `logits_from_hidden` multiplies by, for code that fuses the
  head with its loss (`logprobs.fused_token_loss`). Expects materialised params."""
  if cfg.tie_embeddings:
    return params["embed"].astype(cfg.jnp_dtype).T
  return params["lm_head"].astype(cfg.jnp_dtype)


def with_temperature(params, temperature: float):
  """Params whose logits are `params`' divided by `temperature`, for every input: the final
  RMSNorm's scale divided by it (the head is linear in the normalised hidden state and the
  scale is never quantised). Works on a stacked bank (leading teacher axis) as well."""
  if not (isinstance(temperature, (int, float)) and temperature > 0):
    raise ValueError(f"temperature must be a positive number, got {temperature!r}")
  if temperature == 1:
    return params
  scale = params["final_norm"]["scale"]
  return {**params, "final_norm": {**params["final_norm"],
                                   "scale": (scale / temperature).astype(scale.dtype)}}


def logits_from_hidden(cfg: ModelConfig, params, hidden):
  cfg, params = materialize(cfg, params)
  return _module(cfg).apply({"params": params}, hidden, method=Transformer.head)


def decode_logits(cfg: ModelConfig, params, hidden):
  """Float32 logits [B, V] of a few rows [B, D] (a decode step), equal to
  `logits_from_hidden` up to float rounding.

  With B rows this small the head is a matrix-vector product, bound by reading the weight.
  XLA:CPU runs it as `[V, D] @ [D, B]` (the tied embedding as the left operand, in its stored
  layout) about 1.6x faster than as `[B, D] @ [D, V]` (32k x 256 head, B = 8, measured in a
  decode loop). The barrier stops XLA from folding the transpose back into the slow form.
  An untied head is stored [D, V], so it keeps the plain product rather than a transposed
  copy of the weight.
  """
  cfg, params = materialize(cfg, params)
  if not cfg.tie_embeddings:
    return logits_from_hidden(cfg, params, hidden)
  e = params["embed"].astype(cfg.jnp_dtype)
  logits_vb = jax.lax.dot_general(e, hidden.astype(cfg.jnp_dtype), (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
  return jax.lax.optimization_barrier(logits_vb).T


def forward(cfg: ModelConfig, params, tokens, *, input_mask=None, positions=None):
  """Causal logits [B, T, V] (float32) of `tokens`; positions 0..T-1 by default."""
  h = hidden_states(cfg, params, tokens, input_mask=input_mask, positions=positions)
  return logits_from_hidden(cfg, params, h)


def forward_with_cache(cfg: ModelConfig, params, tokens, *, positions, input_mask,
                       cache: KVCache):
  """Run a chunk [B, T] through the model, writing its k/v at slots cache.index.. .

  Returns (hidden [B, T, D], updated cache). Pads inside the chunk (input_mask False) are
  written but marked invalid, so no later query attends to them.
  """
  cfg, params = materialize(cfg, params)
  t = tokens.shape[1]
  q_slots = cache.index + jnp.arange(t, dtype=jnp.int32)
  valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, input_mask.astype(bool),
                                              cache.index, axis=1)
  h, layers = _module(cfg).apply({"params": params}, tokens, positions, valid, q_slots,
                                 cache.layers)
  return h, cache.replace(layers=layers, valid=valid, index=cache.index + t)


def forward_at_slots(cfg: ModelConfig, params, tokens, *, positions, input_mask, cache: KVCache,
                     row_slots):
  """Like `forward_with_cache`, but row b's chunk [T] is written at its own slots
  row_slots[b] .. row_slots[b] + T - 1 (continuous batching: each decode slot holds a
  sequence of its own length). `cache.index` is not used or moved."""
  cfg, params = materialize(cfg, params)
  t = tokens.shape[1]
  q_slots = row_slots[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  valid = jax.vmap(lambda vr, m, st: jax.lax.dynamic_update_slice_in_dim(vr, m, st, axis=0))(
      cache.valid, input_mask.astype(bool), q_slots[:, 0])
  h, layers = _module(cfg).apply({"params": params}, tokens, positions, valid, q_slots,
                                 cache.layers)
  return h, cache.replace(layers=layers, valid=valid)
