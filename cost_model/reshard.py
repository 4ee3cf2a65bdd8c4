"""Reshard: the steps that move a tensor from one layout to another, per mesh axis.

:func:`transitions` is the single source of truth: the cost model prices its steps and the
lowering (``passes.lower``) emits exactly them, so predicted bytes equal the bytes sent.

A layout's local piece is canonical when a dim cut by several axes is cut outermost axis
first (DTensor's convention). Steps keep every intermediate canonical:

1. gathers, innermost axis first (an outer axis of a dim is gathered only after the inner
   axes of that dim; an axis that only moves its cut to another dim uses one all-to-all);
2. reductions: ``P -> R`` all-reduce, ``P -> S(d)`` reduce-scatter;
3. slices, outermost axis first; an inner axis already cutting the same dim is gathered in
   step 1 and cut again here (a local slice cannot reorder pieces);
4. to-partial: ``R -> P`` keeps the value on one piece (zeros elsewhere), free.

====================  =======================  =============================================
step                  forward                  backward (the transposed step)
====================  =======================  =============================================
all_gather  S -> R    all-gather               none: the gradient arriving is whole on the
                                               axis (replicated consumer work, or the
                                               consumer's own gradient sync made it so)
slice       R -> S    none (local slice)       all-gather of the gradient
all_reduce  P -> R    all-reduce               none (sum) / scale by 1/n (avg)
reduce_scatter P -> S reduce-scatter           all-gather of the gradient
all_to_all  S -> S'   all-to-all               all-to-all
to_partial  R -> P    none                     none
====================  =======================  =============================================

Gradient all-reduces that come from *using* a replicated tensor in sharded work (data-parallel
weight gradients, Megatron's backward all-reduce) are priced per tensor by
``cost_model.problem`` and emitted by the lowering as ``grad_sync`` steps.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from autopar.mesh import MeshSpec
from autopar.strategy import REPLICATE_CODE, Layout

from .comm import collective_s

__all__ = ["CommStep", "Transition", "transitions", "reshard_steps", "reshard_seconds", "reshard_latency_s",
           "steps_seconds"]


@dataclass(frozen=True)
class CommStep:
    """One collective on one mesh axis. ``nbytes`` is the argument of that collective's cost
    formula in ``cost_model.comm`` (per-rank input, or per-rank gathered output for all-gather)."""

    collective: str
    axis: int
    nbytes: float


@dataclass(frozen=True)
class Transition:
    """One step on one axis: ``kind`` is all_gather, slice, all_reduce, reduce_scatter,
    all_to_all or to_partial; codes as in ``autopar.strategy.placement_code``."""

    kind: str
    axis: int
    src: int
    dst: int


def _is_partial(code: int) -> bool:
    return code < REPLICATE_CODE


def transitions(src: Layout, dst: Layout) -> tuple[Transition, ...]:
    """The canonical steps from ``src`` to ``dst`` (see the module docstring)."""
    return _transitions(src.codes, dst.codes)


@functools.lru_cache(maxsize=65536)
def _transitions(src_codes: tuple[int, ...], want: tuple[int, ...]) -> tuple[Transition, ...]:
    cur = list(src_codes)
    if tuple(cur) == want:
        return ()
    ndim = len(cur)
    steps: list[Transition] = []
    # An axis moving its cut from dim d to dim e with no other axis cutting d or e: all-to-all.
    a2a = {a for a in range(ndim) if cur[a] >= 0 and want[a] >= 0 and cur[a] != want[a]
           and all(b == a or (cur[b] not in (cur[a], want[a]) and want[b] not in (cur[a], want[a]))
                   for b in range(ndim))}
    gather = {a for a in range(ndim) if cur[a] >= 0 and cur[a] != want[a] and a not in a2a}
    slices = {a for a in range(ndim) if want[a] >= 0 and cur[a] != want[a] and a not in a2a}
    # a Partial axis that will cut a dim (reduce-scatter, or all-reduce then slice)
    partial_cuts = {a for a in range(ndim) if _is_partial(cur[a]) and want[a] >= 0}
    changed = True
    while changed:  # gathering or cutting an outer axis needs the inner axes of that dim whole
        changed = False
        for a in list(gather | slices | partial_cuts):
            # the dim it gathers and the dim it cuts: both need the inner axes' pieces whole
            dims = {cur[a]} if a in gather else set()
            if a in slices or a in partial_cuts:
                dims.add(want[a])
            for b in range(a + 1, ndim):
                if b in gather:
                    continue
                if cur[b] in dims or (b in a2a and want[b] in dims):
                    a2a.discard(b)  # an inner all-to-all into that dim: gather and cut instead
                    if cur[b] >= 0:
                        gather.add(b)
                    if want[b] >= 0:
                        slices.add(b)
                    changed = True
    for a in sorted(gather, reverse=True):
        steps.append(Transition("all_gather", a, cur[a], REPLICATE_CODE))
        cur[a] = REPLICATE_CODE
    for a in sorted(a2a):
        steps.append(Transition("all_to_all", a, cur[a], want[a]))
        cur[a] = want[a]
    for a in range(ndim):  # outer axes first: a dim cut by several axes is cut outer first
        if _is_partial(cur[a]) and cur[a] != want[a]:
            if want[a] >= 0:
                steps.append(Transition("reduce_scatter", a, cur[a], want[a]))
                slices.discard(a)
                cur[a] = want[a]
            else:
                steps.append(Transition("all_reduce", a, cur[a], REPLICATE_CODE))
                cur[a] = REPLICATE_CODE
        elif a in slices:
            steps.append(Transition("slice", a, cur[a], want[a]))
            cur[a] = want[a]
    for a in range(ndim):
        if _is_partial(want[a]) and cur[a] != want[a]:
            steps.append(Transition("to_partial", a, cur[a], want[a]))
            cur[a] = want[a]
    assert tuple(cur) == want, (src_codes, want, steps)
    return tuple(steps)


def reshard_steps(src: Layout, dst: Layout, total_bytes: float, mesh: MeshSpec, needs_grad: bool = True
                  ) -> tuple[tuple[CommStep, ...], tuple[CommStep, ...]]:
    """(forward steps, backward steps) to move a tensor of ``total_bytes`` from src to dst."""
    fwd, bwd, _, _ = _unit_reshard(src.codes, dst.codes, mesh.sizes, mesh.links, needs_grad)
    return (tuple(CommStep(c, a, total_bytes / div * mult) for c, a, div, mult in fwd),
            tuple(CommStep(c, a, total_bytes / div * mult) for c, a, div, mult in bwd))


def reshard_seconds(src: Layout, dst: Layout, total_bytes: float, mesh: MeshSpec, needs_grad: bool = True) -> float:
    """Seconds of ``reshard_steps``, forward and backward, without building the steps: every
    collective's time is affine in its bytes, so one (latency, seconds-per-byte) pair per
    (src, dst, mesh) prices a reshard of any size. The planner prices ~10^5 reshards per mesh."""
    if total_bytes <= 0:
        return 0.0
    # by the mesh's identity: hashing a MeshSpec (its links' dataclass hashes, in Python) was
    # most of this function's time; the entry holds the mesh, so its id is not reused meanwhile
    held = _AFFINE.get(id(mesh))
    if held is None or held[0] is not mesh:
        if len(_AFFINE) > 64:
            _AFFINE.clear()
        held = _AFFINE[id(mesh)] = (mesh, {})
    table = held[1]
    key = (src.codes, dst.codes, needs_grad)
    ab = table.get(key)
    if ab is None:
        ab = table[key] = _unit_reshard(src.codes, dst.codes, mesh.sizes, mesh.links, needs_grad)[2:]
    return ab[0] + ab[1] * total_bytes


def reshard_latency_s(src: Layout, dst: Layout, mesh: MeshSpec, needs_grad: bool = True) -> float:
    """The part of ``reshard_seconds`` that does not grow with the bytes: its collectives'
    latencies, forward and backward."""
    return _unit_reshard(src.codes, dst.codes, mesh.sizes, mesh.links, needs_grad)[2]


# id(mesh) -> (mesh, {(src codes, dst codes, needs_grad) -> (alpha, beta)}): reshard_seconds's
# hot path hashes only ints and small int tuples.
_AFFINE: dict = {}


@functools.lru_cache(maxsize=1 << 18)
def _unit_reshard(src_codes: tuple[int, ...], dst_codes: tuple[int, ...], sizes: tuple[int, ...], links: tuple,
                  needs_grad: bool) -> tuple[tuple, tuple, float, float]:
    """Steps as (collective, axis, d, m): the step moves ``total / d * m`` bytes of a tensor of
    ``total`` bytes (the local piece, times the axis size for an all-gather's output), forward
    and backward, and the (alpha, beta) of their total time ``alpha + beta * total``."""
    cur = list(src_codes)
    fwd: list[tuple[str, int, int, int]] = []
    bwd: list[tuple[str, int, int, int]] = []
    for t in _transitions(src_codes, dst_codes):
        a, n = t.axis, sizes[t.axis]
        div = math.prod(size for c, size in zip(cur, sizes) if c >= 0)  # pieces of the local shard
        if t.kind == "all_gather":
            fwd.append(("all_gather", a, div, n))
        elif t.kind == "slice":
            if needs_grad:
                bwd.append(("all_gather", a, div, 1))
        elif t.kind == "all_reduce":
            fwd.append(("all_reduce", a, div, 1))
        elif t.kind == "reduce_scatter":
            fwd.append(("reduce_scatter", a, div, 1))
            if needs_grad:
                bwd.append(("all_gather", a, div, 1))
        elif t.kind == "all_to_all":
            fwd.append(("all_to_all", a, div, 1))
            if needs_grad:
                bwd.append(("all_to_all", a, div, 1))
        cur[a] = t.dst
    alpha = beta = 0.0
    for c, a, div, mult in fwd + bwd:
        one = collective_s(c, mult / div, sizes[a], links[a])
        two = collective_s(c, 2 * mult / div, sizes[a], links[a])
        beta += two - one
        alpha += 2 * one - two
    return tuple(fwd), tuple(bwd), alpha, beta


def steps_seconds(steps: Sequence[CommStep], mesh: MeshSpec) -> float:
    return sum(collective_s(st.collective, st.nbytes, mesh.sizes[st.axis], mesh.links[st.axis]) for st in steps)
