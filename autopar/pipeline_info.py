"""The pipeline part of a Plan: stages (layers, sub-mesh, predicted time and memory), schedule,
bubble, the bytes each model chunk sends, and the weights tied across stages (kept in sync by
one all-reduce of their gradient per step between the stages that hold them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .errors import AutoparError

__all__ = ["PipelineStageInfo", "PipelineInfo", "TiedSync", "ChunkComm", "microbatch_inputs"]


def microbatch_inputs(inputs: Sequence[Any], m: int) -> tuple[Any, ...]:
    """The first of ``m`` equal micro-batches of ``inputs`` (cut along dim 0)."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % m:
                raise AutoparError(f"an input of shape {tuple(x.shape)} cannot be cut into {m} equal micro-batches "
                                   f"along dim 0; pick n_microbatches dividing the batch size")
            x = x[: x.shape[0] // m]
        out.append(x)
    return tuple(out)


@dataclass(frozen=True)
class TiedSync:
    """A weight used by several stages (an embedding tied to the head): each holding stage keeps
    a copy; once per step its gradient is all-reduced between the pp positions holding it."""

    target: str  # the weight's name in the traced graph, e.g. "wte.weight"
    stages: tuple[int, ...]  # model chunks that use it
    positions: tuple[int, ...]  # their positions on the pp axis (the all-reduce's ranks)
    nbytes: float  # the gradient each rank holds (its shard under the stage plans' layout)
    bytes_per_rank: float  # sent per step by each holding rank (ring all-reduce)
    seconds: float  # priced on the pp link

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "stages": list(self.stages), "positions": list(self.positions),
                "nbytes": self.nbytes, "bytes_per_rank": self.bytes_per_rank, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TiedSync":
        return cls(d["target"], tuple(int(x) for x in d["stages"]), tuple(int(x) for x in d["positions"]),
                   float(d["nbytes"]), float(d["bytes_per_rank"]), float(d["seconds"]))


@dataclass(frozen=True)
class ChunkComm:
    """What one model chunk (stage) sends, per rank, from its stage plan and its boundary."""

    per_microbatch: dict[str, float] = field(default_factory=dict)  # its collectives, one micro-batch
    per_step: dict[str, float] = field(default_factory=dict)  # parameter gradient syncs run once per step
    send_bytes: float = 0.0  # activations handed to the next stage, one micro-batch
    send_grad_bytes: float = 0.0  # gradients of its inputs sent back, one micro-batch
    comm_seconds: float = 0.0  # its collectives for one micro-batch (the stage plan's)
    step_comm_seconds: float = 0.0  # of comm_seconds: the gradient syncs, which run once per step
    exposed_seconds: float = 0.0  # of the rest: not hidden behind compute, one micro-batch

    def seconds_per_step(self, n_microbatches: int) -> float:
        """Its collectives over a step of ``n_microbatches``: the gradient syncs once, the rest
        once per micro-batch (the stage plan prices one micro-batch with its syncs)."""
        return n_microbatches * (self.comm_seconds - self.step_comm_seconds) + self.step_comm_seconds

    def exposed_per_step(self, n_microbatches: int) -> float:
        """Of ``seconds_per_step``: what is not hidden behind compute (the syncs, which run after
        the schedule, all of it)."""
        return n_microbatches * self.exposed_seconds + self.step_comm_seconds

    def to_dict(self) -> dict[str, Any]:
        return {"per_microbatch": dict(self.per_microbatch), "per_step": dict(self.per_step),
                "send_bytes": self.send_bytes, "send_grad_bytes": self.send_grad_bytes,
                "comm_seconds": self.comm_seconds, "step_comm_seconds": self.step_comm_seconds,
                "exposed_seconds": self.exposed_seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChunkComm":
        return cls({k: float(v) for k, v in d["per_microbatch"].items()},
                   {k: float(v) for k, v in d["per_step"].items()}, float(d["send_bytes"]),
                   float(d["send_grad_bytes"]), float(d.get("comm_seconds", 0.0)),
                   float(d.get("step_comm_seconds", 0.0)), float(d.get("exposed_seconds", 0.0)))


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
    tied: tuple[TiedSync, ...] = ()  # weights tied across stages, synced once per step
    chunks: tuple[ChunkComm, ...] = ()  # per model chunk, in model order (from the stage plans)

    def predicted_bytes(self, position: int) -> dict[str, float]:
        """Bytes one rank at ``position`` on the pp axis sends per step, per kind (its chunks'
        collectives once per micro-batch, their parameter syncs once per step, the sends between
        stages, the tied-weight all-reduces, and the loss broadcast along the pipeline)."""
        m, p = self.n_microbatches, self.n_stages
        out: dict[str, float] = {}

        def add(kind: str, b: float) -> None:
            if b:
                out[kind] = out.get(kind, 0.0) + b

        for s in range(position, p * self.virtual_stages, p):
            c = self.chunks[s]
            for k, b in c.per_microbatch.items():
                add(k, m * b)
            for k, b in c.per_step.items():
                add(k, b)
            add("p2p", m * (c.send_bytes + c.send_grad_bytes))
        for t in self.tied:
            if position in t.positions:
                add("all_reduce", t.bytes_per_rank)
        add("broadcast", 4.0 if p > 1 else 0.0)  # the fp32 loss, from the last stage's rank
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"n_stages": self.n_stages, "schedule": self.schedule, "n_microbatches": self.n_microbatches,
                "virtual_stages": self.virtual_stages, "stage_mesh": self.stage_mesh,
                "block_prefix": self.block_prefix, "stage_blocks": list(self.stage_blocks),
                "bubble_fraction": self.bubble_fraction, "bubble_seconds": self.bubble_seconds,
                "p2p_bytes_per_step": self.p2p_bytes_per_step,
                "stages": [{"index": s.index, "first_block": s.first_block, "n_blocks": s.n_blocks,
                            "extras": s.extras, "seconds_per_microbatch": s.seconds_per_microbatch,
                            "peak_memory_bytes": s.peak_memory_bytes} for s in self.stages],
                "recompute": self.recompute, "tied": [x.to_dict() for x in self.tied],
                "chunks": [c.to_dict() for c in self.chunks]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PipelineInfo":
        return cls(int(d["n_stages"]), d["schedule"], int(d["n_microbatches"]), int(d["virtual_stages"]),
                   d["stage_mesh"], d["block_prefix"], tuple(int(x) for x in d["stage_blocks"]),
                   float(d["bubble_fraction"]), float(d["bubble_seconds"]), float(d["p2p_bytes_per_step"]),
                   tuple(PipelineStageInfo(int(s["index"]), int(s["first_block"]), int(s["n_blocks"]), s["extras"],
                                           float(s["seconds_per_microbatch"]), float(s["peak_memory_bytes"]))
                         for s in d["stages"]), bool(d.get("recompute", False)),
                   tuple(TiedSync.from_dict(x) for x in d.get("tied", ())),
                   tuple(ChunkComm.from_dict(c) for c in d.get("chunks", ())))
