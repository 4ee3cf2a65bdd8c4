"""FIFO with static requests (YARN-style): jobs start in arrival order at their requested GPUs and
batch and run to completion; the head of the queue blocks everything behind it (no backfill)."""

from __future__ import annotations

from dataclasses import dataclass

from .simulator import Allocation, View

__all__ = ["Fifo"]


@dataclass
class Fifo:
    name: str = "fifo"
    interval_s: float | None = None

    def schedule(self, view: View) -> dict[int, Allocation]:
        out = {st.job.job_id: st.alloc for st in view.jobs if st.alloc is not None}
        free = view.total_gpus - sum(a.gpus for a in out.values())
        for st in sorted(view.jobs, key=lambda s: (s.job.arrival_s, s.job.job_id)):
            if st.alloc is not None:
                continue
            if st.job.requested_gpus > free:
                break  # head-of-line blocking
            out[st.job.job_id] = Allocation(st.job.requested_gpus, st.job.base_batch)
            free -= st.job.requested_gpus
        return out
