"""The real run: a scheduling policy driving real autopar jobs as torchrun processes on CPU slots.

Each job is :mod:`elastic_worker` (the tiny GPT, data parallel, fixed global batch). The
controller keeps the simulator's view of every job (``JobState``: steps done become work done),
polls every ``poll_s``, asks the policy at arrivals, completions and every ``interval_s``, and
carries out its decisions for real the way the simulator models them: every job whose GPU count
changes is told to stop (all at once; each saves an ``autopar.checkpoint`` at its next step
boundary and exits; one still starting up has nothing to save and is terminated), the
controller waits for them, then launches the round's jobs together
with their new ``--nproc_per_node``, each resuming from its checkpoint (reshard on load). The
same jobs are then simulated with the same policy on a throughput table planned for the CPU
profile and the launch, stop and exit costs measured beforehand (``bench/schedule_real.py``),
so the simulator's job model is checked against reality.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from .jobs import Job, JobModel
from .simulator import Allocation, JobState, Policy, SchedulerError, View

__all__ = ["RealJob", "RealRun", "run_real", "read_steps"]


@dataclass(frozen=True)
class RealJob:
    job: Job  # model "gpt-tiny"; work = steps x base batch
    steps: int
    seed: int


@dataclass
class RealRun:
    jct_s: dict[int, float] = field(default_factory=dict)
    launches: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # (time, world size)
    stops: dict[int, list[float]] = field(default_factory=dict)  # seconds from a stop to the job gone
    workers: dict[int, list[dict]] = field(default_factory=dict)  # the worker's launches.jsonl records
    steps: dict[int, list[dict]] = field(default_factory=dict)
    finished_wall: dict[int, float] = field(default_factory=dict)  # time.time() the controller saw it gone
    t0_wall: float = 0.0  # time.time() at the run's start (the workers' records are in wall-clock time)
    wall_s: float = 0.0


def read_steps(job_dir: Path, name: str = "steps.jsonl") -> list[dict]:
    path = job_dir / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _launch(spec: RealJob, gpus: int, job_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
           "-m", "autopar.scheduler.elastic_worker", "--job-dir", str(job_dir), "--steps", str(spec.steps),
           "--batch", str(spec.job.base_batch), "--seed", str(spec.seed)]
    log = open(job_dir / "torchrun.log", "a", encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(proc: subprocess.Popen, job_dir: Path, timeout_s: float = 300.0) -> None:
    if proc.wait(timeout=timeout_s) != 0:
        tail = (job_dir / "torchrun.log").read_text(encoding="utf-8")[-3000:]
        raise SchedulerError(f"job in {job_dir} exited with {proc.returncode}:\n{tail}")


def run_real(specs: Sequence[RealJob], policy: Policy, model: JobModel, slots: int, workdir: str | Path,
             poll_s: float = 0.2, progress: bool = True) -> RealRun:
    """Run ``specs`` on ``slots`` CPU processes under ``policy``; JCT = finish - arrival (wall clock)."""
    workdir = Path(workdir)
    dirs = {s.job.job_id: workdir / f"job{s.job.job_id}" for s in specs}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=False)
    by_id = {s.job.job_id: s for s in specs}
    pending = sorted(specs, key=lambda s: s.job.arrival_s)
    active: dict[int, JobState] = {}
    procs: dict[int, subprocess.Popen] = {}
    started: dict[int, int] = {}
    out = RealRun()
    t0 = time.monotonic()
    out.t0_wall = time.time()
    last_round = -math.inf
    try:
        while pending or active:
            now = time.monotonic() - t0
            event = False
            while pending and pending[0].job.arrival_s <= now:
                s = pending.pop(0)
                active[s.job.job_id] = JobState(s.job)
                event = True
            for jid in list(procs):
                if procs[jid].poll() is not None:
                    _wait(procs.pop(jid), dirs[jid])
                    out.jct_s[jid] = now - by_id[jid].job.arrival_s
                    out.finished_wall[jid] = time.time()
                    active.pop(jid)
                    event = True
                    if progress:
                        print(f"[real] t={now:6.1f} s job {jid} finished", file=sys.stderr, flush=True)
            for jid, st in active.items():
                st.done_work = len(read_steps(dirs[jid])) * st.job.base_batch
            if active and (event or policy.interval_s and now - last_round >= policy.interval_s):
                last_round = now
                decisions = policy.schedule(View(now, tuple(active.values()), slots, slots, model))
                if sum(a.gpus for a in decisions.values()) > slots:
                    raise SchedulerError(f"policy {policy.name} asked for more than {slots} slots: {decisions}")
                for jid in _apply(decisions, active, procs, by_id, dirs, out, t0, progress, started):
                    out.jct_s[jid] = time.monotonic() - t0 - by_id[jid].job.arrival_s
                    out.finished_wall[jid] = time.time()
                    active.pop(jid)
            time.sleep(poll_s)
    finally:
        for proc in procs.values():
            proc.kill()
    out.wall_s = time.monotonic() - t0
    out.steps = {jid: read_steps(d) for jid, d in dirs.items()}
    out.workers = {jid: read_steps(d, "launches.jsonl") for jid, d in dirs.items()}
    return out


def _apply(decisions: dict[int, Allocation], active, procs, by_id, dirs, out: RealRun, t0: float,
           progress: bool, started: dict[int, int]) -> list[int]:
    """Carry out the decisions as the simulator models them: stop every job whose allocation
    changes (all at once), wait for them, then launch the round's jobs together. A job that has
    run a step since its launch checkpoints at its next step boundary and exits; one still
    starting up (no step since its launch: its state is its checkpoint) is terminated at once.
    ``started`` holds each job's steps done when it was launched. Returns the jobs that turned
    out finished when stopped."""
    finished = []
    changed = [jid for jid, st in active.items() if decisions.get(jid) != st.alloc]
    stopping = [jid for jid in changed if jid in procs]
    t_stop = time.monotonic()
    starting = {jid for jid in stopping if len(read_steps(dirs[jid])) == started[jid]}
    for jid in stopping:
        if jid in starting:
            procs[jid].terminate()  # torchrun takes its workers down with it
        else:
            (dirs[jid] / "stop").touch()
    for jid in stopping:
        if jid in starting and procs[jid].wait(timeout=300.0) != 0:
            procs.pop(jid)
            _truncate_steps(dirs[jid], started[jid])  # a step it began as it was told to go is lost
        else:
            _wait(procs.pop(jid), dirs[jid])
        (dirs[jid] / "stop").unlink(missing_ok=True)
        out.stops.setdefault(jid, []).append(time.monotonic() - t_stop)
    for jid in changed:
        st, new = active[jid], decisions.get(jid)
        started[jid] = len(read_steps(dirs[jid]))
        st.done_work = started[jid] * st.job.base_batch
        if st.done_work >= by_id[jid].steps * st.job.base_batch:
            finished.append(jid)  # it finished while being stopped
            continue
        st.alloc = new
        if new is None:
            continue
        if new.batch != st.job.base_batch:
            raise SchedulerError(f"the real run keeps each job's batch; policy gave job {jid} batch {new.batch}")
        procs[jid] = _launch(by_id[jid], new.gpus, dirs[jid])
        now = time.monotonic() - t0
        out.launches.setdefault(jid, []).append((now, new.gpus))
        if progress:
            print(f"[real] t={now:6.1f} s job {jid} -> {new.gpus} slots", file=sys.stderr, flush=True)
    return finished


def _truncate_steps(job_dir: Path, keep: int) -> None:
    lines = [line for line in (job_dir / "steps.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()] \
        if (job_dir / "steps.jsonl").exists() else []
    if len(lines) > keep:
        (job_dir / "steps.jsonl").write_text("".join(line + "\n" for line in lines[:keep]), encoding="utf-8")
