"""Tiresias (Gu et al., NSDI'19): discretized two-dimensional least-attained-service.

A job's attained service is GPUs x seconds it has held GPUs. Priority queues are cut at
``thresholds_gpu_s``: a job starts in queue 0 and is demoted when its attained service crosses
the next threshold; queues are served in order, FIFO by arrival inside a queue, each job at its
requested GPUs and batch (Tiresias does not resize jobs). Jobs that do not fit are skipped so
smaller ones behind them can run (work conserving), and a running job is preempted when jobs
of higher priority take its GPUs. Durations are not used: Tiresias needs no prior knowledge.
The starvation guard of the paper (promotion after a long wait) is not implemented.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .simulator import Allocation, View

__all__ = ["Tiresias"]


@dataclass
class Tiresias:
    thresholds_gpu_s: tuple[float, ...] = (3600.0, 36000.0)
    name: str = "tiresias"
    interval_s: float | None = 60.0

    def queue(self, attained_gpu_s: float) -> int:
        return bisect.bisect_right(self.thresholds_gpu_s, attained_gpu_s)

    def schedule(self, view: View) -> dict[int, Allocation]:
        out: dict[int, Allocation] = {}
        free = view.total_gpus
        order = sorted(view.jobs, key=lambda s: (self.queue(s.attained_gpu_s), s.job.arrival_s, s.job.job_id))
        for st in order:
            if st.job.requested_gpus <= free:
                out[st.job.job_id] = Allocation(st.job.requested_gpus, st.job.base_batch)
                free -= st.job.requested_gpus
        return out
