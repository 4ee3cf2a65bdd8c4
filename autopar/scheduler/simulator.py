"""The event-driven cluster simulator every policy runs on (deterministic: no clock, no randomness).

Events are job arrivals, job completions and, for policies with an ``interval_s``, periodic
scheduling rounds. At each event the policy maps the active jobs to :class:`Allocation` s
(GPUs and global batch; absent means "not running"); the simulator checks them (GPUs in the
cluster, powers of two, batches that fit), charges a restart or migration to every job whose
allocation changed (:meth:`JobModel.migration_seconds`: no progress while it reloads; the
launches of a round start together, after the round's stops, ``JobModel.stop_s``), places the
changed jobs on nodes, and advances every running job at its goodput until the next event (on
CPU slots that share cores, ``JobModel.shared_cores``, slowed by the ranks training beside it:
``JobModel.contention``). A
job completes ``JobModel.exit_s`` after its last step (its GPUs are held until then); a policy
that changes the allocation of such an exiting job gets what the real controller gets: nothing
to stop or relaunch, the job is gone at its finish and the round's launches wait for it.
A policy's randomness comes from its own seeded generator, so a run is a function of
(workload, policy, seed).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..errors import AutoparError
from .cluster import Cluster, Placement
from .jobs import Job, JobModel

__all__ = ["Allocation", "JobState", "Policy", "SchedulerError", "SimResult", "View", "simulate"]


class SchedulerError(AutoparError, RuntimeError):
    """A policy returned an allocation the cluster cannot run."""


@dataclass(frozen=True)
class Allocation:
    gpus: int
    batch: int


@dataclass
class JobState:
    """A job's progress inside one simulation (owned and mutated by the simulator only)."""

    job: Job
    done_work: float = 0.0
    attained_gpu_s: float = 0.0
    alloc: Allocation | None = None
    placement: Placement = ()
    paused_until: float = 0.0
    start_s: float | None = None
    finish_s: float | None = None
    work_done_s: float | None = None  # its last step ended (it finishes model.exit_s later)
    last_scheduled_s: float = 0.0  # the last time it held GPUs (end of its last running interval)
    restarts: int = 0

    @property
    def remaining(self) -> float:
        return max(self.job.work - self.done_work, 0.0)

    @property
    def spans_nodes(self) -> bool:
        return len(self.placement) > 1


@dataclass(frozen=True)
class View:
    """What a policy sees at a round: the time, the active jobs (arrived, unfinished), the cluster."""

    now: float
    jobs: Sequence[JobState]
    total_gpus: int
    devices_per_node: int
    model: JobModel


class Policy(Protocol):
    name: str
    interval_s: float | None  # periodic rounds; None: only on arrivals and completions

    def schedule(self, view: View) -> dict[int, Allocation]: ...


@dataclass
class SimResult:
    policy: str
    jct_s: dict[int, float]
    makespan_s: float
    utilization: float
    rounds: int
    restarts: int
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)  # (t, GPUs used, running, waiting)

    @property
    def avg_jct(self) -> float:
        return statistics.fmean(self.jct_s.values())

    @property
    def p50_jct(self) -> float:
        return statistics.median(self.jct_s.values())

    @property
    def p99_jct(self) -> float:
        values = sorted(self.jct_s.values())
        return values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]

    def summary(self) -> dict[str, float]:
        return {"avg_jct": self.avg_jct, "p50_jct": self.p50_jct, "p99_jct": self.p99_jct,
                "makespan": self.makespan_s, "utilization": self.utilization}


def _check(decisions: dict[int, Allocation], active: dict[int, JobState], view: View, policy: str) -> None:
    used = 0
    for job_id, a in decisions.items():
        if job_id not in active:
            raise SchedulerError(f"policy {policy} allocated job {job_id}, which is not active")
        if a.gpus < 1 or a.gpus & (a.gpus - 1) or a.batch < a.gpus:
            raise SchedulerError(f"policy {policy} gave job {job_id} {a.gpus} GPUs at batch {a.batch}; "
                                 f"GPU counts are powers of two and batches at least one sample per GPU")
        if view.model.goodput(active[job_id].job, a.gpus, a.batch) <= 0:
            raise SchedulerError(f"policy {policy} gave job {job_id} ({active[job_id].job.model}) {a.gpus} GPUs "
                                 f"at batch {a.batch}, which the throughput table says does not fit in memory")
        used += a.gpus
    if used > view.total_gpus:
        raise SchedulerError(f"policy {policy} allocated {used} GPUs on a cluster of {view.total_gpus}")


def _apply(decisions, active, cluster: Cluster, model: JobModel, now: float) -> None:
    changed = []
    stopped = False
    start = now  # launches of a round start together, after the round's stops (checkpoints) are done
    for job_id, st in active.items():
        new = decisions.get(job_id)
        if new == st.alloc:
            continue
        cluster.release(st.placement)
        st.placement = ()
        if st.work_done_s is not None:
            # its last step is behind it and it is exiting: told to stop, it is simply gone at its
            # finish (nothing to resume; the controller finds it finished), keeps its allocation
            # until then, and the round's launches wait for it
            start = max(start, st.work_done_s + model.exit_s)
            continue
        stopped |= st.alloc is not None and st.paused_until <= now  # one still starting stops at once
        if st.alloc is not None and new is not None or st.alloc is None and new is not None and st.done_work > 0:
            st.restarts += 1
        st.alloc = new
        if new is not None:
            changed.append(st)
    start = max(start, now + (model.stop_s if stopped else 0.0))
    # ranks + launchers alive once the round's launches are done (exiting jobs are gone by then)
    procs = sum(st.alloc.gpus + 1 for st in active.values() if st.alloc is not None and st.work_done_s is None)
    for st in sorted(changed, key=lambda s: (-s.alloc.gpus, s.job.job_id)):  # big jobs first: fewer spans
        st.placement = cluster.place(st.alloc.gpus)
        first = st.start_s is None
        st.start_s = now if first else st.start_s
        st.paused_until = start + (model.launch_seconds(procs) if first else
                                   model.migration_seconds(st.job, st.alloc.gpus, procs))


def _slowdown(st: JobState, running: list[JobState], model: JobModel) -> float:
    """``JobModel.contention`` of a running job: on each node it uses, its ranks there against
    every rank training there until the next event (jobs exiting train no more); the worst node."""
    if model.shared_cores <= 0:
        return 1.0
    busy: dict[int, int] = {}
    for other in running:
        if other.work_done_s is None:
            for node, count in other.placement:
                busy[node] = busy.get(node, 0) + count
    return max((model.contention(count, busy.get(node, count)) for node, count in st.placement), default=1.0)


def simulate(jobs: Sequence[Job], policy: Policy, model: JobModel, total_gpus: int,
             devices_per_node: int = 8) -> SimResult:
    """Run ``jobs`` under ``policy`` until all finish; JCT is finish minus arrival."""
    cluster = Cluster.with_gpus(total_gpus, devices_per_node)
    pending = sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))
    for j in pending:
        if j.requested_gpus > cluster.total:
            raise SchedulerError(f"job {j.job_id} requests {j.requested_gpus} GPUs, more than the cluster's "
                                 f"{cluster.total}; drop it from the workload or grow the cluster")
    active: dict[int, JobState] = {}
    done: dict[int, JobState] = {}
    now = pending[0].arrival_s if pending else 0.0
    t_first = now
    i = rounds = 0
    busy_gpu_s = 0.0
    timeline: list[tuple[float, int, int, int]] = []
    while i < len(pending) or active:
        while i < len(pending) and pending[i].arrival_s <= now:
            active[pending[i].job_id] = JobState(pending[i])
            i += 1
        view = View(now, tuple(active.values()), cluster.total, devices_per_node, model)
        decisions = policy.schedule(view) if active else {}
        _check(decisions, active, view, policy.name)
        _apply(decisions, active, cluster, model, now)
        rounds += 1
        running = [st for st in active.values() if st.alloc is not None]
        timeline.append((now, sum(st.alloc.gpus for st in running if st.placement), len(running),
                         len(active) - len(running)))
        rates = {st.job.job_id: model.goodput(st.job, st.alloc.gpus, st.alloc.batch, st.spans_nodes)
                 / _slowdown(st, running, model) for st in running}
        t_next = pending[i].arrival_s if i < len(pending) else math.inf
        work_end = {jid: active[jid].work_done_s if active[jid].work_done_s is not None else
                    max(now, active[jid].paused_until) + active[jid].remaining / g for jid, g in rates.items()}
        finish = {jid: t + model.exit_s for jid, t in work_end.items()}
        t_next = min([t_next, *finish.values()])
        if policy.interval_s and active:
            t_next = min(t_next, now + policy.interval_s)
        if math.isinf(t_next):
            raise SchedulerError(f"policy {policy.name} left {len(active)} jobs waiting on an idle cluster at "
                                 f"t={now:.0f} s; every active job needs a chance to run")
        for st in active.values():
            if st.alloc is None:
                continue
            st.attained_gpu_s += st.alloc.gpus * (t_next - now)
            st.last_scheduled_s = t_next
            run_s = max(0.0, t_next - max(now, st.paused_until))
            busy_gpu_s += st.alloc.gpus * run_s
            jid = st.job.job_id
            if finish[jid] <= t_next * (1 + 1e-12):
                st.done_work, st.finish_s = st.job.work, finish[jid]
            elif work_end[jid] <= t_next:  # exiting: the work is done, the GPUs are still held
                st.done_work, st.work_done_s = st.job.work, work_end[jid]
            else:
                st.done_work += rates[jid] * run_s
        for jid in [jid for jid, st in active.items() if st.finish_s is not None]:
            st = active.pop(jid)
            cluster.release(st.placement)
            done[jid] = st
        now = t_next
    makespan = max((st.finish_s for st in done.values()), default=t_first) - t_first
    return SimResult(policy.name, {jid: st.finish_s - st.job.arrival_s for jid, st in sorted(done.items())},
                     makespan, busy_gpu_s / (cluster.total * makespan) if makespan > 0 else 0.0, rounds,
                     sum(st.restarts for st in done.values()), timeline)
