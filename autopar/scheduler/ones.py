"""ONES (Bian, Li, Wang, You, "Online Evolutionary Batch Size Orchestration for Scheduling Deep
Learning Workloads in GPU Clusters", SC'21): elastic batch sizes chosen by an evolutionary search.

A *schedule* maps each active job to a GPU count (0: not running). Its batch follows from the
count: the job's per-GPU batch times its GPUs, up to the job's batch cap, with the learning rate
scaled linearly (``efficiency.py``). The scaling rules, as we read the paper:

1. GPU counts are powers of two within the job's elastic range and the cluster;
2. a running job at most doubles or halves per round (batch sizes grow gradually);
3. a job (re)starts at no more than its requested GPUs;
4. a configuration must fit in memory (the throughput table has a plan for it).

The population persists across rounds (the search is online). Each round it drops finished jobs,
adds the running schedule as an individual, and breeds for ``generations``: tournament
selection, *uniform crossover* (each job's count from either parent), *mutation* that drops
jobs (and doubles or halves some), *repair* to the rules and the cluster size (shrinking or
dropping the jobs with the longest predicted remaining time first), and a *fill* step that gives
free GPUs to waiting jobs, new and short ones first, then doubles the running jobs that gain the
most. Fitness (lower is better) is the predicted sum of remaining completion times: a running
job's remaining work over its goodput plus any restart its change costs; a waiting job's time at
its requested size plus the median running job's time as its expected wait. The
migration-minimising reorder (keep unchanged jobs on their GPUs) happens in the placement step,
and the best schedule replaces the running one (plus waiting jobs filled into free GPUs) only
when it predicts at least ``min_gain`` less total remaining time, so noise in the search does
not move jobs.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from .simulator import Allocation, JobState, View

__all__ = ["Ones"]

Schedule = dict[int, int]  # job id -> GPUs (absent or 0: not running)


@dataclass
class Ones:
    seed: int = 0
    population: int = 12
    generations: int = 3
    p_drop: float = 0.05
    p_scale: float = 0.15
    min_gain: float = 0.02  # adopt a new schedule only if it predicts >= 2% less total remaining time
    name: str = "ones"
    interval_s: float | None = 300.0
    _pop: list[Schedule] = field(default_factory=list, repr=False)
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    # ------------------------------------------------------------------ rules
    def allowed(self, st: JobState, view: View) -> list[int]:
        """GPU counts rules 1-4 allow for this job this round (ascending; 0 not included)."""
        job, cur = st.job, (st.alloc.gpus if st.alloc else 0)
        cap = min(job.max_gpus, view.total_gpus)
        out = []
        n = 1
        while n <= cap:
            if (cur and cur // 2 <= n <= 2 * cur) or (not cur and n <= job.requested_gpus):
                b = job.elastic_batch(n)
                if b >= n and view.model.goodput(job, n, b) > 0:
                    out.append(n)
            n *= 2
        return out

    def _time(self, st: JobState, n: int, view: View) -> float:
        b = st.job.elastic_batch(n)
        t = view.model.remaining_seconds(st.job, st.remaining, n, b)
        cur = st.alloc.gpus if st.alloc else 0
        if n != cur:
            t += view.model.migration_seconds(st.job, n) if st.done_work > 0 else view.model.restart_overhead_s
        return t

    # ------------------------------------------------------------------ fitness and operators
    def fitness(self, sched: Schedule, ctx: "_Round") -> float:
        run = sorted(ctx.times[jid][n] for jid, n in sched.items() if n)
        wait = run[len(run) // 2] if run else 0.0  # the median running job's time
        n_wait = len(ctx.ids) - len(run)
        waiting = ctx.wait_sum - sum(ctx.wait_time[jid] for jid in sched)
        return sum(run) + n_wait * wait + waiting

    def repair(self, sched: Schedule, ctx: "_Round") -> Schedule:
        out: Schedule = {}
        for jid, n in sched.items():
            allowed = ctx.allowed.get(jid)
            if n and allowed:
                out[jid] = n if n in ctx.allowed_set[jid] else min(allowed, key=lambda a: (abs(math.log2(a / n)), a))
        used = sum(out.values())
        if used > ctx.total:  # shrink or drop the longest-running jobs first
            heap = [(-ctx.times[j][n], j) for j, n in out.items()]
            heapq.heapify(heap)
            while used > ctx.total:
                _, jid = heapq.heappop(heap)
                smaller = [a for a in ctx.allowed[jid] if a < out[jid]]
                new = smaller[-1] if smaller else 0
                used -= out[jid] - new
                if new:
                    out[jid] = new
                    heapq.heappush(heap, (-ctx.times[jid][new], jid))
                else:
                    del out[jid]
        return out

    def fill(self, sched: Schedule, ctx: "_Round") -> Schedule:
        free = ctx.total - sum(sched.values())
        for jid in ctx.fill_order:
            if free < ctx.min_gpus[jid]:
                if free <= 0:
                    break
                continue
            if jid in sched:
                continue
            fits = [a for a in ctx.allowed[jid] if a <= free]
            sched[jid] = fits[-1]
            free -= fits[-1]
        heap = []  # (-time saved per GPU added by doubling, job)

        def push(jid: int) -> None:
            n = sched[jid]
            t2 = ctx.times[jid].get(2 * n)
            if t2 is not None and n <= free and ctx.times[jid][n] > t2:
                heapq.heappush(heap, ((t2 - ctx.times[jid][n]) / n, jid, n))

        for jid in sched:
            push(jid)
        while heap and free > 0:
            _, jid, n = heapq.heappop(heap)
            if sched[jid] == n and n <= free:
                free -= n
                sched[jid] = 2 * n
                push(jid)
        return sched

    def _child(self, scored: list[tuple[float, Schedule]], ctx: "_Round") -> Schedule:
        rng = self._rng

        def pick() -> Schedule:
            a, b = rng.randrange(len(scored)), rng.randrange(len(scored))
            return scored[min(a, b)][1]  # scored is sorted: the lower index is the fitter

        pa, pb = pick(), pick()
        child: Schedule = {}
        for jid in sorted(pa.keys() | pb.keys()):  # uniform crossover (a job absent from both stays out)
            n = (pa if rng.random() < 0.5 else pb).get(jid, 0)
            if n:
                r = rng.random()
                if r < self.p_drop:
                    continue  # mutation: drop the job
                if r < self.p_drop + self.p_scale:
                    n = n * 2 if rng.random() < 0.5 else n // 2
                if n:
                    child[jid] = n
        return self.fill(self.repair(child, ctx), ctx)

    # ------------------------------------------------------------------ one round
    def schedule(self, view: View) -> dict[int, Allocation]:
        ctx = _Round.build(self, view)
        current = {st.job.job_id: st.alloc.gpus for st in view.jobs if st.alloc}
        pool = [self.fill(self.repair(dict(s), ctx), ctx) for s in [current, *self._pop]]
        scored = _dedupe_sorted([(self.fitness(s, ctx), s) for s in pool])[: self.population]
        for _ in range(self.generations):
            children = [self._child(scored, ctx) for _ in range(self.population)]
            scored = _dedupe_sorted(scored + [(self.fitness(c, ctx), c) for c in children])[: self.population]
        self._pop = [s for _, s in scored]
        best_f, best = scored[0]
        keep_f = self.fitness(pool[0], ctx)  # the running schedule, waiting jobs filled in
        if best_f > (1 - self.min_gain) * keep_f:
            best = pool[0]  # not worth the migrations: keep running jobs where they are
        states = {st.job.job_id: st for st in view.jobs}
        return {jid: Allocation(n, states[jid].job.elastic_batch(n)) for jid, n in best.items() if n}


def _dedupe_sorted(scored: list[tuple[float, Schedule]]) -> list[tuple[float, Schedule]]:
    """Sorted by fitness (stable: earlier individuals first on ties), duplicates removed."""
    seen, out = set(), []
    for f, s in sorted(scored, key=lambda x: x[0]):
        key = frozenset(s.items())
        if key not in seen:
            seen.add(key)
            out.append((f, s))
    return out


@dataclass
class _Round:
    """Per-round tables: allowed counts and predicted times per job, the fill order."""

    total: int
    ids: list[int]
    allowed: dict[int, list[int]]
    allowed_set: dict[int, frozenset[int]]
    min_gpus: dict[int, int]
    times: dict[int, dict[int, float]]
    wait_time: dict[int, float]
    wait_sum: float
    fill_order: list[int]

    @classmethod
    def build(cls, policy: Ones, view: View) -> "_Round":
        allowed, times, wait = {}, {}, {}
        for st in view.jobs:
            jid = st.job.job_id
            allowed[jid] = policy.allowed(st, view)
            times[jid] = {n: policy._time(st, n, view) for n in allowed[jid]}
            req = [n for n in allowed[jid] if n <= st.job.requested_gpus] or allowed[jid]
            wait[jid] = min((times[jid][n] for n in req), default=math.inf)
        ids = [jid for jid in sorted(allowed) if allowed[jid]]  # a job that fits nowhere is never scheduled
        # new and short jobs first: least predicted time, then latest arrival
        arrival = {st.job.job_id: st.job.arrival_s for st in view.jobs}
        order = sorted(ids, key=lambda j: (wait[j], -arrival[j], j))
        return cls(view.total_gpus, ids, allowed, {j: frozenset(a) for j, a in allowed.items()},
                   {j: allowed[j][0] for j in ids}, times, wait, sum(wait[j] for j in ids), order)
