"""mopd_jax: multi-teacher on-policy distillation (Kimi K3 MOPD) in JAX/Flax."""
__version__ = "0.1.0"
