"""Save and load an elastic job's state at a resize point, on the project's sharded checkpoints.

A resize is ``autopar.checkpoint.save`` at the old world size (every rank writes its own pieces
of the model and the optimizer state, DCP format, with the next step as ``extra``) and, after the
relaunch, ``autopar.resize.resize`` at the new one (reshard on load: each rank reads the chunks
that overlap its pieces, whatever plan or world size wrote them). Both return what they cost, so
the real run can calibrate the simulator's migration model from measured figures.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..checkpoint import MANIFEST, save
from ..resize import resize

__all__ = ["save_job_state", "load_job_state", "has_job_state"]


def has_job_state(path: str | Path) -> bool:
    """A complete checkpoint is there (its manifest is written last)."""
    return (Path(path) / MANIFEST).exists()


def save_job_state(path: str | Path, model, optimizer: torch.optim.Optimizer, step: int) -> float:
    """Every rank calls it; returns the seconds the save took on this rank."""
    t0 = time.perf_counter()
    save(path, model, optimizer, extra={"step": int(step)})
    return time.perf_counter() - t0


def load_job_state(path: str | Path, model, optimizer: torch.optim.Optimizer) -> tuple[int, float, int]:
    """Load what :func:`save_job_state` wrote (at any world size; every rank calls it). Returns
    the next step to run, the load's seconds and the bytes the busiest rank read."""
    extra, cost = resize(path, model, optimizer)
    return int(extra["step"]), cost.seconds, max(cost.bytes_read_per_rank)
