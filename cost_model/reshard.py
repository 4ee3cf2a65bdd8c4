"""Reshard: the collectives that move a tensor from one layout to another, per mesh axis.

Axes are visited outermost first; each axis whose placement changes needs one step:

====================  ==========================  =============================
forward               collective (forward)        backward (the transposed step)
====================  ==========================  =============================
S(d) -> R             all-gather                  none: the consumer's gradient is
                                                  already whole, or the consumer's
                                                  own gradient sync makes it so
R -> S(d)             none (local slice)          all-gather of the gradient
P -> R                all-reduce                  none
P -> S(d)             reduce-scatter              all-gather of the gradient
S(d) -> S(e)          all-to-all                  all-to-all
R or S -> P           none (zero or pad locally)  none
====================  ==========================  =============================

Gradient all-reduces that come from *using* a replicated tensor in sharded work (data-parallel
weight gradients, Megatron's backward all-reduce) are priced by the planner once per tensor,
not here (see ``cost_model.problem``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from autopar.mesh import MeshSpec
from autopar.strategy import REPLICATE_CODE, Layout

from .comm import collective_s

__all__ = ["CommStep", "reshard_steps", "steps_seconds"]


@dataclass(frozen=True)
class CommStep:
    """One collective on one mesh axis. ``nbytes`` is the argument of that collective's cost
    formula in ``cost_model.comm`` (per-rank input, or per-rank gathered output for all-gather)."""

    collective: str
    axis: int
    nbytes: float


def reshard_steps(src: Layout, dst: Layout, total_bytes: float, mesh: MeshSpec, needs_grad: bool = True
                  ) -> tuple[tuple[CommStep, ...], tuple[CommStep, ...]]:
    """(forward steps, backward steps) to move a tensor of ``total_bytes`` from src to dst."""
    if src == dst:
        return (), ()
    cur = list(src.codes)
    want = dst.codes
    fwd: list[CommStep] = []
    bwd: list[CommStep] = []
    # Gathers first, then reductions, then slices: growing a tensor before cutting it again
    # would move more bytes than needed.
    order = sorted(range(mesh.ndim), key=lambda a: (cur[a] < 0, a))
    for a in order:
        s, d = cur[a], want[a]
        if s == d:
            continue
        n = mesh.sizes[a]
        local = total_bytes / math.prod(size for c, size in zip(cur, mesh.sizes) if c >= 0)
        if s >= 0 and d == REPLICATE_CODE:
            fwd.append(CommStep("all_gather", a, local * n))
        elif s == REPLICATE_CODE and d >= 0:
            if needs_grad:
                bwd.append(CommStep("all_gather", a, local))
        elif s < REPLICATE_CODE and d == REPLICATE_CODE:
            fwd.append(CommStep("all_reduce", a, local))
        elif s < REPLICATE_CODE and d >= 0:
            fwd.append(CommStep("reduce_scatter", a, local))
            if needs_grad:
                bwd.append(CommStep("all_gather", a, local))
        elif s >= 0 and d >= 0:
            fwd.append(CommStep("all_to_all", a, local))
            if needs_grad:
                bwd.append(CommStep("all_to_all", a, local))
        elif s < REPLICATE_CODE and d < REPLICATE_CODE:
            fwd.append(CommStep("all_reduce", a, local))  # a different reduce op: settle first
        # R or S -> P: free (the value is kept on one piece, zeros elsewhere)
        cur[a] = d
    return tuple(fwd), tuple(bwd)


def steps_seconds(steps: Sequence[CommStep], mesh: MeshSpec) -> float:
    return sum(collective_s(st.collective, st.nbytes, mesh.sizes[st.axis], mesh.links[st.axis]) for st in steps)
