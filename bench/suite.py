"""The benchmark suite: autopar's runtime against torch's parallel methods, the cost model's
fidelity, and the planner's scaling, in one command.

    python bench/suite.py                 # ~12-15 min on the 2-core CPU machine
    python bench/suite.py --quick         # smoke run, ~5 min (tiny model, fewer plans)
    python bench/suite.py --json out.json --hardware cpu
    python bench/suite.py --skip runtime scaling   # calibrate + the fidelity section only, ~9 min

1. **Runtime vs baselines** (4 CPU ranks, gloo): one GPT (``runtime_vs_baselines.FULL``) trained
   the same steps on the same global batch by torch DDP, FSDP2, hand-written DTensor tensor
   parallelism, autopar pinned to each of those families (``dp``, ``zero3``, ``megatron``), autopar
   on a 2x2 ``megatron-dp`` mesh, and autopar's own choice (``auto``). One launch per method.
2. **Fidelity** of the five autopar plans: predicted vs measured bytes per collective, peak
   memory per rank and step time, and the Spearman rank correlation of the step times.
3. **Planner scaling**: plan wall time and ILP size vs depth and vs number of devices (meta
   models, a100-80gb profile, no ranks).
4. **Fidelity over many plans** (``bench/fidelity.py``): 11 plans of the same GPT (data parallel,
   ZeRO-2/3, recompute, Megatron 1D with and without sequence parallelism, Megatron x dp, 2D,
   two pipelines, the planner's pick) timed round-robin in one 4-rank launch (medians, so load
   swings hit every plan alike): Spearman of predicted vs measured step time, median error,
   peak memory per plan, the planner's pick vs every baseline it was predicted to beat.

Tables go to stdout, progress to stderr, every figure to ``--json``
(default ``bench/results/suite.json``, which git ignores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fidelity  # noqa: E402
from report_tables import fidelity_rows, print_fidelity, print_runtime, print_scaling  # noqa: E402
from runtime_vs_baselines import FULL, QUICK, build_model  # noqa: E402

METHODS = ["ddp", "autopar-dp", "fsdp2", "autopar-zero3", "tp", "autopar-megatron", "autopar-megatron-dp",
           "autopar-auto"]
DEPTHS, DEVICES = (12, 24, 48, 96), (8, 64, 256, 1024)
QUICK_DEPTHS, QUICK_DEVICES = (12,), (64,)  # one plan: gpt2 on 64 devices
SCALING_DEPTH_DEVICES = 64


def _log(msg: str) -> None:
    print(f"[suite {time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def resolve_hardware(choice: str, out_dir: str, quick: bool) -> tuple[str, str]:
    """The profile autopar plans with, and why: a calibrated profile when ``autopar
    calibrate`` exists and ``choice`` is ``auto``, else the built-in ``cpu``."""
    if choice != "auto":
        return choice, "given with --hardware"
    cmd = [sys.executable, "-m", "autopar.cli", "calibrate"]
    probe = subprocess.run(cmd + ["--help"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "cpu", "built-in 'cpu' profile (autopar calibrate does not exist yet)"
    flag = next((f for f in ("--out", "--output", "-o") if re.search(rf"(^|\s){re.escape(f)}\b", probe.stdout)), None)
    path = os.path.join(out_dir, "cpu-calibrated.json")
    extra = ["--quick"] if quick and "--quick" in probe.stdout else []
    run = subprocess.run(cmd + ([flag, path] if flag else []) + extra, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode == 0 and os.path.isfile(path):
        return path, f"measured now by autopar calibrate{' --quick' if quick else ''} (4 ranks)"
    return "cpu", (f"built-in 'cpu' profile (autopar calibrate failed, rc {run.returncode}: "
                   f"{(run.stderr or run.stdout).strip()[-300:]})")


def reference_loss(quick: bool) -> float:
    """The step-0 loss of the unparallelized model on the global batch: every method must match."""
    import torch

    model, inputs = build_model(QUICK if quick else FULL)
    with torch.no_grad():
        return model(*inputs).item()


def run_runtime(methods: list[str], hardware: str, quick: bool, timeout_s: float) -> list[dict]:
    """One launch of ``runtime_vs_baselines.py`` per method (all methods in one launch with
    --quick: rank start-up and imports are ~10 s a launch here)."""
    groups = [methods] if quick else [[m] for m in methods]
    records: list[dict] = []
    for group in groups:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [sys.executable, os.path.join(HERE, "runtime_vs_baselines.py"), "--methods", *group,
                   "--out", out, "--hardware", hardware] + (["--quick"] if quick else [])
            t0, load_before = time.perf_counter(), os.getloadavg()[0]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s * len(group),
                                      env=dict(os.environ, OMP_NUM_THREADS="1"))
                stderr = proc.stderr
            except subprocess.TimeoutExpired as exc:
                stderr = f"timed out after {exc.timeout:.0f} s\n" + (exc.stderr or b"").decode(errors="replace")
            got = json.load(open(out)) if os.path.exists(out) else []
        done = {r["method"] for r in got}
        for m in group:
            if m not in done:
                got.append(dict(method=m, ok=False, error=_last_error(stderr), traceback=stderr[-3000:]))
        for r in got:
            r["launch_wall_s"] = time.perf_counter() - t0
            r["load1_before_after"] = [load_before, os.getloadavg()[0]]  # other jobs on the machine
            _log(f"{r['method']}: " + (f"{r['median_step_s'] * 1e3:.0f} ms/step" if r.get("ok")
                                       else f"FAILED {r['error'][:200]}"))
        records += got
    order = {m: i for i, m in enumerate(methods)}
    return sorted(records, key=lambda r: order.get(r["method"], len(order)))


def _last_error(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    errors = [l for l in lines if re.match(r"^\w*(Error|Exception)\b", l.strip())]
    return (errors or lines or ["no output"])[-1].strip()[:500]


class _PlanTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _PlanTimeout()


def run_scaling(quick: bool, budget_s: float, case_limit_s: float) -> list[dict]:
    """Each case is one whole ``autopar.plan``; a case stops at ``case_limit_s`` (SIGALRM; a
    solver call finishes first) and none starts after ``budget_s`` of this section."""
    import signal

    import torch._dynamo  # noqa: F401  (imported before timing: every trace loads it)
    import torch.export  # noqa: F401

    from autopar.models import get_model, gpt
    from autopar.planner import plan

    t_section = time.perf_counter()
    model, inputs = get_model("gpt-tiny", device="meta")
    plan(model, 8, inputs)  # one-time lazy initialization inside torch.export, not timed below
    depths, devices = (QUICK_DEPTHS, QUICK_DEVICES) if quick else (DEPTHS, DEVICES)
    cases = [("depth", d, SCALING_DEPTH_DEVICES) for d in depths] + [("devices", 12, n) for n in devices]
    rows, seen = [], {}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for sweep, depth, n in cases:
            base = dict(sweep=sweep, n_layer=depth, devices=n)
            if (depth, n) in seen:  # gpt2 is the 12-layer case: the same plan, measured once
                rows.append(dict(seen[(depth, n)], **base))
                continue
            left = budget_s - (time.perf_counter() - t_section)
            if left <= 1:
                rows.append(dict(base, error=f"skipped: the section's {budget_s:.0f} s budget is spent"))
                continue
            limit = int(min(case_limit_s, left)) + 1
            t0 = time.perf_counter()
            signal.alarm(limit)
            try:
                model, inputs = gpt("gpt2", n_layer=depth, batch_size=8, seq_len=1024, device="meta")
                p = plan(model, n, inputs, hardware="a100-80gb")
            except _PlanTimeout:
                row = dict(base, error=f"stopped after {limit} s", plan_wall_s=time.perf_counter() - t0)
            except Exception as exc:  # a planner failure is a result too
                row = dict(base, error=f"{type(exc).__name__}: {str(exc)[:300]}", plan_wall_s=time.perf_counter() - t0)
            else:
                row = dict(base, plan_wall_s=time.perf_counter() - t0, ilp_variables=p.solver.n_variables,
                           ilp_constraints=p.solver.n_constraints, ilps_solved=p.solver.ilps_solved,
                           mesh=str(p.mesh), predicted_step_ms=p.step_seconds * 1e3, gap=p.solver.gap)
            finally:
                signal.alarm(0)
            seen[(depth, n)] = row
            rows.append(row)
            _log(f"plan {depth} layers on {n} devices: {row['plan_wall_s']:.1f} s "
                 + (row.get("error") or f"{row['ilp_variables']} ILP variables"))
    finally:
        signal.signal(signal.SIGALRM, old)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps, fewer planner cases")
    parser.add_argument("--json", default=os.path.join(HERE, "results", "suite.json"))
    parser.add_argument("--hardware", default="auto",
                        help="profile autopar plans the runtime runs with: auto (calibrated if autopar calibrate "
                             "exists, else cpu), a profile name, or a JSON profile path")
    parser.add_argument("--methods", nargs="+", default=METHODS, help=f"default: {' '.join(METHODS)}")
    parser.add_argument("--skip", nargs="*", default=[], choices=["runtime", "scaling", "fidelity"])
    parser.add_argument("--timeout", type=float, default=300, help="seconds per method launch")
    parser.add_argument("--scaling-budget", type=float, default=None,
                        help="seconds for the planner-scaling section (default 360, --quick 45)")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    shape = QUICK if args.quick else FULL
    results: dict = dict(quick=args.quick, load_average_at_start=os.getloadavg(), cpus=os.cpu_count(),
                         model=shape.__dict__, methods=args.methods)
    if "runtime" not in args.skip or "fidelity" not in args.skip:
        hardware, why = resolve_hardware(args.hardware, os.path.dirname(os.path.abspath(args.json)), args.quick)
        _log(f"hardware profile for autopar's plans: {hardware} ({why})")
        profile = json.load(open(hardware)) if os.path.isfile(hardware) else hardware
        results.update(hardware=hardware, hardware_why=why, hardware_profile=profile)
    if "runtime" not in args.skip:
        ref = reference_loss(args.quick)
        runtime = run_runtime(args.methods, hardware, args.quick, args.timeout)
        results.update(reference_loss=ref, runtime=runtime)
        results["fidelity"] = fidelity_rows(runtime)
        print_runtime(runtime, shape, ref, hardware)
        print_fidelity(results["fidelity"])
    if "fidelity" not in args.skip:
        names = [n for n, _ in fidelity.PLANS if not (args.quick and n == "pp4")]  # --quick: 2 blocks
        _log(f"fidelity: {len(names)} plans, one 4-rank launch, round-robin")
        records, reference, between = fidelity.run(names, args.quick, hardware, 2 if args.quick else fidelity.ROUNDS,
                                                   os.path.dirname(os.path.abspath(args.json)))
        print()
        results["fidelity_plans"] = dict(records=records, **fidelity.report(records, reference, hardware, between,
                                                                            args.quick))
    if "scaling" not in args.skip:
        budget = args.scaling_budget if args.scaling_budget is not None else (45 if args.quick else 240)
        results["scaling"] = run_scaling(args.quick, budget, 45 if args.quick else 120)
        print_scaling(results["scaling"])
    results["total_wall_s"] = time.perf_counter() - _T0
    results["load_average_at_end"] = os.getloadavg()
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"\ntotal wall time {results['total_wall_s']:.0f} s; figures in {args.json}")


if __name__ == "__main__":
    main()
