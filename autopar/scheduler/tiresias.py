"""Tiresias (Gu et al., NSDI'19): discretized two-dimensional least-attained-service.

A job's attained service is GPUs x seconds it has held GPUs. Priority queues are cut at
``thresholds_gpu_s``: a job starts in queue 0 and is demoted when its attained service crosses
the next threshold; queues are served in order, FIFO by arrival inside a queue, each job at its
requested GPUs and batch (Tiresias does not resize jobs). Jobs that do not fit are skipped so
smaller ones behind them can run (work conserving), and a running job is preempted when jobs
of higher priority take its GPUs. Durations are not used: Tiresias needs no prior knowledge.

Starvation guard (as in the paper): a job that has waited longer than ``starve_limit_s`` since
it last ran (or since it arrived) is promoted to the highest-priority queue, and its attained
service counts from zero again from then on, so it keeps the GPUs until it has earned a
demotion anew instead of being demoted at the next round. ``starve_limit_s=None`` turns it off.
The promotion points are the only state the policy keeps (per instance, per job).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .simulator import Allocation, JobState, View

__all__ = ["Tiresias"]


@dataclass
class Tiresias:
    thresholds_gpu_s: tuple[float, ...] = (3600.0, 36000.0)
    starve_limit_s: float | None = 4 * 3600.0
    name: str = "tiresias"
    interval_s: float | None = 60.0
    promotions: dict[int, float] = field(default_factory=dict)  # job id -> attained service when promoted

    def queue(self, attained_gpu_s: float) -> int:
        return bisect.bisect_right(self.thresholds_gpu_s, attained_gpu_s)

    def waited_s(self, st: JobState, now: float) -> float:
        """Seconds since the job last held GPUs (since its arrival if it never has)."""
        if st.alloc is not None:
            return 0.0
        return now - max(st.last_scheduled_s, st.job.arrival_s)

    def _priority(self, st: JobState, now: float) -> int:
        jid = st.job.job_id
        if self.starve_limit_s is not None and self.waited_s(st, now) > self.starve_limit_s:
            self.promotions[jid] = st.attained_gpu_s
        return self.queue(st.attained_gpu_s - self.promotions.get(jid, 0.0))

    def schedule(self, view: View) -> dict[int, Allocation]:
        out: dict[int, Allocation] = {}
        free = view.total_gpus
        order = sorted(view.jobs, key=lambda s: (self._priority(s, view.now), s.job.arrival_s, s.job.job_id))
        for st in order:
            if st.job.requested_gpus <= free:
                out[st.job.job_id] = Allocation(st.job.requested_gpus, st.job.base_batch)
                free -= st.job.requested_gpus
        return out
