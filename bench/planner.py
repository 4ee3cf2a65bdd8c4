"""Wall time of whole `autopar plan` runs (trace, mesh search, ILPs, baselines), and ILP sizes.

    python bench/planner.py            # gpt2 on 8, gpt2-xl on 64, gpt3-175b on 1024 (a100-80gb)
    python bench/planner.py --quick    # gpt2 on 8 only
    python bench/planner.py --cases gpt2 gpt2-xl --repeat 3

Targets (issue 19 item 4), for the end-to-end CLI (``cli`` below; "met" judges it): gpt2/8 < 5 s,
gpt2-xl/64 < 10 s, gpt3-175b/1024 at batch 1536 < 30 s.

Three figures per case, because on this 2-core machine Python's imports alone take seconds:

* ``plan``: in one process that has imported autopar and torch's tracer (``torch.export`` and
  ``torch._dynamo``, which every trace loads), the wall time from building the model on the
  meta device to the finished Plan with its baselines: the first call (one-time lazy
  initialization inside torch.export included) and a second call;
* ``imports``: a fresh interpreter importing what the CLI imports (``import torch`` alone is
  ~3.7 s here);
* ``cli``: ``autopar plan MODEL --gpus N --quiet`` in a fresh process, start to report (the
  median of ``--repeat`` runs, 3 by default), and its CPU seconds (user + system, the planner's
  forked helper processes included): on a machine shared with other jobs the wall time moves
  with the load, the CPU time much less. The 1-min load average is printed and stored.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch._dynamo  # noqa: F401  (loaded by every trace; timed under "imports", not "plan")
import torch.export  # noqa: F401

from autopar.models import get_model
from autopar.planner import plan

# (zoo name, devices, target seconds, global batch; None: the zoo entry's). GPT-3 175B at its
# published batch of 1536 needs pipeline stages (nothing fits without them on 1024 A100-80GB).
CASES = [("gpt2", 8, 5.0, None), ("gpt2-xl", 64, 10.0, None), ("gpt3-175b", 1024, 30.0, 1536)]
_IMPORTS = "import autopar.cli, autopar.planner, autopar.models, torch._dynamo, torch.export"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of a fresh process, its forked helpers included: on a shared
    machine the wall time moves with the load, the CPU time much less."""
    t0, c0 = time.perf_counter(), _children_cpu()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    return time.perf_counter() - t0, _children_cpu() - c0


def _wall(cmd: list[str]) -> float:
    return _run(cmd)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-cli", action="store_true", help="skip the fresh-process CLI runs")
    parser.add_argument("--repeat", type=int, default=3, help="CLI runs per case (their median is reported)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", nargs="*", default=None, metavar="MODEL",
                        help="run only these zoo names of the cases (e.g. gpt2 gpt2-xl)")
    args = parser.parse_args()
    print(f"1-min load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    imports_s = _wall([sys.executable, "-c", _IMPORTS])
    print(f"imports (fresh interpreter: torch, autopar, torch.export): {imports_s:.1f} s", flush=True)
    rows = []
    cases = CASES[:1] if args.quick else CASES
    if args.cases:
        unknown = set(args.cases) - {c[0] for c in CASES}
        if unknown:
            parser.error(f"--cases {' '.join(sorted(unknown))}: not a case; pick among {', '.join(c[0] for c in CASES)}")
        cases = [c for c in cases if c[0] in args.cases]
    for name, n, target, batch in cases:
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            model, inputs = get_model(name, batch_size=batch, device="meta")
            p = plan(model, n, inputs, model_name=name)
            runs.append(time.perf_counter() - t0)
        seconds, warm = runs
        cli = [sys.executable, "-m", "autopar.cli", "plan", name, "--gpus", str(n), "--quiet"] + (
            [] if batch is None else ["--batch", str(batch)])
        runs_cli = [] if args.no_cli else [_run(cli) for _ in range(args.repeat)]
        cli_s = statistics.median(w for w, _ in runs_cli) if runs_cli else None
        cli_cpu_s = statistics.median(c for _, c in runs_cli) if runs_cli else None
        best_baseline = min((b for b in p.baselines if b.feasible), key=lambda b: b.step_seconds, default=None)
        rows.append(dict(model=name, devices=n, batch=batch, wall_s=seconds, warm_wall_s=warm, cli_wall_s=cli_s,
                         cli_cpu_s=cli_cpu_s, cli_runs=runs_cli, load_1min=os.getloadavg()[0],
                         imports_s=imports_s, target_s=target, mesh=str(p.mesh),
                         ilp_variables=p.solver.n_variables, ilp_constraints=p.solver.n_constraints,
                         ilps=p.solver.ilps_solved, gap=p.solver.gap, step_ms=p.step_seconds * 1e3,
                         best_baseline=best_baseline.name if best_baseline else None,
                         speedup_vs_best_baseline=(best_baseline.step_seconds / p.step_seconds) if best_baseline else None))
        r = rows[-1]
        # the target is the end-to-end CLI (issue 19 item 4); without CLI runs, the in-process
        # first plan is all there is to judge, and the line says so
        judged, what = (seconds, "in-process plan, no CLI run") if cli_s is None else (cli_s, "cli")
        r["met"] = judged < target
        cli = "" if cli_s is None else f", cli {cli_s:.1f} s (CPU {cli_cpu_s:.1f} s)"
        print(f"{name:10s} {n:5d} devices  plan {seconds:5.1f} s first, {warm:5.1f} s second{cli} (target "
              f"{target:.0f} s for the {what}: {'met' if r['met'] else 'MISSED'})  mesh {r['mesh']:20s} "
              f"ILP {r['ilp_variables']:,} vars x {r['ilps']}  gap {r['gap'] * 100:.2f}%  step {r['step_ms']:.1f} ms"
              + (f"  vs best baseline ({r['best_baseline']}) {r['speedup_vs_best_baseline']:.2f}x" if best_baseline
                 else "  no baseline fits in memory"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
