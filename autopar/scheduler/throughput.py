"""Job throughput from the planner: a table of predicted step times per (model, GPUs, global batch).

A cluster scheduler needs, for every job, its step time at any GPU count ``n`` and global batch
``b`` it might be given. autopar's planner predicts exactly that without running the job
(``autopar.plan(model, n, inputs)`` on the cluster's hardware profile), but a plan costs seconds,
so the scheduler reads a table built once by ``plan_table.build_table`` (``python -m
autopar.scheduler.plan_table --out table.json``) and committed as package data.

Grid and interpolation. The table holds plans at ``n`` in powers of two and, per ``n``, a few
per-GPU batch sizes ``q`` (global batch ``b = n * q``). At fixed ``n`` a step's time is affine in
``b`` while the plan's layout stays the same (compute and activation traffic grow with the batch,
weight collectives do not), so between two planned batches the step time is interpolated
linearly, and beyond the largest planned batch that fits in memory it is not extrapolated: the
configuration is infeasible. ``n`` is never interpolated: schedulers give jobs powers of two.
A job whose GPUs span nodes reads the ``spans_nodes`` rows, planned on a copy of the profile with
one device per node so every mesh axis crosses the inter-node link (a ring collective runs at the
speed of its slowest hop); jobs of more than one node's GPUs always span and are planned as such.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import AutoparError

__all__ = ["ModelProfile", "ThroughputTable", "ThroughputError", "DEFAULT_TABLE", "load_table"]

DEFAULT_TABLE = "throughput_a100-80gb.json"
# Adam/AdamW checkpoint: fp32 parameter plus two fp32 moments per parameter.
CHECKPOINT_BYTES_PER_PARAM = 12


class ThroughputError(AutoparError, ValueError):
    """A model missing from the table, or a malformed table file."""


@dataclass(frozen=True)
class ModelProfile:
    """What the scheduler knows about one model: its size and planned step times.

    ``points`` maps ``(n, spans_nodes)`` to sorted ``(global_batch, step_seconds)`` pairs of the
    plans that fit in memory.
    """

    name: str
    params: int
    per_gpu_batch: int
    points: dict[tuple[int, bool], tuple[tuple[int, float], ...]]

    @property
    def checkpoint_bytes(self) -> float:
        return float(self.params * CHECKPOINT_BYTES_PER_PARAM)

    def gpu_counts(self) -> list[int]:
        return sorted({n for n, _ in self.points})

    def max_batch(self, n: int, spans_nodes: bool = False) -> int:
        pts = self.points.get((n, spans_nodes or n > 8), ())
        return pts[-1][0] if pts else 0

    def step_seconds(self, n: int, global_batch: float, spans_nodes: bool = False) -> float:
        """Predicted seconds per step; ``inf`` where no plan fits (batch too large or n unplanned)."""
        pts = self.points.get((n, spans_nodes)) or self.points.get((n, not spans_nodes and n > 1))
        if not pts or global_batch > pts[-1][0] or global_batch < n:
            return math.inf
        batches = [b for b, _ in pts]
        i = bisect.bisect_left(batches, global_batch)
        if i < len(pts) and batches[i] == global_batch:
            return pts[i][1]
        if i == 0:  # below the smallest planned batch: the first segment's line (or a floor of it)
            if len(pts) == 1:
                return pts[0][1]
            (b0, t0), (b1, t1) = pts[0], pts[1]
        else:
            (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        t = t0 + (t1 - t0) * (global_batch - b0) / (b1 - b0)
        return max(t, 1e-9)

    def samples_per_second(self, n: int, global_batch: float, spans_nodes: bool = False) -> float:
        t = self.step_seconds(n, global_batch, spans_nodes)
        return 0.0 if math.isinf(t) else global_batch / t


@dataclass(frozen=True)
class ThroughputTable:
    """Model profiles on one hardware profile, plus how many plans the table holds."""

    hardware: str
    devices_per_node: int
    models: dict[str, ModelProfile]
    n_plans: int
    host_link_bytes_per_s: float

    def model(self, name: str) -> ModelProfile:
        try:
            return self.models[name]
        except KeyError:
            raise ThroughputError(f"model {name!r} is not in the throughput table ({', '.join(self.models)}); "
                                  f"add it with python -m autopar.scheduler.plan_table --models ...") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ThroughputTable":
        try:
            models = {}
            for name, m in data["models"].items():
                groups: dict[tuple[int, bool], list[tuple[int, float]]] = {}
                for p in m["points"]:
                    if p["step_seconds"] is not None:
                        groups.setdefault((int(p["n"]), bool(p["spans_nodes"])), []).append(
                            (int(p["batch"]), float(p["step_seconds"])))
                models[name] = ModelProfile(name, int(m["params"]), int(m["per_gpu_batch"]),
                                            {k: tuple(sorted(v)) for k, v in groups.items()})
            n_plans = sum(len(m["points"]) for m in data["models"].values())
            return cls(data["hardware"], int(data["devices_per_node"]), models, n_plans,
                       float(data["host_link_bytes_per_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ThroughputError(f"malformed throughput table: {exc!r}; regenerate it with "
                                  f"python -m autopar.scheduler.plan_table") from exc


def load_table(path: str | Path | None = None) -> ThroughputTable:
    """The committed table (package data) or one written by :func:`build_table`."""
    if path is None:
        text = resources.files("autopar.scheduler").joinpath("data", DEFAULT_TABLE).read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ThroughputError(f"cannot read throughput table {str(path)!r}: {exc.strerror}") from exc
    return ThroughputTable.from_dict(json.loads(text))
