"""Statistical efficiency of a larger batch: the gradient-noise-scale model.

Training with global batch ``M`` instead of a job's base batch ``M0`` takes fewer steps but
more samples to reach the same loss. McCandlish et al., "An Empirical Model of Large-Batch
Training" (arXiv 1812.06162, 2018) show that with the gradient noise scale ``B_noise`` (called
``phi`` here) the samples-vs-steps trade-off is hyperbolic, and Pollux (Qiao et al., OSDI'21,
eq. 5) turns it into the efficiency of batch ``M`` relative to ``M0``::

    E(M) = (phi + M0) / (phi + M)          E(M0) = 1, falling towards M0/M for M >> phi

so one step at batch ``M`` makes the progress of ``M * E(M)`` base-batch samples, and a job's
*goodput* is its throughput (samples/s, from the planner) times ``E(M)``. ONES predicts progress
from the loss curve instead; we chose the noise-scale model because it has one documented
parameter per job and a closed form. ``phi`` grows as training proceeds (Pollux measures it
online); here it is held at ``noise_scale_ratio * M0`` for the whole job, a conservative choice
(a larger batch only gets more efficient later in training). The learning rate follows the
linear scaling rule (Goyal et al., 2017: lr proportional to the batch) up to the job's batch cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AutoparError

__all__ = ["NoiseScaleEfficiency", "EfficiencyError"]


class EfficiencyError(AutoparError, ValueError):
    """An out-of-range efficiency parameter."""


@dataclass(frozen=True)
class NoiseScaleEfficiency:
    """``E(M) = (phi + M0) / (phi + M)`` with ``phi = noise_scale_ratio * M0``."""

    noise_scale_ratio: float = 8.0

    def __post_init__(self) -> None:
        if not self.noise_scale_ratio > 0:
            raise EfficiencyError(f"noise_scale_ratio must be > 0, got {self.noise_scale_ratio!r}; "
                                  f"e.g. 8 (the noise scale is 8x the job's base batch)")

    def efficiency(self, batch: float, base_batch: float) -> float:
        """Progress per sample at ``batch`` relative to ``base_batch`` (1.0 at the base batch)."""
        phi = self.noise_scale_ratio * base_batch
        return (phi + base_batch) / (phi + batch)

    def learning_rate(self, base_lr: float, batch: float, base_batch: float, max_batch: float) -> float:
        """Linear scaling rule, capped at the job's largest allowed batch."""
        return base_lr * min(batch, max_batch) / base_batch
