"""The scheduler driving real autopar jobs: tiny-GPT jobs as torchrun processes on CPU slots.

    OMP_NUM_THREADS=1 python bench/schedule_real.py [--slots 4] [--steps 120,80,60] [--arrivals 0,0,20]

1. Plans the tiny GPT at 1, 2 and 4 ranks on the CPU profile (``--hardware``, default the
   built-in ``cpu``; pass ``autopar calibrate``'s JSON for the calibrated one): the job model's table.
2. Measures the restart overhead: one launch of a job on all slots, from process start to its
   first step (CPU slots share the cores, so a launch costs more when several ranks start at once).
3. Runs the jobs for real under Optimus (GPU counts change, each job's global batch does not),
   resizing through the checkpoint path of ``autopar.scheduler.job_checkpoint``.
4. Simulates the same jobs with the same policy on the table and the measured overhead.
5. Checks every job's loss trajectory against the same job trained alone in one process, and
   prints real vs simulated JCT per job. Results: ``bench/results/schedule_real.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autopar.scheduler.elastic_worker import build, make_batch
from autopar.scheduler.jobs import Job, JobModel
from autopar.scheduler.optimus import Optimus
from autopar.scheduler.plan_table import build_table
from autopar.scheduler.real_run import RealJob, read_steps, run_real
from autopar.scheduler.simulator import simulate
from autopar.scheduler.throughput import ThroughputTable


def alone_losses(seed: int, steps: int, batch: int, lr: float = 1e-3) -> list[float]:
    """The job trained in this process, unparallelized: the reference trajectory."""
    model = build(seed, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for step in range(steps):
        loss = model(*make_batch(seed, step, batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def measure_restart(workdir: Path, batch: int, ranks: int) -> tuple[float, float]:
    """Seconds from launching a job on ``ranks`` processes to its first step, and its median step
    seconds after that. CPU slots share the cores, so a launch's cost (every rank imports torch,
    traces and plans) grows with how many ranks start at once; the probe starts as many as the
    run has slots, as a round that (re)starts several jobs does."""
    d = workdir / "restart_probe"
    d.mkdir()
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m",
                    "autopar.scheduler.elastic_worker", "--job-dir", str(d), "--steps", "12", "--batch", str(batch)],
                   check=True, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    steps = read_steps(d)
    gaps = sorted(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
    step_s = gaps[len(gaps) // 2]
    return steps[0]["t"] - t0 - step_s, step_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--steps", default="120,80,60")
    ap.add_argument("--arrivals", default="0,0,20")
    ap.add_argument("--requested", default="2,1,1")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--interval", type=float, default=30.0)
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--out", default="bench/results/schedule_real.json")
    args = ap.parse_args()
    steps = [int(x) for x in args.steps.split(",")]
    arrivals = [float(x) for x in args.arrivals.split(",")]
    requested = [int(x) for x in args.requested.split(",")]
    b = args.batch
    t_start = time.perf_counter()
    raw = build_table(["gpt-tiny"], [1, 2, 4], [b // 4, b // 2, b], args.hardware, seq_len=32, progress=False)
    table = ThroughputTable.from_dict(raw)
    with tempfile.TemporaryDirectory() as tmp:
        restart_s, step_s = measure_restart(Path(tmp), b, args.slots)
        print(f"measured: launch to first step {restart_s:.1f} s, step {step_s * 1e3:.1f} ms at {args.slots} ranks; "
              f"planned step at {args.slots} ranks {table.model('gpt-tiny').step_seconds(args.slots, b) * 1e3:.2f} ms",
              flush=True)
        model = JobModel(table, restart_overhead_s=restart_s)
        jobs = [Job(i, "gpt-tiny", arrivals[i], float(steps[i] * b), requested[i], b, args.slots, b)
                for i in range(len(steps))]
        specs = [RealJob(j, steps[j.job_id], seed=j.job_id) for j in jobs]
        real = run_real(specs, Optimus(interval_s=args.interval), model, args.slots, Path(tmp) / "run")
    sim = simulate(jobs, Optimus(interval_s=args.interval), model, args.slots, devices_per_node=args.slots)
    rows = []
    for j in jobs:
        ref = alone_losses(j.job_id, steps[j.job_id], b)
        got = [s["loss"] for s in real.steps[j.job_id]]
        worlds = sorted({s["world"] for s in real.steps[j.job_id]})
        diff = max(abs(x - y) for x, y in zip(got, ref)) if len(got) == len(ref) else float("inf")
        rows.append({"job": j.job_id, "steps": len(got), "worlds": worlds, "launches": real.launches[j.job_id],
                     "max_loss_diff_vs_alone": diff, "real_jct_s": real.jct_s[j.job_id],
                     "sim_jct_s": sim.jct_s[j.job_id], "ratio": sim.jct_s[j.job_id] / real.jct_s[j.job_id]})
        print(f"job {j.job_id}: {len(got)} steps on world sizes {worlds}, {len(real.launches[j.job_id])} launches, "
              f"max |loss - alone| {diff:.2e}; JCT real {real.jct_s[j.job_id]:.1f} s, simulated "
              f"{sim.jct_s[j.job_id]:.1f} s ({100 * (sim.jct_s[j.job_id] / real.jct_s[j.job_id] - 1):+.0f}%)")
    result = {"restart_s": restart_s, "step_s_measured": step_s, "hardware": args.hardware, "jobs": rows,
              "wall_s": time.perf_counter() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"written {args.out} ({result['wall_s']:.0f} s)")
    ok = all(r["max_loss_diff_vs_alone"] < 1e-4 and abs(r["ratio"] - 1) <= 0.25 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
