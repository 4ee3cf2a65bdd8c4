"""Hand-made throughput tables and jobs for the scheduler tests (no planning needed)."""

from __future__ import annotations

from autopar.scheduler import Job, JobModel, NoiseScaleEfficiency, ThroughputTable


def table(step_fns: dict, gpus=(1, 2, 4, 8, 16), batches=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
          params: int = 1_000_000) -> ThroughputTable:
    """A table whose step seconds are ``step_fns[model](n, batch)`` at every planned point."""
    models = {}
    for name, fn in step_fns.items():
        points = [{"n": n, "batch": b, "spans_nodes": n > 8 or spans, "step_seconds": fn(n, b)}
                  for n in gpus for spans in ((False, True) if 1 < n <= 8 else (False,)) for b in batches if b >= n]
        models[name] = {"params": params, "per_gpu_batch": 8, "points": points}
    return ThroughputTable.from_dict({"hardware": "test", "devices_per_node": 8, "host_link_bytes_per_s": 1e9,
                                      "models": models})


def linear(n: int, b: int) -> float:
    """Perfect scaling: 10 ms per sample, split over the GPUs."""
    return 0.01 * b / n


def flat(n: int, b: int) -> float:
    """No speed-up from more GPUs at a fixed batch (communication eats it)."""
    return 0.01 * b


def job_model(fns=None, restart_s: float = 0.0, noise_scale_ratio: float = 1e9) -> JobModel:
    return JobModel(table(fns or {"lin": linear, "flat": flat}), NoiseScaleEfficiency(noise_scale_ratio), restart_s)


def job(job_id: int, arrival_s: float, seconds_alone: float, gpus: int = 1, model: str = "lin",
        per_gpu: int = 8, max_gpus: int | None = None, batch_cap: int = 8) -> Job:
    """A job that runs ``seconds_alone`` at its requested size under :func:`linear` scaling."""
    base = per_gpu * gpus
    rate = base / (0.01 * base / gpus) if model == "lin" else base / (0.01 * base)
    return Job(job_id, model, arrival_s, seconds_alone * rate, gpus, base,
               max_gpus if max_gpus is not None else 8 * gpus, base * batch_cap, seconds_alone)
