"""``autopar schedule``: simulate policies on seeded trace workloads and print the table."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .cluster import Cluster
from .efficiency import NoiseScaleEfficiency
from .jobs import JobModel
from .registry import POLICIES, make_policy
from .report import format_table, reductions, run_seed, to_json
from .throughput import load_table
from .workload import WorkloadError, load_trace, sample_workload

__all__ = ["add_arguments", "run"]


def _seeds(text: str) -> list[int]:
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise WorkloadError(f"cannot read --seed {text!r}; write a seed, a list or a range: 0, 0,3,7 or 0-4") from None
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="Philly-format CSV (.gz ok); default: the shipped October 2017 slice")
    p.add_argument("--gpus", type=int, default=64, help="cluster GPUs, whole nodes of 8 (default 64)")
    p.add_argument("--jobs", type=int, default=100, help="jobs per workload (default 100)")
    p.add_argument("--policy", default="all", help=f"{'|'.join(POLICIES)}|all (default all)")
    p.add_argument("--seed", default="0", help="workload/policy seed, or a list: 0,1,2 or 0-4")
    p.add_argument("--window", type=float, default=8.0, help="trace window the jobs come from, hours (default 8)")
    p.add_argument("--table", default=None, help="throughput table JSON (default: the shipped a100-80gb one)")
    p.add_argument("--noise-scale-ratio", type=float, default=8.0,
                   help="gradient noise scale over the base batch (statistical efficiency; default 8)")
    p.add_argument("--restart-s", type=float, default=20.0, help="restart overhead of a resize, seconds (default 20)")
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--html", default=None, help="write a page with each policy's allocation over time here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    names = list(POLICIES) if args.policy == "all" else args.policy.split(",")
    for name in names:
        make_policy(name)  # an unknown name fails here, naming the known ones, before any work
    Cluster.with_gpus(args.gpus)  # whole nodes: fails here, with the fix, before any work
    table = load_table(args.table)
    model = JobModel(table, NoiseScaleEfficiency(args.noise_scale_ratio), args.restart_s)
    trace = load_trace(args.trace)
    runs = []
    t0 = time.perf_counter()
    for seed in _seeds(args.seed):
        jobs = sample_workload(trace, args.jobs, args.gpus, model, seed=seed, window_hours=args.window)
        run_ = run_seed(jobs, names, model, args.gpus, seed, progress=not args.quiet)
        runs.append(run_)
        print(format_table(run_) + "\n")
    red = reductions(runs)
    for other, r in red.items():
        print(f"ONES avg JCT vs {other}: {100 * abs(r['mean']):.1f}% {'lower' if r['mean'] >= 0 else 'higher'} on "
              f"average over {len(runs)} seeds (reduction min {100 * r['min']:.1f}%, max {100 * r['max']:.1f}%)")
    print(f"throughput table: {table.n_plans} plans ({table.hardware}); {time.perf_counter() - t0:.1f} s")
    if args.json:
        meta = {"gpus": args.gpus, "jobs": args.jobs, "window_hours": args.window, "hardware": table.hardware,
                "table_plans": table.n_plans, "noise_scale_ratio": args.noise_scale_ratio,
                "restart_s": args.restart_s}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(to_json(runs, meta), fh, indent=1)
        print(f"results written to {args.json}", file=sys.stderr)
    if args.html:
        from .html import write_html

        write_html(runs, args.gpus, args.html)
        print(f"HTML written to {args.html}", file=sys.stderr)
    return 0
