"""A loss from outside the package: `scaled_mopd`, K3 eq. 15's loss times a constant, with its
own hyperparameter block.

    --config.plugins=plugin_examples.scaled_loss --config.mopd.loss=scaled_mopd

Its arguments are a frozen dataclass (`ScaledArgs`) that the registry builds from the run
config's `mopd.loss_args.scaled_mopd` block (absent fields keep their defaults) and the train
step hands to the loss as `loss_cfg.args`."""
from __future__ import annotations

import dataclasses

from mopd_jax.training import losses, registry


@dataclasses.dataclass(frozen=True)
class ScaledArgs:
  scale: float = 1.0  # the factor on eq. 15's loss (and so on its gradient)

  def __post_init__(self):
    if isinstance(self.scale, bool) or not float(self.scale) > 0:
      raise ValueError(f"scale must be a number > 0, got {self.scale!r}")


@registry.register_loss("scaled_mopd", separable=True, args=ScaledArgs)
def scaled_mopd(loss_cfg, st, batch):
  """`loss_cfg.args.scale` x eq. 15's loss; its metrics unscaled (curves comparable)."""
  loss, metrics = losses.mopd_loss(st.logprobs, batch.teacher_logprobs, batch.loss_mask,
                                   r_max=loss_cfg.r_max)
  return loss_cfg.args.scale * loss, metrics
