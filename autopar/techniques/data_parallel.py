"""Data parallel and ZeRO (DDP, DeepSpeed ZeRO-2, FSDP/ZeRO-3) on one ``dp`` axis.

Inputs batch-split, weights whole in use; gradients all-reduced (DDP), reduce-scattered with
gradients and optimizer state split (ZeRO-2, ``runtime.collectives.zero2_*``), or weights stored
split and gathered for use (ZeRO-3, ``runtime.fsdp``). The cost model prices all three already
(parameter options with ZeRO axes); this file offers them as families, priced beside every auto
plan as baselines.
"""

from __future__ import annotations

from .base import Family, Technique, register
from .pins import ClassicPin

__all__ = ["DATA_PARALLEL"]


def _dp(**kw):
    return lambda n, hw: [(hw.mesh_spec(("dp",), (n,)), ClassicPin((0,), (), **kw))]


DATA_PARALLEL = register(Technique(
    name="data_parallel",
    title="data parallel (weights whole on every device in use)",
    families=(
        Family("dp", "data parallel (DDP): gradients all-reduced", _dp(), rank=10),
        Family("zero2", "ZeRO-2: gradients and optimizer state split over dp", _dp(zero2=True), rank=11),
        Family("zero3", "ZeRO-3 / FSDP: weights stored split, gathered for use", _dp(zero3=True), rank=12),
    ),
))
