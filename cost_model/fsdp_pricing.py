"""What ZeRO-3 parameters send, as ``runtime.fsdp`` runs them (used by ``evaluate``).

The problem prices a sharded parameter gathered for work split on the same axis as an
all-gather (the edge) plus a gradient all-reduce (the sync). The lowering fuses the two where
the gather is the reshard's last step (``passes.defer_sync.fsdp_axis``): the gradient is
reduce-scattered instead of all-reduced and sliced, and every op that saved the gathered
weight gathers it again in backward (``cost_model.saved_inputs``). Per step that is
all-gather + all-gather + reduce-scatter, 3 Psi (N-1)/N (ZeRO paper, FACTS.md), where the
unfused form sent 3 Psi (N-1)/N as all-gather + all-reduce; an op that saves no weight (an
embedding) saves the second all-gather. The ILP's objective keeps the all-reduce's time,
which equals all-gather + reduce-scatter by the ring formulas (``cost_model.comm``), so only
the unsaved case is overpriced there, by one all-gather.
"""

from __future__ import annotations

from autopar.strategy import REPLICATE_CODE, Layout

from .problem import Problem, partial_grad_axes
from collections import defaultdict

from .blocks import unit_key
from .comm import unit_collective_s
from .reshard import CommStep, transitions
from .saved_inputs import saves_input

__all__ = ["fsdp_axis", "fsdp_fusions", "fsdp_unit_s", "fsdp_unit_shares", "fused_gathers"]


def fsdp_axis(src: Layout, dst: Layout, split: tuple[int, ...], zero: tuple[int, ...]) -> int | None:
    """The axis whose all-gather (the reshard's last step) is fused with the gradient sync on
    that axis into a gather whose backward reduce-scatters, or None."""
    steps = transitions(src, dst)
    if not steps:
        return None
    last = steps[-1]
    if last.kind != "all_gather" or last.axis not in split or last.axis in zero:
        return None
    return last.axis if dst.codes[last.axis] == REPLICATE_CODE else None


def fsdp_fusions(problem: Problem, choice: dict[str, int], recomputed: frozenset[str] = frozenset()
                 ) -> tuple[set[tuple], list[tuple[CommStep, int, float]]]:
    """(the syncs run as reduce-scatters, keyed (tensor, axis, layout); the backward all-gathers
    of saved weights, with their counts and their parameter's unit share) under ``choice``.
    Consumers in ``recomputed`` (decisions of recomputed blocks) save nothing: their recompute
    gathers again (``cost_model.recompute``)."""
    mesh = problem.mesh
    fused: set[tuple] = set()
    regathers: list[tuple[CommStep, int, str]] = []
    for e, _, b, axis in fused_gathers(problem, choice):
        consumer = problem.decisions[e.consumer]
        fused.add((e.tensor, axis, b))
        # each copy asks its own node: the first block's layer may keep no weight (its input needs
        # no gradient) where the later blocks' layers do
        saving = sum(saves_input(v, e.input_index, problem.needs_grad) for v in e.targets) if e.targets else (
            e.count if saves_input(consumer.node, e.input_index, problem.needs_grad) else 0)
        if saving and e.consumer not in recomputed:
            regathers.append((CommStep("all_gather", axis, e.total_bytes * b.local_fraction(mesh)), saving,
                              e.producer))
    shares = fsdp_unit_shares(problem, choice)
    return fused, [(step, saving, shares.get(param, 1.0)) for step, saving, param in regathers]


def fused_gathers(problem: Problem, choice: dict[str, int]):
    """(edge, producer layout, consumer layout, axis) of every ZeRO-3 gather fused with its sync."""
    for e in problem.edges:
        producer = problem.decisions[e.producer]
        if not (e.needs_grad and producer.is_param and e.tensor):
            continue
        a = e.producer_layouts[choice[e.producer]]
        b = e.consumer_layouts[choice[e.consumer]]
        st, _ = problem.decisions[e.consumer].options[choice[e.consumer]]
        axis = fsdp_axis(a, b, partial_grad_axes(st, problem.mesh), producer.options[choice[e.producer]][1])
        if axis is not None:
            yield e, a, b, axis


def fsdp_unit_shares(problem: Problem, choice: dict[str, int]) -> dict[str, float]:
    """Per ZeRO-3 parameter decision, the share of its unit's collectives' latency it pays under
    ``choice``. ``runtime.fsdp`` forms a unit's one collective from a run of consecutive gathers
    of the unit on one axis group, each of a parameter whose shard is the stored parameter up to
    a transpose; any other gather runs alone and breaks the run. Taken here as: the unit's
    parameters are all stored sharded on their gather axis only (ZeRO-3 over data parallel). A
    unit with a parameter also cut on another axis (2D layouts) pays in full: the profiler showed
    one collective per parameter there (the bench GPT's 2D plan: 26 reduce-scatters a step)."""
    grouped: dict[str, bool] = defaultdict(lambda: True)
    params: dict[str, str] = {}
    mesh = problem.mesh
    for e, a, _, axis in fused_gathers(problem, choice):
        unit = unit_key(str(problem.decisions[e.producer].node.target))
        alone = all(c == REPLICATE_CODE or x == axis or mesh.sizes[x] == 1 for x, c in enumerate(a.codes))
        grouped[unit] = grouped[unit] and alone
        params[e.producer] = unit
    return {p: problem.unit_shares.get(p, 1.0) if grouped[u] else 1.0 for p, u in params.items()}


def fsdp_unit_s(problem: Problem, collective: str, nbytes: float, axis: int, param: str,
                shares: dict[str, float]) -> float:
    """Seconds of one ZeRO-3 collective of parameter decision ``param`` (a re-gather or a
    gradient reduce-scatter), which ``runtime.fsdp`` runs once per unit: the parameter pays its
    unit share of the latency (``comm.unit_collective_s``; ``shares`` from ``fsdp_unit_shares``)."""
    mesh = problem.mesh
    return unit_collective_s(collective, nbytes, mesh.sizes[axis], mesh.links[axis],  # type: ignore[arg-type]
                             shares.get(param, 1.0))
