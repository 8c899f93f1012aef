"""Decoder-only transformer (Llama / Qwen2 / Qwen3 family) in Flax linen.

The Flax modules. Params are a plain nested dict; every public entry point is a pure function
of `(model_config, params, ...)` (mopd_jax/models/functional.py). Each parameter is created
with logical axis names (`nn.with_logical_partitioning`) so the sharding rules of the config
can place it.

Attention always takes explicit per-token RoPE positions and a per-token validity mask, and
optionally an explicit KV cache. That one code path serves teacher forcing (positions 0..T-1,
no cache), left- or right-padded prompts (pads are masked, positions count real tokens only)
and cached decode, which is what makes "cached decode == recompute" hold by construction.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from mopd_jax.models.cache_attention import decode_attention, query_slots, write_slots
from mopd_jax.models.config import ModelConfig

_NEG_INF = -1e30  # finite, so a fully masked row gives a uniform softmax instead of NaN
# Attention against a KV cache (prefill into it, decode from it) runs in blocks of this many
# slots, only up to the block holding the last slot written: a step's cost follows the filled
# length, not the cache size (a cache sized for 8k-token responses costs 100-token answers
# little). Caches of at most one block, and the cache-free forward of training and scoring,
# use the dense path.
DECODE_BLOCK = 256


def _dense(x, w, in_dims: int = 1, *, out_in: bool = False, **dot_kw):
  """x [..., *in] @ w -> [..., *out], as one 2-D matmul; w is [*in, *out] (`in_dims` input
  dims first) or, with `out_in`, [*out, *in].

  The leading (batch, time) axes are flattened first: contracting over two axes at once in
  the backward pass (the weight gradient) makes XLA:CPU transpose both operands and take a
  slow dot path, about twice the time of the same flops as a plain [rows, in] @ [in, out].
  An `out_in` weight is the left operand, [out, in] @ [in, rows], and the barrier keeps XLA
  from folding the result's transpose back into the slow [rows, in] @ [in, out] form (see
  `ModelConfig.weight_layout`).
  """
  lead = x.shape[:x.ndim - in_dims]
  if out_in:
    out = w.shape[:w.ndim - in_dims]
    k = math.prod(w.shape[w.ndim - in_dims:])
    y = jax.lax.dot_general(w.reshape(-1, k), x.reshape(-1, k), (((1,), (1,)), ((), ())),
                            **dot_kw)
    return jax.lax.optimization_barrier(y).T.reshape(*lead, *out)
  k = math.prod(w.shape[:in_dims])
  y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1), **dot_kw)
  return y.reshape(*lead, *w.shape[in_dims:])


def _param(module: nn.Module, name: str, init, *, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _weight(module: nn.Module, name: str, init, *, n_in: int, shape, axes, dtype):
  """A projection weight of logical shape `shape` ([*in, *out], `n_in` input dims), stored
  [*out, *in] under `weight_layout="out_in"`."""
  if module.cfg.weight_layout == "out_in":
    shape, axes = (*shape[n_in:], *shape[:n_in]), (*axes[n_in:], *axes[:n_in])
  return _param(module, name, init, shape=shape, axes=axes, dtype=dtype)


# Input dims of each block projection (the rest are output dims), for `to_out_in`.
_PROJ_IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1,
                 "up_proj": 1, "down_proj": 1}


def to_out_in(cfg: ModelConfig, params):
  """(config, params) with every block projection stored [*out, *in] (`weight_layout`
  "out_in"): the same model, for a decode loop that runs it many times on a few rows."""
  if cfg.weight_layout == "out_in":
    return cfg, params
  if cfg.quant != "none":  # QAT groups run along the input dim of the stored layout
    raise ValueError("to_out_in takes materialised params (models.materialize first)")

  def conv(path, x):
    n_in = _PROJ_IN_DIMS.get(getattr(path[-1], "key", None))
    if n_in is None or not str(getattr(path[0], "key", "")).startswith("layers_"):
      return x
    return jnp.transpose(x, (*range(n_in, x.ndim), *range(n_in)))

  return cfg.replace(weight_layout="out_in"), jax.tree_util.tree_map_with_path(conv, params)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype
  axis_name: str = "norm"

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", nn.initializers.ones, shape=(x.shape[-1],),
                   axes=(self.axis_name,), dtype=self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jnp.ndarray:
  """Inverse frequencies, with Llama-3 scaling when the config asks for it."""
  hd = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  if cfg.rope_scaling is None:
    return inv
  s = dict(cfg.rope_scaling)
  kind = s.get("rope_type", s.get("type"))
  if kind == "linear":
    return inv / s["factor"]
  if kind != "llama3":
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")
  factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  old = s["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv
  smooth = (old / wavelen - lo) / (hi - lo)
  scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
  mid = (1 - smooth) * inv / factor + smooth * inv
  is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
  return jnp.where(is_mid, mid, scaled)


def apply_rope(x, positions, inv_freq):
  """Rotate-half RoPE (the Hugging Face layout). x: [B, T, H, hd], positions: [B, T]."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, kv_mask, q_slots, layer_cache):
    """x [B,T,D]; kv_mask [B,S] (valid keys); q_slots [T] slot of each query, or [B, T]
    (with a cache: each row's own slots).

    Without a cache the keys are this chunk's own tokens (S == T, slots 0..T-1). With a cache
    the chunk's k/v are written at slots q_slots and the keys are the whole cache.
    """
    cfg = self.cfg
    dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    init = nn.initializers.normal(stddev=1.0 / math.sqrt(d))
    wq = _weight(self, "q_proj", init, n_in=1, shape=(d, h, hd),
                 axes=("embed", "heads", "head_dim"), dtype=pdt)
    wk = _weight(self, "k_proj", init, n_in=1, shape=(d, kv, hd),
                 axes=("embed", "kv_heads", "head_dim"), dtype=pdt)
    wv = _weight(self, "v_proj", init, n_in=1, shape=(d, kv, hd),
                 axes=("embed", "kv_heads", "head_dim"), dtype=pdt)
    wo = _weight(self, "o_proj", nn.initializers.normal(stddev=1.0 / math.sqrt(h * hd)), n_in=2,
                 shape=(h, hd, d), axes=("heads", "head_dim", "embed"), dtype=pdt)
    oi = cfg.weight_layout == "out_in"
    b, t = x.shape[:2]
    q = _dense(x.astype(dt), wq.astype(dt), out_in=oi)
    k = _dense(x.astype(dt), wk.astype(dt), out_in=oi)
    v = _dense(x.astype(dt), wv.astype(dt), out_in=oi)
    if cfg.attention_bias:
      zeros = nn.initializers.zeros
      q = q + _param(self, "q_bias", zeros, shape=(h, hd), axes=("heads", "head_dim"),
                     dtype=pdt).astype(dt)
      k = k + _param(self, "k_bias", zeros, shape=(kv, hd), axes=("kv_heads", "head_dim"),
                     dtype=pdt).astype(dt)
      v = v + _param(self, "v_bias", zeros, shape=(kv, hd), axes=("kv_heads", "head_dim"),
                     dtype=pdt).astype(dt)
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, dt, pdt, "head_dim", name="q_norm")(q)
      k = RMSNorm(cfg.norm_eps, dt, pdt, "head_dim", name="k_norm")(k)
    inv_freq = rope_inv_freq(cfg)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)

    # Keys/values are laid out [B, KV, S, hd] (the cache layout too): with the slot axis next
    # to head_dim, both attention contractions are plain batched matmuls, which XLA runs
    # several times faster than the [B, S, KV, hd] layout at decode time.
    k = jnp.swapaxes(k, 1, 2)
    v = jnp.swapaxes(v, 1, 2)
    if layer_cache is not None:
      ck = write_slots(layer_cache["k"], k, q_slots)
      cv = write_slots(layer_cache["v"], v, q_slots)
      layer_cache = {"k": ck, "v": cv}
      k, v = ck.astype(dt), cv.astype(dt)
    num_slots = k.shape[2]

    g = h // kv
    qg = jnp.transpose(q.reshape(b, t, kv, g, hd), (0, 2, 3, 1, 4))  # [B, KV, G, T, hd]
    if layer_cache is not None and num_slots > DECODE_BLOCK:
      out = decode_attention(qg, k, v, kv_mask=kv_mask, q_slots=q_slots, block=DECODE_BLOCK)
    else:
      scores = jnp.einsum("bkgth,bksh->bkgts", qg, k).astype(jnp.float32) / math.sqrt(hd)
      causal = query_slots(q_slots)[:, :, None] >= jnp.arange(num_slots)  # [1|B, T, S]
      mask = causal & kv_mask[:, None, :]  # [B, T, S]
      scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
      probs = jax.nn.softmax(scores, axis=-1).astype(dt)
      out = jnp.einsum("bkgts,bksh->bkgth", probs, v)
    out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, hd)  # heads in (kv, g) order
    return _dense(out, wo.astype(dt), in_dims=2, out_in=oi), layer_cache


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
    init = nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.d_model))
    wg = _weight(self, "gate_proj", init, n_in=1, shape=(cfg.d_model, cfg.mlp_dim),
                 axes=("embed", "mlp"), dtype=pdt)
    wu = _weight(self, "up_proj", init, n_in=1, shape=(cfg.d_model, cfg.mlp_dim),
                 axes=("embed", "mlp"), dtype=pdt)
    wd = _weight(self, "down_proj", nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.mlp_dim)),
                 n_in=1, shape=(cfg.mlp_dim, cfg.d_model), axes=("mlp", "embed"), dtype=pdt)
    oi = cfg.weight_layout == "out_in"
    x = x.astype(dt)
    hidden = (jax.nn.silu(_dense(x, wg.astype(dt), out_in=oi)) *
              _dense(x, wu.astype(dt), out_in=oi))
    return _dense(hidden, wd.astype(dt), out_in=oi)


class Block(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, kv_mask, q_slots, layer_cache):
    cfg = self.cfg
    dt, pdt = cfg.jnp_dtype, cfg.jnp_param_dtype
    h = RMSNorm(cfg.norm_eps, dt, pdt, "embed", name="input_norm")(x)
    attn, layer_cache = Attention(cfg, name="attn")(h, positions, kv_mask, q_slots, layer_cache)
    x = x + attn
    h = RMSNorm(cfg.norm_eps, dt, pdt, "embed", name="post_attn_norm")(x)
    return x + MLP(cfg, name="mlp")(h), layer_cache


def _call_block(block: Block, x, positions, kv_mask, q_slots, layer_cache):
  return block(x, positions, kv_mask, q_slots, layer_cache)


@functools.lru_cache(maxsize=None)
def _block_caller(remat: str):
  """How a block is called under `ModelConfig.remat` (one lifted wrapper per mode).

  `nn.remat` (Flax's lifted `jax.checkpoint`) rather than `jax.checkpoint` itself, so the
  block's params stay in Flax's scope (a plain JAX transform around a module call would leak
  them as tracers). Every argument is an array or None, so nothing needs `static_argnums`.
  The params keep their names and logical axes: the wrapper is a function, not a new module.
  When each recomputation runs is XLA's choice: JAX's optimization barriers only keep it
  from being merged with the forward pass, and XLA:CPU drops them before scheduling, so
  remat's share of the CPU memory plan is unreliable (see the README's memory plans).
  """
  if remat == "none":
    return _call_block
  policy = {"block": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[remat]
  return nn.remat(_call_block, policy=policy)


class Transformer(nn.Module):
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    pdt = cfg.jnp_param_dtype
    self.embed = self.param(
        "embed", nn.with_logical_partitioning(
            # 1/sqrt(d) keeps tied-head logits O(1) at init; RMSNorm rescales the input side.
            nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.d_model)), ("vocab", "embed")),
        (cfg.vocab_size, cfg.d_model), pdt)
    if not cfg.tie_embeddings:
      self.lm_head = self.param(
          "lm_head", nn.with_logical_partitioning(
              nn.initializers.normal(stddev=1.0 / math.sqrt(cfg.d_model)), ("embed", "vocab")),
          (cfg.d_model, cfg.vocab_size), pdt)
    self.layers = [Block(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
    self.final_norm = RMSNorm(cfg.norm_eps, cfg.jnp_dtype, pdt, "embed")

  def __call__(self, tokens, positions, kv_mask, q_slots, cache_layers):
    x = jnp.take(self.embed, tokens, axis=0).astype(self.cfg.jnp_dtype)
    new_layers = []
    # Rematerialise only the cache-free forward (training, teacher scoring): a cached forward
    # is sampling, which is never differentiated, and checkpointing it would buy nothing.
    call = _block_caller(self.cfg.remat if cache_layers is None else "none")
    for i, layer in enumerate(self.layers):
      x, lc = call(layer, x, positions, kv_mask, q_slots,
                   None if cache_layers is None else cache_layers[i])
      new_layers.append(lc)
    return self.final_norm(x), (None if cache_layers is None else tuple(new_layers))

  def head(self, hidden):
    """Float32 logits from final hidden states [..., D] -> [..., V]."""
    h = hidden.astype(self.cfg.jnp_dtype)
    if self.cfg.tie_embeddings:
      w = self.embed.astype(self.cfg.jnp_dtype).T
    else:
      w = self.lm_head.astype(self.cfg.jnp_dtype)
    return _dense(h, w, preferred_element_type=jnp.float32)
