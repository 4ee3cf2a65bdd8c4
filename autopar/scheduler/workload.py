"""Workloads sampled from the Philly trace (Jeon et al., ATC'19; see ``data/README.md``).

A workload keeps each sampled job's arrival time, GPU request and duration from the trace and
gives it a zoo model by its GPU-time bucket (``MODEL_BUCKETS``: short jobs are small models,
long ones large). Its work is set so that, alone at its requested size (GPUs rounded down to a
power of two, per-GPU batch 8 or the largest that fits), it runs for its trace duration:
``work = duration * goodput(requested GPUs, base batch)``. Jobs shorter than ``min_duration_s``
are dropped (they would measure restart overheads, not scheduling) and durations are clamped to
``max_duration_s`` (the trace's tail runs for weeks).

Sampling is deterministic per seed: the seed picks a window of ``window_hours`` that holds
enough jobs, and ``n_jobs`` jobs are drawn from it without replacement (Pollux's simulator
samples its workloads the same way).
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import random
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Sequence

from ..errors import AutoparError
from .jobs import Job, JobModel, pow2_floor

__all__ = ["TraceJob", "WorkloadError", "load_trace", "sample_workload", "MODEL_BUCKETS", "DEFAULT_TRACE"]

DEFAULT_TRACE = "philly_2017-10.csv.gz"
# (upper GPU-hours bound, model): the first bucket whose bound exceeds a job's GPU time
MODEL_BUCKETS: tuple[tuple[float, str], ...] = ((1.0, "vit-base"), (10.0, "bert-base"), (float("inf"), "gpt2"))


class WorkloadError(AutoparError, ValueError):
    """An unreadable trace, or a sample the trace cannot provide."""


@dataclass(frozen=True)
class TraceJob:
    submit_s: float  # seconds since the trace's first submission
    duration_s: float
    gpus: int


def load_trace(path: str | Path | None = None) -> list[TraceJob]:
    """The trace's jobs by submission time (the shipped October 2017 slice by default)."""
    try:
        if path is None:
            raw = resources.files("autopar.scheduler").joinpath("data", DEFAULT_TRACE).read_bytes()
        else:
            raw = Path(path).read_bytes()
        text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
        rows = list(csv.DictReader(io.StringIO(text)))
        stamps = [datetime.fromisoformat(r["timestamp"]) for r in rows]
        t0 = min(stamps)
        jobs = [TraceJob((s - t0).total_seconds(), float(r["duration"]), int(float(r["num_gpus"])))
                for s, r in zip(stamps, rows)]
    except (OSError, KeyError, ValueError) as exc:
        raise WorkloadError(f"cannot read trace {str(path or DEFAULT_TRACE)!r}: {exc}; it needs the columns "
                            f"timestamp, duration, num_gpus (the Philly CSV format)") from exc
    if not jobs:
        raise WorkloadError(f"trace {str(path)!r} has no jobs")
    return sorted(jobs, key=lambda j: j.submit_s)


def model_for(gpu_hours: float) -> str:
    return next(name for bound, name in MODEL_BUCKETS if gpu_hours < bound)


def sample_workload(trace: Sequence[TraceJob], n_jobs: int, total_gpus: int, model: JobModel, seed: int = 0,
                    window_hours: float = 8.0, min_duration_s: float = 60.0, max_duration_s: float = 86400.0,
                    elastic_gpus: int = 8, batch_cap: int = 8) -> list[Job]:
    """``n_jobs`` jobs from one ``window_hours`` window of the trace; arrivals start at 0.

    ``elastic_gpus``/``batch_cap``: a job may grow to that many times its requested GPUs and
    base batch (ONES's and Optimus's elastic range).
    """
    if n_jobs < 1:
        raise WorkloadError(f"a workload needs at least one job, got n_jobs={n_jobs}; e.g. --jobs 100")
    usable = [j for j in trace if j.duration_s >= min_duration_s and 1 <= j.gpus <= total_gpus]
    window_s = window_hours * 3600.0
    rng = random.Random(seed)
    submits = [j.submit_s for j in usable]
    starts = list(range(len(usable)))
    rng.shuffle(starts)
    for s in starts:  # the first window (in the seed's order of start jobs) that holds n_jobs
        end = bisect.bisect_left(submits, submits[s] + window_s)
        if end - s >= n_jobs:
            window = usable[s:end]
            break
    else:
        raise WorkloadError(f"no {window_hours:g}-hour window of the trace holds {n_jobs} usable jobs; "
                            f"ask for fewer jobs or a longer --window")
    picked = sorted(rng.sample(window, n_jobs), key=lambda j: (j.submit_s, j.duration_s))
    return [_job(i, tj, tj.submit_s - picked[0].submit_s, total_gpus, model, min(tj.duration_s, max_duration_s),
                 elastic_gpus, batch_cap) for i, tj in enumerate(picked)]


def _job(job_id: int, tj: TraceJob, arrival_s: float, total_gpus: int, model: JobModel, duration_s: float,
         elastic_gpus: int, batch_cap: int) -> Job:
    gpus = min(pow2_floor(tj.gpus), total_gpus)
    name = model_for(tj.gpus * tj.duration_s / 3600.0)
    profile = model.table.model(name)
    per_gpu = profile.per_gpu_batch
    while per_gpu > 1 and profile.samples_per_second(gpus, gpus * per_gpu, model.spans(gpus)) <= 0:
        per_gpu //= 2
    base = gpus * per_gpu
    probe = Job(job_id, name, arrival_s, 1.0, gpus, base, min(total_gpus, gpus * elastic_gpus), base * batch_cap)
    rate = model.goodput(probe, gpus, base)
    if rate <= 0:
        raise WorkloadError(f"trace job {job_id} ({name} on {gpus} GPUs) fits at no batch size in the throughput "
                            f"table; add smaller per-GPU batches to the table")
    return Job(job_id, name, arrival_s, duration_s * rate, gpus, base, probe.max_gpus, probe.max_batch, duration_s)
