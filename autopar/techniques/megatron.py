"""Megatron 1D tensor parallelism (arXiv 1909.08053) and its sequence parallelism (Megatron-SP,
arXiv 2205.05198).

Every weight matrix split on a ``tp`` axis (column or row parallel), inputs whole there; layer
norms on whole activations (``megatron``) or sequence-split ones (``megatron-sp``: the
all-reduce becomes reduce-scatter + all-gather around each tensor-parallel region); with a
``dp`` axis outside (``megatron-dp``). Its collectives are reshards and gradient syncs the cost
model prices already; this file offers the families.
"""

from __future__ import annotations

from .base import Family, Technique, register
from .pins import ClassicPin

__all__ = ["MEGATRON"]


def _tp(sp: bool):
    return lambda n, hw: [(hw.mesh_spec(("tp",), (n,)), ClassicPin((), (0,), False, sp))]


def _tp_dp(n: int, hw) -> list:
    return [(hw.mesh_spec(("dp", "tp"), (n // tp, tp)), ClassicPin((0,), (1,), False, False))
            for tp in (2, 4, 8) if n % tp == 0 and n // tp > 1 and tp <= hw.devices_per_node]


MEGATRON = register(Technique(
    name="megatron",
    title="1D tensor parallel (Megatron: each weight matrix split on one axis)",
    families=(
        Family("megatron", "Megatron 1D tensor parallel on tp", _tp(False), rank=20),
        Family("megatron-sp", "Megatron 1D tensor parallel with sequence parallelism", _tp(True), rank=21),
        Family("megatron-dp", "Megatron tensor parallel x data parallel", _tp_dp, rank=22),
    ),
))
