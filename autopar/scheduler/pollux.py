"""Pollux-style goodput scheduling (Qiao et al., OSDI'21), simplified.

Pollux co-adapts each job's GPUs and batch: for a GPU count ``n`` a job runs the batch that
maximizes its *goodput* (throughput times statistical efficiency, ``efficiency.py``), and the
cluster maximizes the generalized mean of the jobs' speedups with ``p = -1`` (speedup: goodput at
the allocation over goodput at the job's requested size), which favours giving every job
something over making a few jobs fast. Pollux searches allocations with a genetic algorithm;
here a greedy search optimizes the same objective: every job first gets the smallest GPU count
it fits on (arrival order, while GPUs last), then the job whose doubling raises
``-sum(1 / speedup)`` the most per GPU added is doubled, until no doubling fits or helps.
Batches are the job's per-GPU batch times a power of two, from its base batch to its cap.
Unlike ONES there is no limit on how far a job moves in one round.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .jobs import Job
from .simulator import Allocation, View

__all__ = ["Pollux"]


@dataclass
class Pollux:
    name: str = "pollux"
    interval_s: float | None = 300.0

    def best_batch(self, job: Job, n: int, view: View) -> tuple[int, float]:
        """The goodput-maximizing batch at ``n`` GPUs and its goodput (0 where nothing fits)."""
        best, best_g = 0, 0.0
        b = job.base_batch
        while b <= job.max_batch:
            if b >= n:
                g = view.model.goodput(job, n, b)
                if g > best_g:
                    best, best_g = b, g
            b *= 2
        return best, best_g

    def schedule(self, view: View) -> dict[int, Allocation]:
        free = view.total_gpus
        gpus: dict[int, int] = {}
        ref = {st.job.job_id: view.model.goodput(st.job, st.job.requested_gpus, st.job.base_batch)
               for st in view.jobs}
        for st in sorted(view.jobs, key=lambda s: (s.job.arrival_s, s.job.job_id)):
            n = 1
            while n <= min(free, st.job.max_gpus) and self.best_batch(st.job, n, view)[1] <= 0:
                n *= 2
            if n <= min(free, st.job.max_gpus):
                gpus[st.job.job_id] = n
                free -= n
        jobs = {st.job.job_id: st.job for st in view.jobs}

        def inv_speedup(jid: int, n: int) -> float:
            g = self.best_batch(jobs[jid], n, view)[1]
            return ref[jid] / g if g > 0 else float("inf")

        heap: list[tuple[float, int, int]] = []

        def push(jid: int) -> None:
            n = gpus[jid]
            if 2 * n <= jobs[jid].max_gpus:
                gain = (inv_speedup(jid, n) - inv_speedup(jid, 2 * n)) / n
                if gain > 1e-12:
                    heapq.heappush(heap, (-gain, jid, n))

        for jid in gpus:
            push(jid)
        while heap and free > 0:
            _, jid, n = heapq.heappop(heap)
            if gpus[jid] == n and n <= free:
                gpus[jid] = 2 * n
                free -= n
                push(jid)
        return {jid: Allocation(n, self.best_batch(jobs[jid], n, view)[0]) for jid, n in gpus.items()}
