"""From an annotated graph to a priced decision problem the ILP solves.

Decisions. One per node that carries strategies (parameters and inputs included), except that
nodes of repeated blocks (``blocks.0``, ``blocks.1``, ... with identical ops and shapes) all
share the decisions of the first block of their run: a 96-layer transformer is priced as one
layer whose costs count 96 times. Parameter decisions also choose ZeRO: a parameter's storage
layout (``Shard`` on a data axis is ZeRO-3/FSDP, gathered before use) and whether its gradient
and optimizer state are split over the axes where it is replicated (ZeRO-2).

Costs (seconds per training step, on one device):

* node terms: forward + backward compute of each strategy (``cost_model.costs``);
* edge terms: the reshard from the producer's output layout to the layout the consumer's
  strategy needs, forward and backward (``cost_model.reshard``);
* gradient-sync terms: a replicated tensor used by work that is sharded on an axis gets a
  partial gradient on that axis and one all-reduce per tensor and axis, however many consumers
  (data-parallel weight gradients and Megatron's backward all-reduce are both this).

Memory (bytes on one device): parameter weights, gradients and optimizer state per parameter
decision, and the activations each strategy keeps for backward."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autopar.errors import AutoparError
from autopar.mesh import MeshSpec
from autopar.passes.annotate import STRATEGIES_KEY
from autopar.passes.rules import tensor_leaves
from autopar.strategy import REPLICATE_CODE, Layout, Strategy
from autopar.technique import PriceContext, technique, techniques_for

from .blocks import block_of as _block_of  # noqa: F401 (passes/split_stages imports it from here)
from .blocks import unit_key
from .decisions import Decision, EdgeTerm, Problem, SyncTerm
from .graph_facts import graph_memo as _graph_memo, requires_grad as _requires_grad
from .graph_facts import share_blocks_and_ties as _share_blocks_and_ties, tensor_inputs as _inputs
from .saved_inputs import SAVING_CONTRACTIONS, saves_input
from .buckets import bucketed_all_reduce_s
from .comm import all_reduce_s, unit_collective_s
from .costs import TrainingSpec, activation_bytes, compute_seconds, op_facts
from .hardware import Hardware
from .offload import add_host_memory, param_option_cost
from .recompute import add_recompute
from .stage_key import STAGE_KEY
from .reshard import CommStep, reshard_seconds, reshard_steps, steps_seconds, transitions

__all__ = ["Decision", "EdgeTerm", "SyncTerm", "Problem", "build_problem", "Pins", "partial_grad_axes", "zero2_steps",
           "zero2_seconds"]

# Pins restrict decisions (for baselines and user-pinned families): a function from a node to
# a predicate on its candidate (strategy, zero) options, or None for no restriction.
Pins = Any


def _tensor_bytes(val: Any, train: TrainingSpec) -> float:
    if not isinstance(val, torch.Tensor):
        return 0.0
    elem = train.activation_bytes_per_elem if val.dtype.is_floating_point else val.element_size()
    return float(val.numel() * elem)


def _param_options(node: fx.Node, strategies, mesh: MeshSpec, zero2: bool = True
                   ) -> list[tuple[Strategy, tuple[int, ...]]]:
    options = []
    for s in strategies:
        options.append((s, ()))
        if not zero2:
            continue
        replicated_axes = tuple(a for a, p in enumerate(s.output.placements) if isinstance(p, Replicate)
                                and mesh.sizes[a] > 1)
        if replicated_axes:
            options.append((s, replicated_axes))
    return options


def partial_grad_axes(st: Strategy, mesh: MeshSpec) -> tuple[int, ...]:
    """Axes (of size > 1) where some tensor of the strategy is not replicated. There, the
    gradient of a replicated input is partial: each device saw only its piece of the work
    (sharded data, as in data parallelism and Megatron's column-parallel input) or only its
    addend (a Partial operand), and it needs one all-reduce."""
    return tuple(a for a in range(mesh.ndim) if mesh.sizes[a] > 1 and any(
        l.codes[a] != REPLICATE_CODE for l in st.inputs + st.outputs))


def zero2_steps(numel: int, layout: Layout, zero_axes: tuple[int, ...], mesh: MeshSpec, elem_bytes: float
                ) -> list[CommStep]:
    """The collectives ZeRO-2 runs for one parameter each step, as ``runtime.collectives.zero2_gather``
    runs them: the local piece (of ``layout``) is flattened and padded to a multiple of the zero
    axes' product; its gradient is reduce-scattered over those axes, outermost first, and the
    updated weights are all-gathered back, innermost first. The reduce-scatter takes the place
    of the gradient all-reduce on those axes (``SyncTerm.param``)."""
    k = math.prod(mesh.sizes[a] for a in zero_axes)
    local = round(numel * layout.local_fraction(mesh))
    size = -(-local // k) * k * elem_bytes
    steps = []
    for a in sorted(zero_axes):
        steps.append(CommStep("reduce_scatter", a, size))
        size /= mesh.sizes[a]
    for a in sorted(zero_axes, reverse=True):
        size *= mesh.sizes[a]
        steps.append(CommStep("all_gather", a, size))
    return steps


def zero2_seconds(steps: list[CommStep], mesh: MeshSpec, unit_share: float) -> float:
    """Seconds of one parameter's ZeRO-2 ``steps`` when the runtime runs them for the whole unit
    at once (``runtime.zero2``, one zero axis): the bandwidth terms in full, the latency of each
    collective once per unit, so a parameter pays ``unit_share`` of it (as a bucketed all-reduce
    pays its share, ``cost_model.buckets``); ``unit_share=1``: a collective of its own."""
    return sum(unit_collective_s(st.collective, st.nbytes, mesh.sizes[st.axis], mesh.links[st.axis], unit_share)
               for st in steps)


def _unit_numels(gm: fx.GraphModule) -> dict[str, int]:
    """Elements per ZeRO unit, over the graph's parameters (each tensor once)."""
    totals: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            totals[unit_key(name)] += p.numel()
    return totals


def _is_follower(node: fx.Node) -> bool:
    """A node with one tensor input and no parameter of its own (views, unary elementwise,
    getitem) adopts its producer's layout: it gets no decision of its own. An op a registered
    technique covers always gets one (its technique's collectives are priced per decision)."""
    return node.op == "call_function" and len(_inputs(node)) == 1 and not techniques_for(node.target)


class PinError(AutoparError):
    """A pinned strategy family cannot be followed on this model and mesh."""

    def __init__(self, message: str, short: str = ""):
        super().__init__(message)
        self.short = short or message


class _Builder:
    def __init__(self, gm, mesh, hw, train, pins, zero2: bool = True):
        # a pin asks nothing of axes of size 1 (they offer only replicated layouts: Pin.on_mesh)
        pins = pins.on_mesh(mesh.sizes) if hasattr(pins, "on_mesh") else pins
        self.gm, self.mesh, self.hw, self.train, self.pins = gm, mesh, hw, train, pins
        self.zero2 = zero2
        self.nodes = [n for n in gm.graph.nodes if n.meta.get(STRATEGIES_KEY)]
        self.rep, tied = _graph_memo(gm.graph, "rep", lambda: _share_blocks_and_ties(gm, self.nodes))
        self.counts: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            if n.name not in tied:  # a tied weight's other uses share its one copy
                self.counts[self.rep[n.name]] += 1
        self.needs = _graph_memo(gm.graph, "needs", lambda: _requires_grad(gm))
        self.params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        self.decisions: dict[str, Decision] = {}
        self.followers: dict[str, tuple[str, list[Strategy]]] = {}
        self._split_cache: dict[str, list[tuple[int, ...]]] = {}
        self.price_context = PriceContext(mesh, train, self.needs, lambda val: _tensor_bytes(val, train))

    def reshard(self, a: Layout, b: Layout, total: float, grad: bool):
        """(forward steps, backward steps, seconds) of a reshard."""
        fwd, bwd = reshard_steps(a, b, total, self.mesh, grad)
        return fwd, bwd, reshard_seconds(a, b, total, self.mesh, grad)

    def tensor_bytes(self, producer: fx.Node, out_idx: int) -> float:
        val = producer.meta["val"]
        return _tensor_bytes(val[out_idx] if isinstance(val, (list, tuple)) else val, self.train)

    def source(self, producer: fx.Node, out_idx: int) -> tuple[str, list[Layout]] | None:
        """(decision key, layout of this tensor under each option of that decision)."""
        key = self.rep.get(producer.name)
        if key in self.followers:
            root, per_option = self.followers[key]
            return root, [st.outputs[out_idx] for st in per_option]
        if key in self.decisions:
            return key, [st.outputs[out_idx] for st, _ in self.decisions[key].options]
        return None

    def add_root(self, n: fx.Node) -> None:
        strategies = n.meta[STRATEGIES_KEY]
        is_param = n.op == "get_attr" and str(n.target) in self.params
        if is_param:
            options = _param_options(n, strategies, self.mesh, self.zero2)
        else:
            # Partial activations enter a decision only from contractions (S(k) x S(k) -> P) and
            # pass through followers; an op taking Partial activations (P + P -> P, P @ R -> P)
            # defers the reduction at best by one op, and pricing it would triple the edge variables.
            # (A bias may arrive Partial: it is added after a row-parallel contraction.)
            from_params = [u.op == "get_attr" and u.meta["val"].dim() == 1 for u, _ in _inputs(n)]
            options = [(s, ()) for s in strategies
                       if not any(l.has_partial and not p for l, p in zip(s.inputs, from_params))]
            options = options or [(s, ()) for s in strategies]
        if self.pins is not None:
            kept = [o for o in options if self.pins(n, o)]
            if not kept and n.op == "placeholder" and self.pins.strict:
                short = (f"input {n.name} of shape {tuple(n.meta['val'].shape)} cannot take the layout the "
                         f"strategy asks for on mesh {self.mesh}")
                raise PinError(f"the strategy family cannot be followed: {short} (e.g. the batch does not divide "
                               f"by the data-parallel size); change the batch or the mesh, or use strategy='auto'",
                               short)
            options = kept or options  # an op with no such layout (e.g. no rule) runs as it can
        count = self.counts[n.name]
        seconds, memory = [], []
        for st, zero_axes in options:
            sec, mem = self.option_cost(n, st, zero_axes, is_param)
            seconds.append(sec * count)
            memory.append(mem * count)
        d = self.decisions[n.name] = Decision(n.name, n, options, seconds, memory, count, is_param)
        if n.op == "placeholder" and self.needs.get(n.name, False):
            self.add_input_grad(n, d)
        for i, (st, zero_axes) in enumerate(options):
            steps = self.algorithm_steps(n, st) if n.op == "call_function" else []
            if steps:
                sec = steps_seconds(steps, self.mesh) * count
                d.seconds[i] += sec
                d.comm_seconds[i] += sec
                d.comm_steps[i].extend((step, count) for step in steps)
            if is_param and zero_axes:
                # ZeRO-2's reduce-scatter + all-gather replace the gradient all-reduces on its
                # axes: the option pays for them and releases those all-reduces (the ILP's sync
                # rows; followers' below).
                steps = zero2_steps(n.meta["val"].numel(), st.output, zero_axes, self.mesh,
                                    self.train.activation_bytes_per_elem)
                share = self.unit_share(n) if len(zero_axes) == 1 else 1.0
                sec = zero2_seconds(steps, self.mesh, share) * count
                d.seconds[i] += sec
                d.comm_seconds[i] += sec
                d.comm_steps[i].extend((step, count) for step in steps)

    def unit_share(self, n: fx.Node) -> float:
        """The parameter's share of its ZeRO unit's elements (``cost_model.blocks.unit_key``)."""
        totals = _graph_memo(self.gm.graph, "unit_numel", lambda: _unit_numels(self.gm))
        total = totals.get(unit_key(str(n.target)), 0)
        return n.meta["val"].numel() / total if total else 1.0

    def algorithm_steps(self, n: fx.Node, st: Strategy, backward: bool = True) -> list[CommStep]:
        """The collectives of the registered technique the strategy runs (``autopar.techniques``);
        ``backward=False``: its forward's only (what a recompute runs again)."""
        if st.technique is None:
            return []
        price = technique(st.technique).price
        return price(self.price_context, n, st, backward) if price is not None else []

    def add_input_grad(self, n: fx.Node, d: Decision) -> None:
        """An input whose gradient is wanted (a pipeline stage's input) is cut from the whole
        tensor for free, and its gradient gathered back whole: the cut's backward steps."""
        total = _tensor_bytes(n.meta["val"], self.train)
        for i, (st, _) in enumerate(d.options):
            fwd, bwd = reshard_steps(Layout.replicated(self.mesh.ndim), st.output, total, self.mesh, True)
            sec = steps_seconds(fwd + bwd, self.mesh) * d.count
            d.seconds[i] += sec
            d.comm_seconds[i] += sec
            d.comm_steps[i].extend((step, d.count) for step in fwd + bwd)

    def option_cost(self, n: fx.Node, st: Strategy, zero_axes, is_param: bool) -> tuple[float, float]:
        mesh, hw, train = self.mesh, self.hw, self.train
        if is_param:
            # the optimizer step, on the device or (offload) on the host: cost_model/offload.py.
            # ZeRO-2's collectives are added by add_root (zero2_steps).
            sec, mem, _ = param_option_cost(n.meta["val"].numel(), st.output, mesh, hw, train, zero_axes,
                                            str(n.target))
            return sec, mem
        if n.op in ("placeholder", "get_attr"):
            return 0.0, _tensor_bytes(n.meta["val"], train) * st.output.local_fraction(mesh)
        grad = self.needs[n.name]
        facts = _graph_memo(n.graph, f"op_facts {n.name}", lambda: op_facts(n, self.needs, grad))
        fwd, bwd = compute_seconds(n, st, mesh, hw, train, grad, facts)
        return fwd + bwd, activation_bytes(n, st, mesh, train, grad, self.needs, facts)

    def add_follower(self, n: fx.Node) -> bool:
        (producer, out_idx), = _inputs(n)
        src = self.source(producer, out_idx)
        if src is None:
            return False
        root_key, layouts = src
        root = self.decisions[root_key]
        strategies = n.meta[STRATEGIES_KEY]
        by_input: dict[Layout, list[Strategy]] = defaultdict(list)
        for st in strategies:
            by_input[st.inputs[0]].append(st)
        total = self.tensor_bytes(producer, out_idx)
        count = self.counts[n.name]
        chosen_per_option: list[Strategy] = []
        cache: dict[Layout, tuple] = {}
        own_cost: dict[int, tuple[float, float]] = {}  # by id: a Strategy's hash is Python code
        grad = self.needs.get(producer.name, False)
        for i, a in enumerate(layouts):
            if a not in cache:
                best = None
                for st in (by_input.get(a) or strategies):
                    cost = own_cost.get(id(st))
                    if cost is None:
                        cost = own_cost[id(st)] = self.option_cost(n, st, (), False)
                    comm = reshard_seconds(a, st.inputs[0], total, self.mesh, grad)
                    if best is None or cost[0] + comm < best[1] + best[3]:
                        best = (st, cost[0], cost[1], comm)
                st, sec, mem, comm = best
                fwd, bwd = reshard_steps(a, st.inputs[0], total, self.mesh, grad)
                cache[a] = (st, sec, mem, comm, fwd + bwd)
            st, sec, mem, comm, steps = cache[a]
            zero = root.options[i][1] if root.is_param else ()  # ZeRO-2 reduce-scatters these axes
            syncs = self._follower_syncs(st, total, producer)
            steps = list(steps) + [x for x in syncs if x.axis not in zero]
            comm = sum(steps_seconds([x], self.mesh) for x in steps) if steps else 0.0
            chosen_per_option.append(st)
            root.seconds[i] += (sec + comm) * count
            root.memory_bytes[i] += mem * count
            if steps:
                root.comm_seconds[i] += comm * count
                root.comm_steps[i].extend((step, count) for step in steps)
        self.followers[n.name] = (root_key, chosen_per_option)
        return True

    def _follower_syncs(self, st: Strategy, total: float, producer: fx.Node) -> list[CommStep]:
        """A follower that reads a replicated input into sharded work (an expand that cuts its
        new dim) owes that input's gradient an all-reduce; followers keep their own."""
        if not self.needs.get(producer.name, False):
            return []
        layout = st.inputs[0]
        steps = []
        for a in partial_grad_axes(st, self.mesh):
            if layout.codes[a] == REPLICATE_CODE:
                steps.append(CommStep("all_reduce", a, total * layout.local_fraction(self.mesh)))
        return steps

    def add_outputs(self) -> None:
        """The model's outputs go back to the user whole: price their reshard to replicated."""
        for out in (n for n in self.gm.graph.nodes if n.op == "output"):
            for producer in tensor_leaves(out.args, {}, lambda x: isinstance(x, fx.Node)):
                if not isinstance(producer.meta.get("val"), torch.Tensor):
                    continue
                src = self.source(producer, 0)
                if src is None:
                    continue
                key, layouts = src
                d = self.decisions[key]
                total = self.tensor_bytes(producer, 0)
                rep = Layout.replicated(self.mesh.ndim)
                for i, layout in enumerate(layouts):
                    fwd, bwd, sec = self.reshard(layout, rep, total, False)
                    d.seconds[i] += sec
                    d.comm_seconds[i] += sec
                    d.comm_steps[i].extend((step, 1) for step in fwd + bwd)

    def build(self) -> Problem:
        for n in self.nodes:
            if self.rep[n.name] != n.name:
                continue
            if not (_is_follower(n) and self.add_follower(n)):
                self.add_root(n)
        self.add_outputs()
        edges, syncs = self.edges_and_syncs()
        problem = Problem(self.mesh, self.decisions, edges, syncs, self.rep, dict(self.counts), self.followers,
                          self.needs, self.train.optimizer)
        problem.unit_shares = {k: self.unit_share(d.node) for k, d in self.decisions.items() if d.is_param}
        return problem

    def edges_and_syncs(self):
        edge_acc: dict[tuple, EdgeTerm] = {}
        sync_acc: dict[tuple, SyncTerm] = {}
        edge_syncs: dict[tuple, list] = {}  # edge key -> per sync it triggers, the tensor sets a copy joins
        producers: dict[tuple, set[str]] = defaultdict(set)  # sync key -> the actual tensors behind it
        first: dict[tuple, tuple[fx.Node, fx.Node]] = {}  # edge key -> its first copy's (producer, consumer)
        decisions, followers, rep = self.decisions, self.followers, self.rep
        for v in self.nodes:
            vkey = rep[v.name]
            if vkey in followers:
                continue  # folded into its root's options
            dv = decisions[vkey]
            for k, (u, out_idx) in enumerate(_inputs(v)):
                urep = rep.get(u.name)  # the decision key self.source gives, without its layouts
                ukey = followers[urep][0] if urep in followers else urep if urep in decisions else None
                if ukey is None:
                    continue
                key = (ukey, urep, out_idx, vkey, k)
                edge = edge_acc.get(key)
                if edge is not None:
                    edge.count += 1
                else:
                    _, producer_layouts = self.source(u, out_idx)
                    total = self.tensor_bytes(u, out_idx)
                    grad = self.needs.get(u.name, False)
                    # seconds and memory are filled in below, once the edge's copies are counted
                    edge = edge_acc[key] = EdgeTerm(ukey, vkey, producer_layouts,
                                                    [st.inputs[k] for st, _ in dv.options], {}, total_bytes=total,
                                                    needs_grad=grad, tensor=f"{urep}[{out_idx}]", input_index=k)
                    first[key] = (u, v)
                    skeys = self.add_syncs(sync_acc, (urep, out_idx), dv, k, total) if grad else []
                    edge_syncs[key] = [(producers[s], sync_acc[s].sources.setdefault(vkey, set())) for s in skeys]
                edge.sources.append(name := f"{u.name}[{out_idx}]")
                edge.targets.append(v)
                for tensors, consumer_tensors in edge_syncs[key]:
                    tensors.add(name)
                    consumer_tensors.add(name)
        edges = list(edge_acc.values())
        # Edges moving equal-sized tensors between the same layout lists have equal tables: each is
        # priced once and copied (dict.copy keeps the keys' hashes: rehashing layout pairs was most
        # of this function's time); same values, same order as reshard_seconds(a, b) * count.
        tables: dict[tuple, tuple] = {}
        pair_seconds: dict[tuple, float] = {}  # (id(a), id(b), bytes, grad) -> reshard_seconds: ints hash fast
        panels: dict[tuple, dict] = {}  # saved_panel_bytes reads only these: op, is_param, the table's key
        for key, e in edge_acc.items():
            # = dict.fromkeys(layouts), cheaper: by identity (C hashes) first, then equality (Python)
            pa = tuple(dict.fromkeys({id(x): x for x in e.producer_layouts}.values()))
            pb = tuple(dict.fromkeys({id(x): x for x in e.consumer_layouts}.values()))
            tkey = (tuple(map(id, pa)), tuple(map(id, pb)), e.total_bytes, e.needs_grad, e.count)
            hit = tables.get(tkey)
            if hit is None:
                table, count = {}, e.count
                for a in pa:
                    for b in pb:
                        pkey = (id(a), id(b), e.total_bytes, e.needs_grad)
                        c = pair_seconds.get(pkey)
                        if c is None:
                            c = pair_seconds[pkey] = reshard_seconds(a, b, e.total_bytes, self.mesh, e.needs_grad)
                        table[(a, b)] = c * count if count > 1 else c
                hit = tables[tkey] = (pa, pb, table)  # pa, pb held so their ids stay valid
            e.seconds = hit[2].copy()
            u, v = first[key]
            mkey = (tkey, v.target, self.decisions[e.producer].is_param)
            memory = panels.get(mkey)
            if memory is None:
                memory = panels[mkey] = self.saved_panel_bytes(u, v, e.input_index, e.producer, e.total_bytes,
                                                               hit[2])
            memory = memory.copy()
            if memory:  # each copy's own op says whether it keeps the tensor for backward
                keeping = sum(saves_input(t, e.input_index, self.needs) for t in e.targets)
                memory = {ab: m * keeping for ab, m in memory.items()} if keeping else {}
            e.memory = memory
        for skey, sync in sync_acc.items():
            # One all-reduce per actual tensor: a repeated block's copies each have their own,
            # and a block's input comes from a different producer in the first block.
            sync.count = len(producers[skey])
            sync.seconds *= sync.count
            sync.triggers = list(dict.fromkeys(sync.triggers))
        return edges, list(sync_acc.values())

    def saved_panel_bytes(self, u: fx.Node, v: fx.Node, k: int, ukey: str, total: float, pairs) -> dict:
        """Memory of an activation a contraction keeps for backward in the layout it moved it
        to (a whole-panel all-gather's result, say): a tensor of its own, besides the producer's
        output. Parameters are left out (ZeRO-3 gathers keep their shard and gather again)."""
        if v.target not in SAVING_CONTRACTIONS or self.decisions[ukey].is_param:
            return {}
        # per copy; edges_and_syncs multiplies by the copies whose op keeps it
        # only where the runtime moves it (a layout change with no step is the same storage)
        return {(a, b): total * b.local_fraction(self.mesh) for a, b in pairs
                if any(self.mesh.sizes[t.axis] > 1 for t in transitions(a, b))}

    def _split_axes(self, d: Decision) -> list[tuple[int, ...]]:
        """Per option, the axes on which the gradient of a replicated input comes back partial."""
        cached = self._split_cache.get(d.key)
        if cached is None:
            cached = [partial_grad_axes(st, self.mesh) for st, _ in d.options]
            self._split_cache[d.key] = cached
        return cached

    def add_syncs(self, acc, tensor, dv: Decision, k: int, total: float) -> list[tuple]:
        """Gradient all-reduce: input k of dv is replicated on an axis where dv's work is sharded.
        Returns the sync keys; their cost per copy is multiplied out in ``edges_and_syncs``."""
        mesh = self.mesh
        split_axes = self._split_axes(dv)
        touched: dict[tuple, None] = {}
        for i, (st, _) in enumerate(dv.options):
            layout = st.inputs[k]
            for a in split_axes[i]:
                if not isinstance(layout.placements[a], Replicate):
                    continue
                skey = (tensor, a, layout)
                if skey not in acc:
                    local = total * layout.local_fraction(mesh)
                    root = self.followers[tensor[0]][0] if tensor[0] in self.followers else tensor[0]
                    param = root if root in self.decisions and self.decisions[root].is_param else ""
                    # a parameter's gradient is all-reduced in a bucket (runtime/grad_buckets.py)
                    seconds = (bucketed_all_reduce_s if param else all_reduce_s)(local, mesh.sizes[a], mesh.links[a])
                    acc[skey] = SyncTerm(f"{tensor[0]}[{tensor[1]}]", a, seconds, [], local, 1, param, layout)
                acc[skey].triggers.append((dv.key, i))
                touched[skey] = None
        return list(touched)


def build_problem(gm: fx.GraphModule, mesh: MeshSpec, hw: Hardware, train: TrainingSpec,
                  pins: Pins = None, zero2: bool = True) -> Problem:
    """Price every strategy of the annotated ``gm`` (see the module docstring). ``zero2=False``
    leaves ZeRO-2 out of the parameters' options."""
    builder = _Builder(gm, mesh, hw, train, pins, zero2)
    problem = builder.build()
    problem.train, problem.stage = train, gm.meta.get(STAGE_KEY)  # a pipeline stage: its ILP weights
    # block runs the ILP may recompute (cost_model/recompute.py); their forward runs again
    add_recompute(problem, hw, train, lambda n, st: builder.algorithm_steps(n, st, backward=False))
    add_host_memory(problem, hw, train)  # ZeRO-Offload's host bytes (cost_model/offload.py)
    # evaluate() hides asynchronous collectives (cost_model/overlap.py); pipeline_parts.accumulate_seconds
    problem.comm_overlap, problem.stream_bytes_per_s = hw.comm_overlap, hw.efficiency * hw.memory_bandwidth_bytes_per_s
    return problem
