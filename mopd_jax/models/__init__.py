"""The decoder-only transformer (Llama / Qwen2 / Qwen3 family): its config and presets
(`config`), the Flax modules (`transformer`) behind a functional API of pure functions over
plain params (`functional`, re-exported here), the explicit KV cache (`cache`,
`cache_attention`), quantisation-aware weights (`quant`) and chunked log-probs and KLs that
never hold [B, T, V] logits (`logprobs`)."""
from mopd_jax.models.cache import init_cache, KVCache
from mopd_jax.models.config import get_preset, ModelConfig, PRESETS
from mopd_jax.models.functional import (decode_logits, default_positions, forward,
                                        forward_at_slots, forward_with_cache, head_weight,
                                        hidden_states, init_params, logits_from_hidden,
                                        materialize, param_logical_axes, with_temperature)
from mopd_jax.models.transformer import to_out_in

__all__ = [
    "KVCache", "ModelConfig", "PRESETS", "decode_logits", "default_positions", "forward",
    "forward_at_slots", "forward_with_cache", "get_preset", "head_weight", "hidden_states",
    "init_cache", "init_params",
    "logits_from_hidden", "materialize", "param_logical_axes", "to_out_in", "with_temperature",
]
