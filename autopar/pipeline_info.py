"""The pipeline part of a Plan: stages (layers, sub-mesh, predicted time and memory), schedule, bubble."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PipelineStageInfo", "PipelineInfo"]


@dataclass(frozen=True)
class PipelineStageInfo:
    index: int
    first_block: int  # blocks [first_block, first_block + n_blocks) of the repeated container
    n_blocks: int
    extras: str  # "embeddings", "head", "embeddings+head" or "" (non-block ops the stage also runs)
    seconds_per_microbatch: float  # forward + backward + its collectives and sends, one micro-batch
    peak_memory_bytes: float  # parameter state + activations in flight, per device

    def __str__(self) -> str:
        last = self.first_block + self.n_blocks - 1
        extra = f" + {self.extras}" if self.extras else ""
        return f"stage {self.index}: blocks {self.first_block}-{last}{extra}"


@dataclass(frozen=True)
class PipelineInfo:
    n_stages: int
    schedule: str  # gpipe | 1f1b | interleaved-1f1b
    n_microbatches: int
    virtual_stages: int  # model chunks per device (interleaved), else 1
    stage_mesh: str  # the mesh inside each stage, e.g. "dp=16,tp=8"
    block_prefix: str  # the repeated container the stages are cut in, e.g. "blocks"
    stage_blocks: tuple[int, ...]  # blocks per stage (model chunk), in model order
    bubble_fraction: float
    bubble_seconds: float
    p2p_bytes_per_step: float  # sent by one device on the busiest stage boundary
    stages: tuple[PipelineStageInfo, ...]  # per device position on the pp axis
    recompute: bool = False  # every block's activations recomputed (its input kept only)

    def to_dict(self) -> dict[str, Any]:
        return {"n_stages": self.n_stages, "schedule": self.schedule, "n_microbatches": self.n_microbatches,
                "virtual_stages": self.virtual_stages, "stage_mesh": self.stage_mesh,
                "block_prefix": self.block_prefix, "stage_blocks": list(self.stage_blocks),
                "bubble_fraction": self.bubble_fraction, "bubble_seconds": self.bubble_seconds,
                "p2p_bytes_per_step": self.p2p_bytes_per_step,
                "stages": [{"index": s.index, "first_block": s.first_block, "n_blocks": s.n_blocks,
                            "extras": s.extras, "seconds_per_microbatch": s.seconds_per_microbatch,
                            "peak_memory_bytes": s.peak_memory_bytes} for s in self.stages],
                "recompute": self.recompute}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelineInfo":
        return cls(int(d["n_stages"]), d["schedule"], int(d["n_microbatches"]), int(d["virtual_stages"]),
                   d["stage_mesh"], d["block_prefix"], tuple(int(x) for x in d["stage_blocks"]),
                   float(d["bubble_fraction"]), float(d["bubble_seconds"]), float(d["p2p_bytes_per_step"]),
                   tuple(PipelineStageInfo(int(s["index"]), int(s["first_block"]), int(s["n_blocks"]), s["extras"],
                                           float(s["seconds_per_microbatch"]), float(s["peak_memory_bytes"]))
                         for s in d["stages"]), bool(d.get("recompute", False)))
