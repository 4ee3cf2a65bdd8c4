"""Peak device bytes over one training step: what is alive when, block by block.

The ILP's memory row adds everything a plan holds (weights, gradients, optimizer state,
gradient buckets, every kept activation, one recomputed block's activations): an upper
bound, linear in the choices. The step never holds all of it at once: gradients do not exist
when the forward ends (the optimizer's ``zero_grad`` frees them), and activations are freed
as backward walks back through the model while gradients appear. This module walks the step
at the granularity of repeated blocks (``cost_model.blocks``) and returns the largest sum:

* ``P``, persistent: weights, device-side optimizer state and gradient buckets
  (``offload.device_parts``; a bucket is allocated once and kept, as DDP's reducer does);
* the forward ends with every kept activation alive: the ops before the first block (``E``),
  each block copy's kept bytes (``K``: all of ``F``, its activations, or only what a recomputed
  block keeps: its boundary), and the ops after the last block (``H``, the head and the loss);
* backward of the head: ``P + E + sum K + H +`` the head's gradients;
* backward of block copy ``j`` (last to first): the head's activations are freed, the copies
  before ``j`` still hold ``K`` each, copy ``j`` holds all of ``F`` (kept, or recomputed now),
  and the gradients of the head and of copies ``j..last`` exist; linear in ``j``, so the
  largest is at the first or the last copy;
* the optimizer step: ``P +`` every gradient.

ZeRO-3 (``cost_model.fsdp_memory``: its units, a block copy or a module each, as ``runtime.fsdp``
gathers them) adds what the run holds beyond the shards: in forward, a unit's flat gather
landing (buffer and the weights copied out of it) with the next unit's launched; in backward,
the unit's saved weights landing again (or, recomputed, every weight its recompute saves) with
the gradients of the last ``IN_FLIGHT`` finished units in flight, and at the unit's end its whole
gradients with their flat reduce-scatter buffer and the previous unit's re-gather launched.
Without these the walk was 48% under the measured ZeRO-3 peak on gpt-tiny (659 vs 1,243 KB).

Activations follow ``costs.activation_bytes`` (what autograd saves). While an op's backward
runs, the gradient of its output and those it makes for its inputs are alive besides
(``grad_transients``): each walk point adds them at that op (the head's cross-entropy holds
three logits-sized tensors there). Not modelled: an op's own workspace; the
optimizer's own temporaries (the runtime's AdamW is torch's fused kernel, which makes none:
``runtime/offload.make_optimizer``). A run of blocks whose copies interleave with another
run's (an encoder-decoder) is walked run after run, in the order their first ops appear.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from autopar.strategy import REPLICATE_CODE

from .blocks import block_of, split_recompute_entry
from .buckets import alone_in_bucket
from .grad_transients import backward_transient_bytes
from .moved_reads import moved_read_changes
from .fsdp_memory import IN_FLIGHT, GatheredUnit, gathered_units
from .offload import device_parts
from .recompute import chosen_recompute

__all__ = ["StepMemory", "step_memory", "backward_transient_peaks"]


@dataclass(frozen=True)
class StepMemory:
    peak_bytes: float
    phase: str  # where the peak falls: "head backward", "block backward", "forward gather", "optimizer step"
    persistent_bytes: float  # weights + device optimizer state + gradient buckets
    bucket_bytes: float
    grad_bytes: float
    kept_activation_bytes: float  # alive when the forward ends


@dataclass
class _Run:
    count: int = 1
    recomputed: float = 0.0  # activations a recompute frees after the forward (per copy)
    ops: list[tuple[int, float, float]] = field(default_factory=list)  # (position, activation, gradient) per copy
    transients: list[tuple[int, float]] = field(default_factory=list)  # (position, gradients in flight) per copy
    first: int = 0  # graph position of its first op
    prefix: str = ""  # the container path of its blocks (``blocks``)

    @property
    def full(self) -> float:
        return sum(a for _, a, _ in self.ops)

    @property
    def grads(self) -> float:
        return sum(g for _, _, g in self.ops)


def _walk(ops: list[tuple[int, float, float]], transients: list[tuple[int, float]] = ()) -> float:
    """Largest ``activations not yet freed + gradients made`` while backward runs through
    ``ops`` (last to first): op k's activation is freed by its backward, which makes its
    parameters' gradients; ``transients`` (position, bytes): the gradients in flight while
    the op at that position runs its backward (its own activations still alive)."""
    ops = sorted(ops)
    pending = sorted(transients, reverse=True)
    acts = sum(a for _, a, _ in ops)
    grads = 0.0
    best = acts
    k = 0
    for at, a, g in reversed(ops):
        while k < len(pending) and pending[k][0] >= at:
            best = max(best, acts + grads + pending[k][1])
            k += 1
        grads += g
        best = max(best, acts + grads)
        acts -= a
    best = max([best, grads] + [acts + grads + t for _, t in pending[k:]])
    return best


def _transients(problem, choice: dict[str, int], graph_nodes) -> list[tuple[object, float]]:
    """(node, bytes of gradients in flight during its backward) of every priced op that has some."""
    out = []
    for n in graph_nodes:
        if n.op == "call_function" and problem.rep_of.get(n.name) == n.name and problem.needs_grad.get(n.name) \
                and (n.name in problem.decisions or n.name in problem.followers):
            t = backward_transient_bytes(n, problem.strategy_of(n.name, choice), problem.mesh, problem.train,
                                         problem.needs_grad)
            if t:
                out.append((n, t))
    return out


def backward_transient_peaks(problem, choice: dict[str, int]) -> tuple[float, float]:
    """(the largest gradients in flight during one op's backward, the largest parameter
    gradient on a device): what a pipeline stage holds besides its kept activations and state;
    the second is the fresh gradient a micro-batch after the first makes before it is added
    into ``.grad``."""
    if not problem.decisions:
        return 0.0, 0.0
    graph_nodes = list(next(iter(problem.decisions.values())).node.graph.nodes)
    ops = max((t for _, t in _transients(problem, choice, graph_nodes)), default=0.0)
    grads = 0.0
    for key, d in problem.decisions.items():
        if d.is_param:
            st, zero = d.options[choice[key]]
            grads = max(grads, device_parts(d.node.meta["val"].numel(), st.output, problem.mesh, problem.train,
                                            zero, str(d.node.target)).grads)
    return ops, grads


def _alone_in_buckets(problem, choice: dict[str, int], pos: dict) -> set[str]:
    """The parameter decisions ``runtime.grad_buckets`` would give a bucket of their own (no
    flat buffer: the GPT's head alone in the small first bucket), filling buckets in reverse
    graph order as the runtime does in reverse parameter order; a repeated block's decision
    stands for its copies, taken together at its node's place (alone only when it has one)."""
    mesh, train = problem.mesh, problem.train
    if train.mixed_precision:  # bf16 buckets: every gradient goes through a flat buffer (a copy)
        return set()
    params = []
    for key, d in problem.decisions.items():
        if not d.is_param:
            continue
        st, zero = d.options[choice[key]]
        parts = device_parts(d.node.meta["val"].numel(), st.output, mesh, train, zero, str(d.node.target))
        if parts.bucket:
            axes = tuple(a for a in range(mesh.ndim) if mesh.sizes[a] > 1 and st.output.codes[a] == REPLICATE_CODE)
            params += [(pos.get(d.node, 0), key if d.count == 1 else f"{key}#{c}", parts.bucket, axes)
                       for c in range(d.count)]
    params.sort(key=lambda p: -p[0])
    return alone_in_bucket([(name, nbytes, axes) for _, name, nbytes, axes in params])


def step_memory(problem, choice: dict[str, int], edge_bytes: dict[int, float]) -> StepMemory:
    """The step's peak device bytes under ``choice``; ``edge_bytes``: per edge index, the kept
    panel bytes ``evaluate`` counted (all copies)."""
    graph_nodes = list(next(iter(problem.decisions.values())).node.graph.nodes) if problem.decisions else []
    pos = {n: i for i, n in enumerate(graph_nodes)}
    in_block = [pos[n] for n in graph_nodes if n.op == "call_function" and block_of(n) is not None]
    lo, hi = (min(in_block), max(in_block)) if in_block else (len(pos), len(pos))
    runs: dict[str, _Run] = defaultdict(_Run)
    pre: list[tuple[int, float, float]] = []
    head: list[tuple[int, float, float]] = []
    pre_t: list[tuple[int, float]] = []
    head_t: list[tuple[int, float]] = []
    persistent = bucket = 0.0

    def add(node, at: int, act: float, grad: float, copies: int) -> None:
        b = block_of(node)
        if b is not None:
            run = runs[b[0]]
            run.prefix = b[0]
            run.count = max(run.count, copies)
            run.ops.append((at, act / copies, grad / copies))
            run.first = min(run.first or at, at)
        else:
            (pre if at < lo else head).append((at, act, grad))

    alone = _alone_in_buckets(problem, choice, pos)
    shared_grads = 0.0  # gradients that are their bucket's slot after backward (counted once at the step)
    for key, d in problem.decisions.items():
        i = choice[key]
        if d.is_param:
            st, zero = d.options[i]
            parts = device_parts(d.node.meta["val"].numel(), st.output, problem.mesh, problem.train, zero,
                                 str(d.node.target))
            slot = 0.0 if key in alone else parts.bucket
            persistent += (parts.weights + parts.state + slot) * d.count
            bucket += parts.bucket * d.count  # as param_state_bytes prices them (ILP's row)
            if slot and not problem.train.mixed_precision:  # .grad becomes the slot (same dtype)
                shared_grads += min(slot, parts.grads) * d.count
            # its gradient exists from the backward of its last reader in the forward on
            last = max((pos.get(u, 0) for u in d.node.users), default=0)
            add(d.node if block_of(d.node) is not None else graph_nodes[last] if last else d.node, last,
                0.0, parts.grads * d.count, d.count)
            continue
        add(d.node, pos.get(d.node, 0), d.memory_bytes[i], 0.0, d.count)
    for idx, nbytes in edge_bytes.items():
        d = problem.decisions[problem.edges[idx].consumer]
        add(d.node, pos.get(d.node, 0), nbytes, 0.0, d.count)
    for n, nbytes, copies in moved_read_changes(problem, choice, graph_nodes):  # a reader keeps its moved copy
        add(n, pos[n], nbytes, 0.0, copies)
    for n, t in _transients(problem, choice, graph_nodes):  # gradients in flight, one block copy's ops
        b = block_of(n)
        (runs[b[0]].transients if b is not None else pre_t if pos[n] < lo else head_t).append((pos[n], t))
    chosen = set(chosen_recompute(problem, choice))
    segments = frozenset(k for t in getattr(problem, "recompute", ()) if t.prefix in chosen
                         and split_recompute_entry(t.prefix)[1] is not None for k in t.keys)
    units = gathered_units(problem, choice, segments)
    for u in units:  # a ZeRO-3 gather reading a moved copy keeps it until its re-gather (fsdp_memory)
        if u.kept_bytes:
            copies = runs[u.run].count if u.run in runs else 1
            add(graph_nodes[u.first], u.first, u.kept_bytes * copies, 0.0, copies)
    for term in getattr(problem, "recompute", ()):
        if term.prefix not in chosen:
            continue
        run = runs[split_recompute_entry(term.prefix)[0]]
        for key in term.keys - term.boundary:
            d = problem.decisions[key]
            run.recomputed += d.memory_bytes[choice[key]] / d.count
        for idx, nbytes in edge_bytes.items():
            if problem.edges[idx].consumer in term.keys:
                run.recomputed += nbytes / problem.decisions[problem.edges[idx].consumer].count
    ordered = sorted(runs.values(), key=lambda r: r.first)
    pre_acts = sum(a for _, a, _ in pre)
    kept_blocks = sum(r.count * (r.full - r.recomputed) for r in ordered)
    g_head, g_pre = sum(g for _, _, g in head), sum(g for _, _, g in pre)
    grads = g_pre + g_head + sum(r.count * r.grads for r in ordered)
    z3 = _Zero3(units, runs, chosen, lo)
    points = [(persistent + pre_acts + kept_blocks + _walk(head, z3.at_use(head_t, after=True)), "head backward")]
    points += [(persistent + before + extra, "forward gather")
               for before, extra in z3.forward(pre, head, ordered, pre_acts, kept_blocks)]
    earlier = kept_blocks
    later_grads = g_head
    for r in reversed(ordered):
        keep = r.full - r.recomputed
        earlier -= r.count * keep
        inner = _walk(r.ops, r.transients)  # the copy being walked holds all of its activations (kept or recomputed)
        for j in {r.count - 1, 0}:
            landing, done = z3.block(r.prefix, j)  # its weights gathered again / its gradients flattened
            points.append((persistent + pre_acts + earlier + j * keep + later_grads + (r.count - 1 - j) * r.grads
                           + max(inner + landing, r.grads + done), "block backward"))
        later_grads += r.count * r.grads
    points.append((persistent + later_grads + _walk(pre, z3.at_use(pre_t, after=False)), "embedding backward"))
    points.append((persistent + grads - shared_grads, "optimizer step"))
    peak, phase = max(points, key=lambda p: p[0])
    return StepMemory(peak, phase, persistent, bucket, grads, pre_acts + kept_blocks + sum(a for _, a, _ in head))


class _Zero3:
    """ZeRO-3's gathered units placed in the walk (``cost_model.fsdp_memory``): the units one
    after another as the forward first uses them (a block run's unit once per copy); in forward
    a unit's gather lands with the next one's launched; in backward a unit's saved weights land
    again with the units finished before it still reducing (``IN_FLIGHT``), and its whole
    gradients are flattened with the previous unit's re-gather launched."""

    def __init__(self, units: list[GatheredUnit], runs: dict, recomputed: set, lo: int) -> None:
        self.seq: list[GatheredUnit] = []
        self.index: dict[str, int] = {}  # a block run -> the position of its first copy
        for u in units:
            if u.run is not None:
                self.index[u.run] = len(self.seq)
            self.seq += [u] * (runs[u.run].count if u.run in runs else 1)
        self.recomputed = {run for run, segment in map(split_recompute_entry, recomputed) if segment is None}
        self.lo = lo

    def _regathered(self, i: int) -> float:
        """Unit copy ``i``'s saved weights, launched ahead of its backward (0 when recomputed)."""
        u = self.seq[i]
        return 0.0 if u.run in self.recomputed else u.saved_bytes

    def _in_flight(self, u: GatheredUnit) -> float:
        """Whole gradient bytes a unit finished in backward leaves in flight: its flat buffer, or
        under recompute, whose gradients go one by one, about its last two weights'."""
        return u.whole_bytes * min(1.0, IN_FLIGHT / u.members) if u.run in self.recomputed else u.whole_bytes

    def _backward(self, i: int) -> tuple[float, float]:
        u = self.seq[i]
        in_flight = sum(self._in_flight(v) for v in self.seq[i + 1:i + 1 + IN_FLIGHT])
        if u.run in self.recomputed:
            # the recompute gathers weight by weight (no unit schedule runs in backward); the
            # weights its ops save stay until their backward, and each gradient is
            # reduce-scattered on its own, pushing the earlier units' out of flight
            return u.saved_bytes + in_flight, 0.0
        before = self._regathered(i - 1) if i > 0 else 0.0
        # a recomputed segment's weights are gathered by its recompute, after the unit's
        # re-gathered ones are used and freed (selective recompute: the attention's)
        start = max(u.regather_landing_bytes, u.recompute_saved_bytes)
        return start + in_flight, u.landing_bytes + before + in_flight

    def block(self, prefix: str, j: int) -> tuple[float, float]:
        """(extra bytes while copy ``j`` of run ``prefix`` starts its backward, while it ends)."""
        if prefix not in self.index:
            return 0.0, 0.0
        return self._backward(self.index[prefix] + j)

    def at_use(self, transients: list[tuple[int, float]], after: bool) -> list[tuple[int, float]]:
        """``transients`` (position, bytes) of the ops before (``after=False``) or after the
        blocks, with what each unit of its own there holds while the backward of its first op
        runs, added at that op: a unit outside the blocks is regathered only when that backward
        unpacks its weights (the head's after the loss's backward), and holds them with its whole
        gradients, the previous unit's re-gather launched and the units finished before it in
        flight. Added to the walk's largest point instead, the lm_head's 8 MiB weight counted
        during the cross-entropy's backward: ZeRO-3 on the fidelity GPT predicted 72.7 MiB for a
        62.0 MiB run (bench/memwhere.py)."""
        out = dict(transients)
        for i, u in enumerate(self.seq):
            if u.run is None and (u.first >= self.lo) == after:
                out[u.first] = out.get(u.first, 0.0) + self._held_at_use(i)
        return sorted(out.items())

    def _held_at_use(self, i: int) -> float:
        u = self.seq[i]
        in_flight = sum(self._in_flight(v) for v in self.seq[i + 1:i + 1 + IN_FLIGHT])
        if u.run in self.recomputed:
            return u.saved_bytes + in_flight
        before = self._regathered(i - 1) if i > 0 else 0.0
        return self._regathered(i) + u.landing_bytes + before + in_flight

    def forward(self, pre, head, ordered, pre_acts: float, kept_blocks: float):
        """(activations alive before the gather, the gather's bytes) per unit copy."""
        out = []
        for i, u in enumerate(self.seq):
            extra = u.landing_bytes + (self.seq[i + 1].whole_bytes if i + 1 < len(self.seq) else 0.0)
            if u.run in self.recomputed:  # a checkpointed region's gathers run weight by weight
                extra = u.whole_bytes / u.members
            if u.run is None:
                ops = pre if u.first < self.lo else head
                before = sum(a for at, a, _ in ops if at < u.first) + (0.0 if u.first < self.lo else
                                                                       pre_acts + kept_blocks)
            else:
                j = i - self.index[u.run]
                r = next(r for r in ordered if r.prefix == u.run)
                earlier = sum(o.count * (o.full - o.recomputed) for o in ordered if o.first < r.first)
                before = pre_acts + earlier + j * (r.full - r.recomputed)
            out.append((before, extra))
        return out
