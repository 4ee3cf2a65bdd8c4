"""What ZeRO-3 holds beyond the shards, unit by unit, as ``runtime.fsdp`` runs it (for ``liveness``).

The runtime gathers a *unit*'s weights (a repeated block copy, else a module: ``runtime.fsdp.unit_key``)
in one flat all-gather when the forward first needs one of them, and launches the next unit's
gather at the same time (one unit ahead, as FSDP2 prefetches). In backward it gathers again the
weights some op saved (``cost_model.saved_inputs``; a recomputed block gathers in its recompute
instead, the same bytes), launching the re-gather of the unit saved before; each unit's whole
gradients are collected until the unit's last one arrives, then reduce-scattered from one flat
buffer, of which at most ``IN_FLIGHT`` are in flight. Per unit this module gives the bytes those
moments hold: the whole weights (forward gather, and the whole gradients in backward) and the
re-gathered weights, per block copy, in the order the forward first uses them.

A gather whose reshard moves the parameter on another axis first (a 2D layout's head weight:
all-gathered on one axis, then ZeRO-3-gathered on the other) reads that step's result, not the
stored shard; the saved weight is re-gathered from it in backward, so the runtime keeps it
from the forward to that re-gather (``kept_bytes``). On bench/fidelity.py's GPT under 2D, the
lm_head weight's column-gathered half (4 MiB) stayed alive through the step where the walk
counted nothing (``bench/memwhere.py``: predicted 67.8 MiB for 76.3 measured).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from autopar.mesh import MeshSpec
from autopar.strategy import Layout

from .blocks import block_of
from .fsdp_pricing import fused_gathers
from .moved_reads import new_storage
from .reshard import transitions
from .saved_inputs import saves_input

__all__ = ["GatheredUnit", "gathered_units", "gather_source_fraction", "param_unit", "IN_FLIGHT"]

IN_FLIGHT = 2  # gradient reduce-scatters in flight at once (runtime.fsdp.IN_FLIGHT)


@dataclass(frozen=True)
class GatheredUnit:
    """One ZeRO-3 unit, per copy: ``run`` is the repeated block run it is a copy of (None: a
    module of its own), ``first`` the graph position of its first use in the forward."""

    name: str
    run: str | None
    first: int
    whole_bytes: float  # gathered weights (forward), and its whole gradients in backward
    saved_bytes: float  # weights gathered again for backward (or by the recompute)
    members: int  # weights gathered in one flat all-gather
    saved_members: int
    # weights saved by a recomputed segment (selective recompute): not in the unit's re-gather,
    # gathered one by one by the recompute and held until their backward
    recompute_saved_bytes: float = 0.0
    # the moved weights a saved gather reads when not the stored shard (module doc): kept until backward
    kept_bytes: float = 0.0

    @property
    def landing_bytes(self) -> float:
        """Held when its forward gather lands (or its whole gradients are flattened for the
        reduce-scatter): the flat buffer and the weights copied out of it; one member is the
        buffer itself (``runtime.fsdp._Flat``)."""
        return self.whole_bytes * (2 if self.members > 1 else 1)

    @property
    def regather_landing_bytes(self) -> float:
        return self.saved_bytes * (2 if self.saved_members > 1 else 1)


def param_unit(node) -> str:
    """The unit of a parameter node: its block run (``blocks``: priced per copy), else its module."""
    blk = block_of(node)
    if blk is not None:
        return blk[0]
    target = str(node.target) if node.op == "get_attr" else node.name
    return ".".join(target.split(".")[:-1]) or target


def gather_source_fraction(a: Layout, b: Layout, mesh: MeshSpec) -> float:
    """The local fraction of what the ZeRO-3 gather (the last step from ``a`` to ``b``) reads
    when earlier steps moved the parameter into a new tensor (0: it reads the stored shard)."""
    steps = transitions(a, b)[:-1]
    if not any(new_storage(t, mesh) for t in steps):
        return 0.0
    codes = list(a.codes)
    for t in steps:
        codes[t.axis] = t.dst
    return 1.0 / math.prod(s for c, s in zip(codes, mesh.sizes) if c >= 0)


def gathered_units(problem, choice: dict[str, int], segment_keys: frozenset[str] = frozenset()
                   ) -> list[GatheredUnit]:
    """The ZeRO-3 units under ``choice``, in forward order (empty without ZeRO-3 parameters);
    ``segment_keys``: the decisions of recomputed segments (their saved weights come from the
    recompute, not from the unit's re-gather)."""
    mesh = problem.mesh
    pos = {}
    if problem.decisions:
        pos = {n: i for i, n in enumerate(next(iter(problem.decisions.values())).node.graph.nodes)}
    whole: dict[str, dict[str, float]] = defaultdict(dict)  # unit -> gathered tensor -> bytes (one copy)
    saved: dict[str, dict[str, float]] = defaultdict(dict)
    by_recompute: dict[str, dict[str, float]] = defaultdict(dict)
    kept: dict[str, dict[str, float]] = defaultdict(dict)
    first: dict[str, int] = {}
    runs: dict[str, str | None] = {}
    for e, a, b, _ in fused_gathers(problem, choice):
        producer = problem.decisions[e.producer]
        nbytes = e.total_bytes * b.local_fraction(mesh)
        consumer = problem.decisions[e.consumer].node
        blk = block_of(consumer)
        # a block's copies share one decision: the unit is the run, priced per copy (first copy's op)
        unit = blk[0] if blk is not None else param_unit(producer.node)
        runs[unit] = blk[0] if blk is not None else None
        first[unit] = min(first.get(unit, len(pos)), pos.get(consumer, 0))
        key = f"{e.tensor}@{b}"
        whole[unit][key] = nbytes
        target = e.targets[0] if e.targets else consumer
        if saves_input(target, e.input_index, problem.needs_grad) or any(
                saves_input(t, e.input_index, problem.needs_grad) for t in e.targets):
            (by_recompute if e.consumer in segment_keys else saved)[unit][key] = nbytes
            if e.consumer not in segment_keys:
                kept[unit][key] = e.total_bytes * gather_source_fraction(a, b, mesh)
    return sorted((GatheredUnit(u, runs[u], first[u], sum(whole[u].values()), sum(saved[u].values()),
                                len(whole[u]), len(saved[u]), sum(by_recompute[u].values()), sum(kept[u].values()))
                   for u in whole), key=lambda g: g.first)
