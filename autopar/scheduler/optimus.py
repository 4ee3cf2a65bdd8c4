"""Optimus (Peng et al., EuroSys'18): a fitted speed model per job, resources by marginal gain.

Optimus fits each job's training speed as a function of its workers and gives the next
resource to the job whose remaining time drops the most per resource added. Here the speed
model is fitted, per (model, batch), to the planner's predicted step times at the GPU counts the
job may use: ``t(n) = a/n + c + d*n`` (compute split over ``n``, a constant, and communication
growing with ``n``) by least squares, with negative coefficients clipped. The global batch stays
the job's requested one (Optimus does not change it); GPU counts are powers of two, so "the next
resource" is doubling a job and its gain is counted per GPU added. Every job first gets the
smallest GPU count its batch fits on, shortest remaining time first, while GPUs last. Remaining
work is the simulator's exact figure (Optimus estimates it from the loss curve).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from .jobs import Job
from .simulator import Allocation, View

__all__ = ["Optimus", "fit_speed_model"]


def fit_speed_model(ns: list[int], step_s: list[float]) -> tuple[float, float, float]:
    """Least-squares ``(a, c, d)`` of ``t(n) = a/n + c + d*n``; coefficients clipped at 0."""
    n = np.asarray(ns, dtype=float)
    t = np.asarray(step_s, dtype=float)
    cols = [1 / n, np.ones_like(n), n]
    keep = [0, 1, 2][: max(1, min(3, len(ns)))]
    while True:
        A = np.stack([cols[k] for k in keep], axis=1)
        coef, *_ = np.linalg.lstsq(A, t, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep = [k for k, c in zip(keep, coef) if c >= 0] or [1]
    out = [0.0, 0.0, 0.0]
    for k, c in zip(keep, coef):
        out[k] = max(float(c), 0.0)
    return out[0], out[1], out[2]


@dataclass
class Optimus:
    name: str = "optimus"
    interval_s: float | None = 300.0
    _fits: dict = field(default_factory=dict, repr=False)

    def _sizes(self, job: Job, view: View) -> tuple[list[int], tuple[float, float, float]]:
        key = (job.model, job.base_batch, job.max_gpus, view.total_gpus)
        if key not in self._fits:
            profile = view.model.table.model(job.model)
            cap = min(job.max_gpus, view.total_gpus, job.base_batch)
            ns = [1 << k for k in range(cap.bit_length()) if (1 << k) <= cap]
            ns = [n for n in ns if math.isfinite(profile.step_seconds(n, job.base_batch, view.model.spans(n)))]
            steps = [profile.step_seconds(n, job.base_batch, view.model.spans(n)) for n in ns]
            self._fits[key] = (ns, fit_speed_model(ns, steps) if ns else (0.0, 1.0, 0.0))
        return self._fits[key]

    def remaining_s(self, job: Job, remaining: float, n: int, view: View) -> float:
        a, c, d = self._sizes(job, view)[1]
        return remaining * (a / n + c + d * n) / job.base_batch

    def schedule(self, view: View) -> dict[int, Allocation]:
        free = view.total_gpus
        gpus: dict[int, int] = {}
        states = {st.job.job_id: st for st in view.jobs}
        first = []
        for st in view.jobs:
            ns = self._sizes(st.job, view)[0]
            if ns:
                first.append((self.remaining_s(st.job, st.remaining, ns[0], view), st.job.job_id, ns[0]))
        for _, jid, n in sorted(first):
            if n <= free:
                gpus[jid] = n
                free -= n
        heap = []

        def push(jid: int) -> None:
            st, n = states[jid], gpus[jid]
            if 2 * n in self._sizes(st.job, view)[0]:
                now_s = self.remaining_s(st.job, st.remaining, n, view)
                gain = (now_s - self.remaining_s(st.job, st.remaining, 2 * n, view)) / n
                if gain > 1e-9 * now_s:  # a fit's rounding noise is no gain
                    heapq.heappush(heap, (-gain, jid, n))

        for jid in gpus:
            push(jid)
        while heap:
            _, jid, n = heapq.heappop(heap)
            if n <= free:  # doubling adds n GPUs
                gpus[jid] = 2 * n
                free -= n
                push(jid)
        return {jid: Allocation(n, states[jid].job.base_batch) for jid, n in gpus.items()}
