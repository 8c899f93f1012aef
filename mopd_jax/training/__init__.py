"""The updates: the losses (`losses`: distillation and SFT; `rl_losses`) and their registry
(`registry`), the optimizer and train state (`optim`), the jitted train step (`step`) and
length groups (`length_groups`), and the algorithms that use them: cold-start SFT (`sft`),
domain RL with an annealed length budget (`rl`) and multi-teacher on-policy distillation
(`mopd`, `vocab_kl`, `diagnostics`).
"""
