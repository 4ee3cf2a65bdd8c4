"""The scheduler driving real autopar jobs: tiny-GPT jobs as torchrun processes on CPU slots,
against the simulator's prediction for the same jobs with costs measured beforehand.

    OMP_NUM_THREADS=1 python bench/schedule_real.py [--slots 4] [--steps auto|S0,S1,S2] [--arrivals 0,0,0]
                                                     [--hardware calibrate|PROFILE.json|cpu]

1. The CPU profile: ``autopar calibrate --quick`` on ``--slots`` ranks (or ``--hardware PATH``),
   and the tiny GPT planned data parallel (the workers' strategy) at 1, 2 and 4 ranks on it: the
   job model's step times.
2. Calibration probes (one job, nothing else of ours running), before and independent of the run:
   a launch on 1 rank stopped after 10 steps, a relaunch on ``--slots`` ranks from the checkpoint
   stopped after 10 more, a relaunch on 2 ranks run to the end. They measure, per launch, the
   seconds from ``Popen`` to the first step (a line through the three, against the processes
   alive -- the probe's ranks and its launcher -- gives the restart overhead and its part per
   process: CPU slots share the cores), the
   seconds from a stop to the processes being gone (half a step to reach the step boundary,
   the ``autopar.checkpoint`` save, the exit), and from the last step to the processes gone.
   The controller's poll (``poll_s``) adds half a poll on average to noticing an exit.
3. Runs the jobs for real under Optimus with rounds at arrivals and completions only (GPU counts
   change, each job's global batch does not), resizing through ``autopar.scheduler.job_checkpoint``
   (DCP save, reshard on load). The default workload makes a resize happen with margins against
   timing noise: three jobs arrive at once on 4 slots; Optimus gives the long job 0 two slots and
   jobs 1 and 2 one each; short job 1 finishes first and job 2 grows from 1 slot to 2 (both
   remaining jobs gain from a second slot, so this does not hinge on who has more work left).
   Each job's elastic range is 1-2 slots (``--max-slots``): on 2 cores a job on 4 ranks
   oversubscribes them (the probes measure its steps at 2-4x the plan's).
   ``--steps auto`` sizes the jobs from the measured costs and the planned step times so that
   each job's work is short next to a launch (``auto_steps``) -- on
   CPU slots the planner's step times are the least reliable figure (the run prints measured
   against planned).
4. Simulates the same jobs with the same policy on the planned table and the measured costs,
   the slots sharing the profile's ``shared_cores`` (a job's steps slow down while more ranks
   than cores train at once: ``JobModel.contention``; calibrated, not fitted to the run) (and, for diagnosis, on the probes' measured step times instead of the planned ones).
5. Checks every job's loss trajectory against the same job trained alone in one process, and
   prints real vs simulated JCT per job. Results: ``bench/results/schedule_real.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autopar.cost_model.hardware import get_hardware
from autopar.scheduler.elastic_worker import build, make_batch
from autopar.scheduler.jobs import Job, JobModel
from autopar.scheduler.optimus import Optimus
from autopar.scheduler.plan_table import build_table
from autopar.scheduler.real_run import RealJob, read_steps, run_real
from autopar.scheduler.simulator import simulate
from autopar.scheduler.throughput import ThroughputTable

ENV = dict(os.environ, OMP_NUM_THREADS="1")


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


def _probe_launch(d: Path, ranks: int, steps: int, batch: int, pause_at: int | None) -> dict:
    """One launch of the worker; the worker's own record plus when it was started and gone."""
    n_before = len(read_steps(d))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m",
           "autopar.scheduler.elastic_worker", "--job-dir", str(d), "--steps", str(steps), "--batch", str(batch)]
    t_popen = time.time()
    subprocess.run(cmd + (["--pause-at", str(pause_at)] if pause_at else []), check=True, capture_output=True,
                   env=ENV)
    t_gone = time.time()
    rec = read_steps(d, "launches.jsonl")[-1]
    mine = read_steps(d)[n_before:]
    gaps = sorted(b["t"] - a["t"] for a, b in zip(mine, mine[1:]))
    step_s = gaps[len(gaps) // 2]
    out = {"ranks": ranks, "launch_s": rec["t_ready"] - t_popen, "step_s": step_s, "load_s": rec["load_s"],
           "save_s": rec["save_s"]}
    if "t_stop_seen" in rec:
        out["stop_s"] = step_s / 2 + t_gone - rec["t_stop_seen"]
    else:
        out["exit_s"] = t_gone - mine[-1]["t"]
    return out


def measure_costs(workdir: Path, batch: int, slots: int, poll_s: float) -> dict:
    """The probes of step 2 and the costs fitted to them (least squares: launch = a + b x ranks)."""
    d = workdir / "probe"
    d.mkdir()
    probes = [_probe_launch(d, 1, 40, batch, 10), _probe_launch(d, slots, 40, batch, 20),
              _probe_launch(d, 2, 40, batch, None)]
    ks = [p["ranks"] + 1 for p in probes]  # its ranks and its launcher
    ls = [p["launch_s"] for p in probes]
    fit = statistics.linear_regression(ks, ls)
    per_proc = max(fit.slope, 0.0)
    base = max(statistics.fmean(ls) - per_proc * statistics.fmean(ks), 0.0)
    return {"probes": probes, "restart_overhead_s": base, "launch_s_per_process": per_proc,
            "stop_s": statistics.fmean(p["stop_s"] for p in probes if "stop_s" in p),
            "exit_s": probes[-1]["exit_s"] + poll_s / 2, "step_s": {p["ranks"]: p["step_s"] for p in probes}}


def measured_table(planned: ThroughputTable, step_s: dict[int, float], batch: int) -> ThroughputTable:
    """The planned table with the probes' measured step times at ``batch`` (diagnosis only)."""
    prof = planned.model("gpt-tiny")
    pts = [{"n": n, "batch": batch, "spans_nodes": False, "step_seconds": t} for n, t in sorted(step_s.items())]
    return ThroughputTable.from_dict({"hardware": "measured", "devices_per_node": planned.devices_per_node,
                                      "host_link_bytes_per_s": planned.host_link_bytes_per_s,
                                      "models": {"gpt-tiny": {"params": prof.params, "per_gpu_batch": batch,
                                                              "points": pts}}})


def hardware_profile(arg: str, slots: int, tmp: Path) -> str:
    if arg != "calibrate":
        return arg
    out = tmp / "hw.json"
    subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--quick", "--nproc", str(slots), "--out",
                    str(out), "--quiet"], check=True, capture_output=True, env=ENV)
    return str(out)


class Recorder:
    """Wraps the policy: every round's time and the GPU counts it decided (sim and real alike)."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.interval_s, self.rounds = inner, inner.name, inner.interval_s, []

    def schedule(self, view):
        out = self.inner.schedule(view)
        self.rounds.append((round(view.now, 1), {jid: a.gpus for jid, a in sorted(out.items())}))
        return out


def resizes(rounds: list) -> list:
    """The distinct allocations in order (who holds how many slots), times dropped."""
    out = []
    for _, alloc in rounds:
        if not out or out[-1] != alloc:
            out.append(alloc)
    return out


def auto_steps(model: JobModel, batch: int) -> list[int]:
    """Steps for jobs 0, 1, 2 of the default workload, from the measured costs and planned steps.

    Job 1 (1 slot) works a twentieth of the first launch (7 processes: 4 ranks and 3 launchers)
    and finishes first. Job 2 (1 slot) has 1.5x the work it does at 1 slot until job 1 is gone
    (job 1's work and an exit), so it is still training when it grows to 2 slots even if its real
    steps are faster than planned. Job 0 (2 slots) has more steps than job 2 (so Optimus gives it
    the spare slot at the start) and at least job 1's work and 1.25 exits (so it is still
    training when job 1 is gone). Every job's work stays short next to a launch: on shared CPU
    cores the planned step times are the model's weakest figure."""
    prof = model.table.model("gpt-tiny")
    t1, t2 = prof.step_seconds(1, batch), prof.step_seconds(2, batch)
    s1 = max(10, round(model.launch_seconds(7) / 20 / t1))
    s2 = max(round(1.5 * (s1 * t1 + model.exit_s) / t1), s1 + 1)
    return [max(round((s1 * t1 + 1.25 * model.exit_s) / t2), s2 + 1), s1, s2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--steps", default="auto", help="'auto' (sized from the measured costs) or S0,S1,S2")
    ap.add_argument("--arrivals", default="0,0,0")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-slots", type=int, default=2, help="each job's elastic range is 1..max-slots (on 2 "
                    "cores, 4 ranks of one job oversubscribe them)")
    ap.add_argument("--interval", type=float, default=0.0, help="periodic rounds (s); 0: arrivals and "
                    "completions only")
    ap.add_argument("--poll", type=float, default=0.2)
    ap.add_argument("--hardware", default="calibrate", help="'calibrate' (run autopar calibrate --quick), a "
                    "profile JSON, or a built-in profile name")
    ap.add_argument("--out", default="bench/results/schedule_real.json")
    args = ap.parse_args()
    arrivals = [float(x) for x in args.arrivals.split(",")]
    b = args.batch
    interval = args.interval or None
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        hw = hardware_profile(args.hardware, args.slots, Path(tmp))
        raw = build_table(["gpt-tiny"], [1, 2, 4], [b // 4, b // 2, b], hw, seq_len=32, progress=False,
                          strategy="dp")
        table = ThroughputTable.from_dict(raw)
        costs = measure_costs(Path(tmp), b, args.slots, args.poll)
        planned = {n: table.model("gpt-tiny").step_seconds(n, b) for n in costs["step_s"]}
        print(f"measured: launch {costs['restart_overhead_s']:.1f} s + "
              f"{costs['launch_s_per_process']:.1f} s per process "
              f"alive; stop {costs['stop_s']:.1f} s; exit {costs['exit_s']:.1f} s; step ms (measured/planned) "
              + ", ".join(f"{n} ranks {costs['step_s'][n] * 1e3:.0f}/{planned[n] * 1e3:.0f}"
                          for n in sorted(planned)), flush=True)
        kw = {k: costs[k] for k in ("restart_overhead_s", "launch_s_per_process", "stop_s", "exit_s")}
        kw["shared_cores"] = get_hardware(hw).shared_cores  # calibrated: the cores all the slots share
        model = JobModel(table, **kw)
        steps = auto_steps(model, b) if args.steps == "auto" else [int(x) for x in args.steps.split(",")]
        print(f"steps {steps}, arrivals {arrivals}", flush=True)
        jobs = [Job(i, "gpt-tiny", arrivals[i], float(steps[i] * b), 1, b, args.max_slots, b)
                for i in range(len(steps))]
        specs = [RealJob(j, steps[j.job_id], seed=j.job_id) for j in jobs]
        load_before = os.getloadavg()[0]
        real_policy = Recorder(Optimus(interval_s=interval))
        real = run_real(specs, real_policy, model, args.slots, Path(tmp) / "run", poll_s=args.poll)
        load_after = os.getloadavg()[0]
    sim_policy = Recorder(Optimus(interval_s=interval))
    sim = simulate(jobs, sim_policy, model, args.slots, devices_per_node=args.slots)
    sim_m = simulate(jobs, Optimus(interval_s=interval), JobModel(measured_table(table, costs["step_s"], b), **kw),
                     args.slots, devices_per_node=args.slots)
    same = resizes(real_policy.rounds) == resizes(sim_policy.rounds)
    print(f"allocations (job: slots) real {resizes(real_policy.rounds)}\n"
          f"                  simulated {resizes(sim_policy.rounds)} ({'the same' if same else 'DIFFERENT'})")
    rows = []
    for j in jobs:
        jid = j.job_id
        ref = alone_losses(jid, steps[jid], b)
        got = [s["loss"] for s in real.steps[jid]]
        worlds = [s["world"] for s in real.steps[jid]]
        sizes = list(dict.fromkeys(worlds))  # in the order they ran
        diff = max(abs(x - y) for x, y in zip(got, ref)) if len(got) == len(ref) else float("inf")
        err = sim.jct_s[jid] / real.jct_s[jid] - 1
        rows.append({"job": jid, "steps": len(got), "world_sizes": sizes,
                     "launches": real.launches[jid], "stops_s": real.stops.get(jid, []),
                     "worker_records": real.workers[jid], "max_loss_diff_vs_alone": diff,
                     "real_jct_s": real.jct_s[jid], "sim_jct_s": sim.jct_s[jid], "sim_error": err,
                     "sim_measured_steps_jct_s": sim_m.jct_s[jid]})
        print(f"job {jid}: {len(got)} steps on world sizes {sizes}, {len(real.launches[jid])} launches, "
              f"max |loss - alone| {diff:.2e}; JCT real {real.jct_s[jid]:.1f} s, simulated {sim.jct_s[jid]:.1f} s "
              f"({100 * err:+.0f}%; {sim_m.jct_s[jid]:.1f} s with measured step times)")
    result = {"hardware": args.hardware, "costs": costs, "planned_step_s": planned, "steps": steps,
              "arrivals": arrivals, "real_rounds": real_policy.rounds, "sim_rounds": sim_policy.rounds,
              "same_allocations": same, "jobs": rows, "t0_wall": real.t0_wall, "finished_wall": real.finished_wall,
              "loadavg_before_after": [load_before, load_after], "wall_s": time.perf_counter() - t_start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    resized = [r["job"] for r in rows if len(r["world_sizes"]) > 1]
    print(f"jobs resized through their checkpoint: {resized or 'none'}")
    print(f"written {args.out} ({result['wall_s']:.0f} s; load average {load_before:.0f} -> {load_after:.0f})")
    ok = resized and all(r["max_loss_diff_vs_alone"] < 1e-4 and abs(r["sim_error"]) <= 0.25 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
