"""Model configuration: one frozen dataclass, presets for the toy model and real shapes.

The dataclass is hashable so it can be a static argument of jitted functions; changing any
field is a different model and therefore a different compilation.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# ModelConfig.remat values. none: the backward pass keeps every intermediate of every block
# (fastest, most memory). block: `jax.checkpoint` around each block saving nothing, so only
# the L block inputs [B, T, D] stay live and one block's intermediates are recomputed at a
# time (about one extra forward pass of compute). dots: like block, but the outputs of the
# weight matmuls (q/k/v/o, gate/up/down projections: matmuls without batch dimensions) are
# saved, so only the cheap elementwise ops and the attention itself are recomputed.
REMAT_MODES = ("none", "block", "dots")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer of the Llama / Qwen2 / Qwen3 family."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int  # grouped-query attention: num_heads % num_kv_heads == 0
  head_dim: int
  mlp_dim: int  # SwiGLU hidden width
  rope_theta: float = 10_000.0
  # Llama-3 style frequency scaling, as a hashable tuple of (key, value) pairs, or None.
  rope_scaling: Optional[tuple] = None
  qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
  attention_bias: bool = False  # Qwen2 has biases on the q/k/v projections
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  max_seq_len: int = 2048  # longest prompt + generation the sampler accepts
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype; logits and losses are always float32
  family: str = "qwen3"  # llama | qwen2 | qwen3: used by the Hugging Face import/export
  # Quantisation-aware forward (see models/quant.py): none | int8 | int4 (group-wise).
  quant: str = "none"
  quant_group: int = 32
  # Activation rematerialisation of the training forward (see REMAT_MODES): what the backward
  # pass keeps of each transformer block. Exact (same loss and gradient), it trades recompute
  # for memory; a forward with a KV cache (sampling) never differentiates and skips it.
  remat: str = "none"
  # Storage of the blocks' projection weights: "in_out" (the checkpoint layout: [in, out]) |
  # "out_in" (output dims first, what the sampler decodes with: a step has a few rows, and
  # XLA:CPU multiplies [out, in] @ [in, rows] about 1.7x faster than [rows, in] @ [in, out]).
  # `models.to_out_in` converts params; nothing is trained or saved in "out_in".
  weight_layout: str = "in_out"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_dim", "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.remat not in REMAT_MODES:
      raise ValueError(f"ModelConfig.remat={self.remat!r}; expected one of {REMAT_MODES}")
    if self.weight_layout not in ("in_out", "out_in"):
      raise ValueError(f"ModelConfig.weight_layout={self.weight_layout!r}; expected in_out or "
                       "out_in")
    if self.quant not in ("none", "int8", "int4"):
      raise ValueError(f"ModelConfig.quant={self.quant!r}; expected none, int8 or int4")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; expected one of "
                         f"{sorted(_DTYPES)}")

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self, include_embedding: bool = True) -> int:
    """Parameter count; `include_embedding=False` gives the N of the 2N / 6N flop rules.

    The input embedding is a lookup (no flops) but the output head is a matmul, so for the
    flop count the head is counted even when it is tied to the embedding.
    """
    d, h, kv, hd, f = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d
    if self.attention_bias:
      attn += h * hd + 2 * kv * hd
    norms = 2 * d + (2 * hd if self.qk_norm else 0)
    layer = attn + 3 * d * f + norms
    head = self.vocab_size * d
    body = self.num_layers * layer + d
    if include_embedding:
      return body + head + (0 if self.tie_embeddings else head)
    return body + head


def _preset(**kw) -> ModelConfig:
  return ModelConfig(**kw)


PRESETS = {
    # ~1M parameters: learns the toy tasks in minutes on 2 CPU cores.
    "toy": dict(vocab_size=102,  # = CharTokenizer().vocab_size
                d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                head_dim=32, mlp_dim=384, rope_theta=10_000.0, qk_norm=True,
                tie_embeddings=True, max_seq_len=512, family="qwen3"),
    # The benchmark shape: d_model 256, 4 layers, vocab 32k.
    "bench": dict(vocab_size=32_000, d_model=256, num_layers=4, num_heads=4, num_kv_heads=4,
                  head_dim=64, mlp_dim=1024, tie_embeddings=True, max_seq_len=1024,
                  family="llama"),
    # Real shapes (from the public config.json of each model).
    "qwen3-0.6b": dict(vocab_size=151_936, d_model=1024, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0,
                       qk_norm=True, tie_embeddings=True, max_seq_len=40_960, family="qwen3",
                       param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-1.7b": dict(vocab_size=151_936, d_model=2048, num_layers=28, num_heads=16,
                       num_kv_heads=8, head_dim=128, mlp_dim=6144, rope_theta=1_000_000.0,
                       qk_norm=True, tie_embeddings=True, max_seq_len=40_960, family="qwen3",
                       param_dtype="bfloat16", dtype="bfloat16"),
    "qwen3-8b": dict(vocab_size=151_936, d_model=4096, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, mlp_dim=12_288, rope_theta=1_000_000.0,
                     qk_norm=True, tie_embeddings=False, max_seq_len=40_960, family="qwen3",
                     param_dtype="bfloat16", dtype="bfloat16"),
    "llama-3.2-1b": dict(vocab_size=128_256, d_model=2048, num_layers=16, num_heads=32,
                         num_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500_000.0,
                         rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0),
                                       ("low_freq_factor", 1.0),
                                       ("original_max_position_embeddings", 8192),
                                       ("rope_type", "llama3")),
                         norm_eps=1e-5, tie_embeddings=True, max_seq_len=131_072,
                         family="llama", param_dtype="bfloat16", dtype="bfloat16"),
}


def get_preset(name: str, **overrides) -> ModelConfig:
  """A preset by name, with field overrides (e.g. `vocab_size=` for a custom tokenizer)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return _preset(**{**PRESETS[name], **overrides})
