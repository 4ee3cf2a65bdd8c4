"""A training job as the scheduler sees it, and its speed and migration cost on the cluster.

A :class:`Job` is a zoo model with an amount of work (samples at its base batch), a requested
GPU count and global batch, and an elastic range. :class:`JobModel` answers the scheduler's
questions about it from the planner's throughput table and the statistical-efficiency model:
goodput at ``n`` GPUs and batch ``b`` (base-batch samples per second), and what a resize or a
move costs (checkpoint the state over the host link, restart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import AutoparError
from .efficiency import NoiseScaleEfficiency
from .throughput import ThroughputTable

__all__ = ["Job", "JobModel", "JobError", "pow2_floor"]


class JobError(AutoparError, ValueError):
    """A job description that cannot run (no GPUs requested, batch smaller than its GPUs...)."""


def pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


@dataclass(frozen=True)
class Job:
    """One job. ``work`` counts samples at ``base_batch``; ``max_gpus``/``max_batch`` bound elasticity."""

    job_id: int
    model: str
    arrival_s: float
    work: float
    requested_gpus: int
    base_batch: int
    max_gpus: int
    max_batch: int
    trace_duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.requested_gpus < 1 or self.requested_gpus & (self.requested_gpus - 1):
            raise JobError(f"job {self.job_id}: requested_gpus must be a power of two >= 1, got "
                           f"{self.requested_gpus}; round it with pow2_floor")
        if self.base_batch < self.requested_gpus:
            raise JobError(f"job {self.job_id}: base batch {self.base_batch} < requested GPUs "
                           f"{self.requested_gpus}; every GPU needs at least one sample")
        if not self.work > 0 or self.max_gpus < 1 or self.max_batch < self.base_batch:
            raise JobError(f"job {self.job_id}: needs work > 0, max_gpus >= 1 and max_batch >= base batch, got "
                           f"work={self.work}, max_gpus={self.max_gpus}, max_batch={self.max_batch}")

    @property
    def per_gpu_batch(self) -> int:
        return self.base_batch // self.requested_gpus

    def elastic_batch(self, gpus: int) -> int:
        """ONES's batch for ``gpus``: the per-GPU batch times the GPUs, up to the job's cap."""
        return min(self.per_gpu_batch * gpus, self.max_batch)


@dataclass
class JobModel:
    """Goodput and migration cost of jobs on the table's hardware (memoized per configuration).

    Start-up and hand-over costs (seconds; the real run measures them, ``bench/schedule_real.py``):
    ``restart_overhead_s`` from launching a job to its first step, plus ``launch_s_per_process``
    for every process of ours alive once the round's launches are done -- each allocated rank and
    each job's launcher (on CPU "GPU slots" a launch's start-up -- import torch, trace, plan --
    shares the cores with every rank that starts or trains meanwhile; 0 on a GPU cluster);
    ``stop_s`` from telling a running job to stop to its processes being gone (the next step
    boundary, the checkpoint save, the exit): jobs launched in a round that stops a job wait for
    it, as the controller does (a job still starting up has nothing to save: it stops at once);
    ``exit_s`` from a job's last step to its processes being gone (it counts in the JCT and the
    GPUs are free only then).

    ``shared_cores``: the CPU cores the slots of one node share (the hardware profile's
    ``Hardware.shared_cores``, which ``autopar calibrate`` measures; 0, the default: every GPU
    computes on its own, nothing is shared). The table's step times are each job's alone; with
    ``busy`` ranks of ours training on the node at once each rank runs at ``min(1, cores /
    busy)`` of a core instead of ``min(1, cores / gpus)`` alone, so its steps take
    :meth:`contention` times longer.
    """

    table: ThroughputTable
    efficiency: NoiseScaleEfficiency = field(default_factory=NoiseScaleEfficiency)
    restart_overhead_s: float = 20.0
    launch_s_per_process: float = 0.0
    stop_s: float = 0.0
    exit_s: float = 0.0
    shared_cores: float = 0.0
    _memo: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("restart_overhead_s", "launch_s_per_process", "stop_s", "exit_s", "shared_cores"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise JobError(f"JobModel.{name} must be a finite number >= 0, got {value!r}; "
                               f"measure it with bench/schedule_real.py or leave the default")

    def contention(self, gpus: int, busy: int) -> float:
        """How many times longer a step of a job on ``gpus`` slots takes than alone while
        ``busy`` ranks (its own included) train on a node whose slots share
        ``shared_cores`` cores; exactly 1 where nothing is shared."""
        if self.shared_cores <= 0:
            return 1.0
        return max(1.0, busy / self.shared_cores) / max(1.0, gpus / self.shared_cores)

    def launch_seconds(self, processes: int = 0) -> float:
        """Launch to first step with ``processes`` of ours alive (ranks of all jobs, launchers)."""
        return self.restart_overhead_s + self.launch_s_per_process * processes

    def spans(self, gpus: int) -> bool:
        return gpus > self.table.devices_per_node

    def goodput(self, job: Job, gpus: int, batch: int, spans_nodes: bool | None = None) -> float:
        """Base-batch samples per second; 0 where the configuration does not fit."""
        if gpus <= 0:
            return 0.0
        spans = self.spans(gpus) if spans_nodes is None else spans_nodes
        key = (job.model, job.base_batch, gpus, batch, spans)
        g = self._memo.get(key)
        if g is None:
            thr = self.table.model(job.model).samples_per_second(gpus, batch, spans)
            g = self._memo[key] = thr * self.efficiency.efficiency(batch, job.base_batch)
        return g

    def remaining_seconds(self, job: Job, remaining_work: float, gpus: int, batch: int) -> float:
        g = self.goodput(job, gpus, batch)
        return remaining_work / g if g > 0 else math.inf

    def migration_seconds(self, job: Job, gpus: int, processes: int = 0) -> float:
        """Save the sharded state, restart at the new size, load it: each rank moves its
        1/gpus share of the checkpoint over its host link twice, plus the launch."""
        state = self.table.model(job.model).checkpoint_bytes
        return self.launch_seconds(processes) + 2 * state / max(gpus, 1) / self.table.host_link_bytes_per_s
