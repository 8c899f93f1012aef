"""Decoder-only transformer: config, params, pure forward, explicit KV cache."""
from mopd_jax.models.cache import KVCache, init_cache
from mopd_jax.models.config import PRESETS, ModelConfig, get_preset
from mopd_jax.models.transformer import (decode_logits, default_positions, forward,
                                         forward_at_slots, forward_with_cache, head_weight,
                                         hidden_states, init_params, logits_from_hidden, materialize,
                                         param_logical_axes, to_out_in,
                                         with_temperature)

__all__ = [
    "KVCache", "ModelConfig", "PRESETS", "decode_logits", "default_positions", "forward",
    "forward_at_slots", "forward_with_cache", "get_preset", "head_weight", "hidden_states",
    "init_cache", "init_params",
    "logits_from_hidden", "materialize", "param_logical_axes", "to_out_in", "with_temperature",
]
