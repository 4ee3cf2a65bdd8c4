"""Wall time of whole `autopar plan` runs (trace, mesh search, ILPs, baselines), and ILP sizes.

    python bench/planner.py            # gpt2 on 8, gpt2-xl on 64, gpt3-175b on 1024 (a100-80gb)
    python bench/planner.py --quick    # gpt2 on 8 only

Targets from the planner issue: gpt2/8 < 5 s, gpt2-xl/64 < 15 s, gpt3-175b/1024 < 60 s.
"""

from __future__ import annotations

import argparse
import json
import time

from autopar.models import get_model
from autopar.planner import plan

CASES = [("gpt2", 8, 5.0), ("gpt2-xl", 64, 15.0), ("gpt3-175b", 1024, 60.0)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for name, n, target in CASES[:1] if args.quick else CASES:
        runs = []
        for _ in range(2):  # the first run in a process pays one-time warm-ups; both are shown
            t0 = time.perf_counter()
            model, inputs = get_model(name, device="meta")
            p = plan(model, n, inputs, model_name=name)
            runs.append(time.perf_counter() - t0)
        seconds, warm = runs
        best_baseline = min((b for b in p.baselines if b.feasible), key=lambda b: b.step_seconds, default=None)
        rows.append(dict(model=name, devices=n, wall_s=seconds, warm_wall_s=warm, target_s=target, mesh=str(p.mesh),
                         ilp_variables=p.solver.n_variables, ilp_constraints=p.solver.n_constraints,
                         ilps=p.solver.ilps_solved, gap=p.solver.gap, step_ms=p.step_seconds * 1e3,
                         best_baseline=best_baseline.name if best_baseline else None,
                         speedup_vs_best_baseline=(best_baseline.step_seconds / p.step_seconds) if best_baseline else None))
        r = rows[-1]
        print(f"{name:10s} {n:5d} devices  plan {seconds:6.1f} s first run, {warm:5.1f} s second (target "
              f"{target:.0f} s: {'met' if seconds < target else 'MISSED'} cold, {'met' if warm < target else 'MISSED'} "
              f"warm)  mesh {r['mesh']:22s} ILP {r['ilp_variables']:,} vars "
              f"x {r['ilps']}  gap {r['gap'] * 100:.2f}%  step {r['step_ms']:.1f} ms  "
              f"vs best baseline ({r['best_baseline']}) {r['speedup_vs_best_baseline'] or float('nan'):.2f}x",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
