"""Run policies on seeded workloads and report JCT, makespan and utilization (table and JSON)."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

from .jobs import Job, JobModel
from .registry import make_policy
from .simulator import SimResult, simulate

__all__ = ["SeedRun", "run_seed", "format_table", "reductions", "to_json"]


@dataclass(frozen=True)
class SeedRun:
    seed: int
    jobs: tuple[Job, ...]
    results: dict[str, SimResult]
    seconds: dict[str, float]  # wall clock per policy
    cpu_seconds: dict[str, float]  # this process's CPU time per policy (the wall clock counts a busy machine)


def run_seed(jobs: Sequence[Job], policies: Sequence[str], model: JobModel, gpus: int, seed: int,
             progress: bool = True) -> SeedRun:
    results, seconds, cpu = {}, {}, {}
    for name in policies:
        t0, c0 = time.perf_counter(), time.process_time()
        results[name] = simulate(jobs, make_policy(name, seed), model, gpus, model.table.devices_per_node)
        seconds[name], cpu[name] = time.perf_counter() - t0, time.process_time() - c0
        if progress:
            r = results[name]
            print(f"seed {seed} {name}: avg JCT {r.avg_jct / 3600:.2f} h, {r.rounds} rounds, {r.restarts} restarts "
                  f"({seconds[name]:.1f} s, CPU {cpu[name]:.1f} s)", file=sys.stderr, flush=True)
    return SeedRun(seed, tuple(jobs), results, seconds, cpu)


def format_table(run: SeedRun) -> str:
    lines = [f"seed {run.seed}: {len(run.jobs)} jobs",
             f"{'policy':10s} {'avg JCT h':>10s} {'p50 JCT h':>10s} {'p99 JCT h':>10s} {'makespan h':>11s} "
             f"{'util':>6s} {'restarts':>9s} {'sim s':>6s} {'cpu s':>6s}"]
    for name, r in run.results.items():
        lines.append(f"{name:10s} {r.avg_jct / 3600:10.2f} {r.p50_jct / 3600:10.2f} {r.p99_jct / 3600:10.2f} "
                     f"{r.makespan_s / 3600:11.2f} {r.utilization:6.2f} {r.restarts:9d} {run.seconds[name]:6.1f} "
                     f"{run.cpu_seconds[name]:6.1f}")
    return "\n".join(lines)


def reductions(runs: Sequence[SeedRun], policy: str = "ones") -> dict[str, dict[str, float]]:
    """Per other policy: mean, min and max over seeds of 1 - avg JCT(policy) / avg JCT(other)."""
    out = {}
    if not runs or policy not in runs[0].results:
        return out
    for other in runs[0].results:
        if other == policy:
            continue
        r = [1 - run.results[policy].avg_jct / run.results[other].avg_jct for run in runs]
        out[other] = {"mean": statistics.fmean(r), "min": min(r), "max": max(r),
                      "stdev": statistics.stdev(r) if len(r) > 1 else 0.0, "per_seed": r}
    return out


def to_json(runs: Sequence[SeedRun], meta: dict[str, Any]) -> dict[str, Any]:
    names = list(runs[0].results) if runs else []
    mean = {n: {k: statistics.fmean(run.results[n].summary()[k] for run in runs)
                for k in ("avg_jct", "p50_jct", "p99_jct", "makespan", "utilization")} for n in names}
    return {"policies": mean,
            "seeds": {str(run.seed): {"policies": {n: r.summary() | {"restarts": r.restarts, "rounds": r.rounds,
                                                                    "sim_seconds": run.seconds[n],
                                                                    "cpu_seconds": run.cpu_seconds[n]}
                                                   for n, r in run.results.items()}} for run in runs},
            "ones_reduction": reductions(runs), **meta}
