"""A lower bound on a mesh's plans with ZeRO-2 and recompute options, from the LP relaxation of
its problem without them (the mesh search's first pass), at no extra solve.

Take any plan y of the mesh with those options (ZeRO-2 axes on some parameters, some block runs
recomputed), and x the same layouts with neither. Then

* x keeps every row of the first pass's problem but its memory rows: ZeRO-2 and recompute
  change no layout, and x pays each gradient all-reduce its layouts trigger;
* y's step (the ILP's objective) is x's, less what ZeRO-2 saves on each parameter (its optimizer
  step split over the zero axes, and the all-reduces of its gradient on those axes that x pays,
  ``SyncTerm.param``, released) net of the reduce-scatter + all-gather it pays
  (``cost_model.problem.zero2_steps``), plus the forward a recompute runs again (>= 0): so
  step(y) >= step(x) - S, with S the sum over parameters of the most any of their layouts saves;
* where the LP's memory rows do not bind (their duals are 0, ``cost_model.ilp.LPDuals``), the LP
  without them has the same optimum, so step(x) >= LP however much memory x needs.

So LP - S bounds every plan of the mesh with the wider options, and so does the sum of every
decision's cheapest option (ZeRO-2 ones included; edges, all-reduces and recompute cost >= 0):
the larger of the two is taken. Where a memory row binds, x
(which may need more memory than y) is not bounded by the LP: no bound is given (NaN), and the
mesh search runs the pass with the options instead. On the counterexample of
``tests/test_search_completeness.py`` (a wide MLP at batch 16384 on 8 devices) LP - S is the best
ZeRO-2 plan's step exactly.
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch.distributed.tensor import Replicate

from .cost_model.hardware import Hardware
from .cost_model.ilp import SolveResult
from .cost_model.offload import param_option_cost
from .cost_model.problem import Problem, zero2_seconds, zero2_steps

__all__ = ["options_bound", "zero2_saving_s"]


def options_bound(problem: Problem, lp: SolveResult, hw: Hardware) -> float:
    """A lower bound (seconds of the ILP's objective) on every plan of ``problem``'s mesh with
    ZeRO-2 and recompute options (module doc); ``problem`` was built without them and ``lp`` is
    its LP relaxation. NaN where unknown: no duals (CBC, an LP stopped early) or a memory row
    that binds."""
    y = lp.duals
    if y is None or y.memory != 0.0 or y.host != 0.0:
        return math.nan
    saving, floor = zero2_saving_s(problem, hw)
    return max(lp.objective_s - saving, floor)


def zero2_saving_s(problem: Problem, hw: Hardware) -> tuple[float, float]:
    """(the most ZeRO-2 options could take off the objective of any plan of ``problem`` (a
    problem built without them): per parameter decision, the largest saving over its layouts;
    a floor under every plan with them: each decision's cheapest option, ZeRO-2 ones included,
    as edges, gradient all-reduces and recomputes cost >= 0). The floor holds where the first
    can exceed the LP (a layout whose all-reduces ZeRO-2 would release but which no good plan
    takes: GPT-2 XL on m0=2,m1=32)."""
    mesh, train = problem.mesh, problem.train
    released = _released_s(problem)
    total = floor = 0.0
    for key, d in problem.decisions.items():
        floor += min(d.seconds, default=0.0)
        if not d.is_param:
            continue
        numel, target = d.node.meta["val"].numel(), str(d.node.target)
        most, cheapest = 0.0, min(d.seconds, default=0.0)
        for i, (st, zero) in enumerate(d.options):
            # the ZeRO-2 option cost_model.problem offers beside this one: every replicated axis
            axes = tuple(a for a, p in enumerate(st.output.placements) if isinstance(p, Replicate) and mesh.sizes[a] > 1)
            if zero or not axes:
                continue
            keep = param_option_cost(numel, st.output, mesh, hw, train, (), target)[0]
            split = param_option_cost(numel, st.output, mesh, hw, train, axes, target)[0]
            share = problem.unit_shares.get(key, 1.0) if len(axes) == 1 else 1.0
            comm = zero2_seconds(zero2_steps(numel, st.output, axes, mesh, train.activation_bytes_per_elem), mesh, share)
            most = max(most, (keep - split - comm) * d.count + sum(released[(key, a)] for a in axes))
            cheapest = min(cheapest, d.seconds[i] - (keep - split - comm) * d.count)
        total += most
        floor += cheapest - min(d.seconds, default=0.0)
    return total, floor


def _released_s(problem: Problem) -> dict[tuple[str, int], float]:
    """(parameter, axis) -> the most seconds of its gradient all-reduces on that axis one plan
    pays (a ZeRO-2 option on the axis releases them all). All-reduces of one tensor whose
    triggers are disjoint options of one decision (its one consumer, in different layouts)
    exclude each other: the largest counts; any others add up."""
    groups: dict[tuple, list] = defaultdict(list)
    for g in problem.syncs:
        if g.param and g.seconds > 0:
            groups[(g.param, g.axis, g.tensor, frozenset(k for k, _ in g.triggers))].append(g)
    out: dict[tuple[str, int], float] = defaultdict(float)
    for (param, axis, _, keys), syncs in groups.items():
        options = [set(g.triggers) for g in syncs]
        exclusive = len(keys) == 1 and sum(map(len, options)) == len(set().union(*options))
        out[(param, axis)] += max(g.seconds for g in syncs) if exclusive else sum(g.seconds for g in syncs)
    return out
