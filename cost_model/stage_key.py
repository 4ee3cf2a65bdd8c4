"""The weights a pipeline stage's graph carries to its ILP (``cost_model.stage_weights``), apart
so that ``cost_model.problem`` reads them without importing what the weighing needs."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STAGE_KEY", "StageWeights"]

STAGE_KEY = "autopar_pipeline_stage"  # GraphModule.meta key of a stage graph's StageWeights


@dataclass(frozen=True)
class StageWeights:
    """A pipeline stage's ILP weights (``cost_model.stage_weights``)."""

    n_microbatches: int  # per step: the per-step terms weigh 1 / n_microbatches
    in_flight: float  # micro-batches whose activations the stage holds at its peak

    def __post_init__(self) -> None:
        if self.n_microbatches < 1 or self.in_flight < 1:
            raise ValueError(f"a pipeline stage runs >= 1 micro-batch and holds >= 1 in flight, got {self}")
