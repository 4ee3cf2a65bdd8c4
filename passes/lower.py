"""lower: a traced graph and the strategy chosen for each node -> one rank's program.

The per-rank GraphModule computes on local shards. Before each op it moves every input from
the layout its producer left it in to the layout the op's strategy needs, with exactly the
steps ``cost_model.reshard.transitions`` lists (so bytes sent equal bytes predicted), and
inserts ``grad_sync`` where a replicated input feeds work sharded on an axis (its gradient is
partial there). Size arguments of view-like ops are divided by the output's shard counts.
Placeholders (the user's global inputs) are cut to this rank's slice; outputs are made whole.
Printing the result shows every collective as a call to ``autopar.runtime.collectives``.
The run-time objects a call needs - an axis's ``AxisGroup``, the model's ZeRO-3 state - are
attributes of the program's own module (``self.autopar_axis_dp``, ``self.autopar_fsdp``), read
by ``get_attr``: each parallelized model carries its own, nothing is looked up process-wide.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.cost_model.graph_facts import requires_grad
from autopar.cost_model.problem import partial_grad_axes
from autopar.cost_model.reshard import transitions
from autopar.mesh import MeshSpec
from autopar.runtime import collectives as C
from autopar.runtime import fsdp as F
from autopar.runtime.zero2 import zero2_gather_unit
from autopar.runtime.mixed_precision import MixedPrecision, retarget_dtypes, to_compute_dtype
from autopar.strategy import REPLICATE_CODE, PARTIAL_AVG_CODE, Layout, Replicate, Strategy
from autopar.techniques import catalog  # noqa: F401 (imports every technique file, so each registers)
from autopar.technique import LowerContext, technique

from .defer_sync import ParamUse, defer_param_syncs, fsdp_axis
from .recompute_regions import checkpoint_blocks
from .rules import get_rule, has_rule, tensor_leaves

__all__ = ["lower", "DEFERRED_KEY"]

DEFERRED_KEY = "autopar_deferred_grad_syncs"
FSDP_ATTR = "autopar_fsdp"  # the program's runtime.fsdp.FsdpState
AXIS_ATTR = "autopar_axis_"  # + axis name: the program's AxisGroup of that mesh axis


class _RuntimeRefs:
    """``refs[axis]``: a ``get_attr`` node reading that axis's AxisGroup from the program's
    module, made at first use (so it sits just before its first reader); ``refs.fsdp``: the
    same for the model's FsdpState. The objects are set on ``root`` under those names."""

    def __init__(self, graph: fx.Graph, root: torch.nn.Module, groups: Sequence[C.AxisGroup]):
        self.graph, self.root = graph, root
        self.names = [AXIS_ATTR + g.name for g in groups]
        for name, g in zip(self.names, groups):
            setattr(root, name, g)
        if not isinstance(getattr(root, FSDP_ATTR, None), F.FsdpState):  # relowering keeps the model's
            setattr(root, FSDP_ATTR, F.FsdpState())
        self.nodes: dict[str, fx.Node] = {}

    def _node(self, name: str) -> fx.Node:
        if name not in self.nodes:
            self.nodes[name] = self.graph.get_attr(name)
        return self.nodes[name]

    def __getitem__(self, axis: int) -> fx.Node:
        return self._node(self.names[axis])

    @property
    def fsdp(self) -> fx.Node:
        return self._node(FSDP_ATTR)


def _is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


class _Lowering:
    def __init__(self, gm: fx.GraphModule, strategies: dict[str, Strategy], mesh: MeshSpec,
                 groups: Sequence[C.AxisGroup], followers: set[str], zero2: dict[str, tuple[int, ...]],
                 root: torch.nn.Module, local_inputs: bool = False, local_outputs: bool = False,
                 defer_grad_sync: bool = False, defer_param_syncs: bool = False,
                 mixed_precision: MixedPrecision | None = None):
        self.local_inputs, self.local_outputs = local_inputs, local_outputs
        self.mp = mixed_precision  # None: the program runs in the dtypes it was traced in
        self.defer, self.deferred = defer_grad_sync, {}
        # (parameter target, axis) whose gradient all-reduce a pipeline runs once per step
        self.step_deferred: set[tuple[str, int]] = set()
        self.defer_param_syncs = defer_param_syncs
        self.gm, self.strategies, self.mesh = gm, strategies, mesh
        self.followers = followers
        self.zero2, self.root = zero2, root
        self.gathered: dict[int, fx.Node] = {}  # ZeRO-2 parameter (by identity) -> its gathered weights
        self.zero2_units = _zero2_units(gm, self.zero2, root)
        self.graph = fx.Graph()
        self.graph._codegen = gm.graph._codegen  # the user's call convention (read-only: shared, not copied)
        self.groups = _RuntimeRefs(self.graph, root, groups)  # get_attr nodes of the model's own groups
        self.env: dict[str, Any] = {}
        self.layouts: dict[str, tuple[Layout, ...]] = {}
        self.needs = requires_grad(gm)
        self.synced: dict[tuple, fx.Node] = {}
        self.param_uses: dict[str, list[ParamUse]] = {}  # parameter node -> its uses (passes/defer_sync.py)
        self.targets = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
        self.single_use = _single_use_params(gm, self.followers, self.zero2) if defer_param_syncs else set()

    def call(self, fn: Callable, *args) -> fx.Node:
        return self.graph.call_function(fn, args)

    def reshard(self, value: fx.Node, src: Layout, dst: Layout, ndim: int, fsdp: int | None = None,
                unit: str | None = None) -> fx.Node:
        for t in transitions(src, dst):
            g = self.groups[t.axis]
            if t.kind == "all_gather" and t.axis == fsdp:  # ZeRO-3: its backward reduce-scatters (defer_sync)
                value = self.call(F.fsdp_gather, value, t.src % ndim, g, self.groups.fsdp, unit)
            elif t.kind == "all_gather":
                value = self.call(C.all_gather, value, t.src % ndim, g)
            elif t.kind == "slice":
                value = self.call(C.local_slice, value, t.dst % ndim, g)
            elif t.kind == "all_reduce":
                value = self.call(C.all_reduce, value, t.src == PARTIAL_AVG_CODE, g)
            elif t.kind == "reduce_scatter":
                value = self.call(C.reduce_scatter, value, t.dst % ndim, t.src == PARTIAL_AVG_CODE, g)
            elif t.kind == "all_to_all":
                value = self.call(C.all_to_all, value, t.src % ndim, t.dst % ndim, g)
            elif t.kind == "to_partial":
                value = self.call(C.to_partial, value, t.dst == PARTIAL_AVG_CODE, g)
        return value

    def input_value(self, node: fx.Node, k: int, producer: fx.Node, strategy: Strategy) -> fx.Node:
        src = self.layouts[producer.name][0]
        dst = strategy.inputs[k]
        ndim = producer.meta["val"].dim()
        if not self.needs.get(producer.name, False):
            return self.reshard(self.env[producer.name], src, dst, ndim)
        split = partial_grad_axes(strategy, self.mesh)
        root = self.param_root(producer)
        zero = self.zero2.get(root, ())
        fsdp = fsdp_axis(src, dst, split, zero) if root and node.name not in self.followers else None
        owner = node.name if node.name in self.followers else ""
        first = next((a for a in split if dst.codes[a] == REPLICATE_CODE and a not in zero), None)
        if first is not None and (producer.name, dst, (first,), owner) in self.synced:
            # another op already moved this tensor to this layout and synchronizes its gradient
            # there: share that value (one reshard, one sync; cost_model.evaluate prices it once)
            value = self.env[producer.name]
        else:
            # ZeRO-3 weights of one unit (runtime/fsdp.py: a block) gather and reduce-scatter as one
            unit = F.unit_key(self.targets[root]) if fsdp is not None else None
            value = self.reshard(self.env[producer.name], src, dst, ndim, fsdp, unit)
        if zero and node.name not in self.followers:
            # ZeRO-2's reduce-scatter sums the gradient over its axes: where this use leaves it
            # whole (replicated work, or a slice whose backward gathers), it enters divided by n.
            for a in zero:
                if not (a in split and dst.codes[a] == REPLICATE_CODE):
                    value = self.call(C.grad_scale, value, 1.0 / self.mesh.sizes[a])
        # One gradient all-reduce per (tensor, layout, axis) among decision nodes; followers
        # keep their own, as the cost model prices them.
        done: tuple[int, ...] = ()
        syncs = []
        for a in split:
            if dst.codes[a] != REPLICATE_CODE or a in zero:  # ZeRO-2 reduce-scatters it instead
                continue
            if root in self.single_use and src.codes[a] == REPLICATE_CODE \
                    and self.layouts[root][0].codes[a] == REPLICATE_CODE:
                # its only use, stored whole on this axis (a ZeRO-3 shard's gradient is cut on
                # it): the gradient arriving at the parameter is partial on this axis, so summing
                # micro-batches first and all-reducing once per step gives the same result
                self.step_deferred.add((self.targets[root], a))
                continue
            key = (producer.name, dst, done + (a,), owner)
            if key not in self.synced:  # (a fused ZeRO-3 gather reduce-scatters on its own axis)
                self.synced[key] = value if a == fsdp else self.call(C.grad_sync, value, self.groups[a])
            value, done = self.synced[key], done + (a,)
            syncs.append(self.synced[key])
        if root:
            self.param_uses.setdefault(root, []).append(ParamUse(
                node.name, node.name in self.followers, tuple(syncs), bool(transitions(src, dst))))
        return value

    def param_root(self, producer: fx.Node) -> str:
        """The parameter node whose value ``producer`` carries through followers, or ""."""
        while producer.name in self.followers and producer.op == "call_function":
            ins = tensor_leaves(producer.args, producer.kwargs, _is_tensor_node)
            if len(ins) != 1:
                return ""
            producer = ins[0]
        return producer.name if producer.op == "get_attr" else ""

    def localize(self, node: fx.Node, args: tuple, kwargs: dict, strategy: Strategy) -> tuple[tuple, dict]:
        if not has_rule(node.target):
            return args, kwargs
        vals = pytree.tree_map(lambda x: x.meta.get("val") if isinstance(x, fx.Node) else x, (node.args, node.kwargs))
        spec = get_rule(node.target).fn(*vals[0], **vals[1])
        if spec.shape_arg is None or not strategy.outputs:
            return args, kwargs
        sizes = list(node.args[spec.shape_arg])
        counts = strategy.outputs[0].shard_counts(self.mesh, len(sizes))
        local = [s if s == -1 else s // c for s, c in zip(sizes, counts)]
        return args[:spec.shape_arg] + (local,) + args[spec.shape_arg + 1:], kwargs

    def run(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            getattr(self, f"do_{node.op}")(node)
        if self.defer:
            self.deferred = defer_param_syncs(self.gm, self.graph, self.param_uses, self.param_root)
        return self.graph

    def do_placeholder(self, node: fx.Node) -> None:
        p = self.graph.placeholder(node.name, type_expr=node.type)
        p.meta = dict(node.meta)
        s = self.strategies.get(node.name)
        if s is None:
            self.env[node.name] = p
            return
        val = node.meta["val"]
        value = self.to_compute(p, node)  # cast before the cut: a later gather moves bf16
        # Global inputs are cut to this rank's piece here (free); local ones arrive cut.
        self.env[node.name] = value if self.local_inputs else \
            self.reshard(value, Layout.replicated(self.mesh.ndim), s.output, val.dim())
        self.layouts[node.name] = s.outputs

    def to_compute(self, value: fx.Node, node: fx.Node) -> fx.Node:
        """Under mixed precision, a floating tensor read from outside the graph (parameter, buffer,
        input) in the compute dtype; its gradient comes back in the original dtype
        (``runtime/mixed_precision.py``)."""
        val = node.meta.get("val")
        if self.mp is None or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return value
        return self.call(to_compute_dtype, value, self.mp.param_dtype)

    def do_get_attr(self, node: fx.Node) -> None:
        if node.name in self.zero2:
            param = self.root.get_parameter(str(node.target))
            if id(param) not in self.gathered:  # tied weights: one gather, one reduce-scatter
                self.gather_zero2(node)
            elif not any(m.target == node.target for m in self.zero2_units.get(node.name, ())):
                # a tied weight's other name: read once, unused, so the program keeps the attribute
                self.graph.get_attr(node.target)
            self.env[node.name] = self.gathered[id(param)]
        else:
            # the cast comes first, so ZeRO-2/ZeRO-3 gathers and gradient reductions move bf16
            self.env[node.name] = self.to_compute(self.graph.get_attr(node.target), node)
        if node.name in self.strategies:
            self.layouts[node.name] = self.strategies[node.name].outputs

    def gather_zero2(self, node: fx.Node) -> None:
        """The whole weights of ZeRO-2 parameter ``node``: with the other parameters of its unit
        in one all-gather (``runtime/zero2.py``), or alone when it is split over several zero axes."""
        members = [m for m in self.zero2_units.get(node.name, [node])
                   if id(self.root.get_parameter(str(m.target))) not in self.gathered]
        pieces = [self.to_compute(self.graph.get_attr(m.target), m) for m in members]
        shapes = [tuple(self.strategies[m.name].output.local_shape(self.mesh, m.meta["val"].shape)) for m in members]
        axes = [self.groups[a] for a in sorted(self.zero2[node.name])]
        if len(axes) > 1:
            (member,), (piece,), (shape,) = members, pieces, shapes
            self.gathered[id(self.root.get_parameter(str(member.target)))] = self.call(
                C.zero2_gather, piece, list(shape), axes)
            return
        unit = self.call(zero2_gather_unit, tuple(shapes), axes[0], *pieces)
        for k, m in enumerate(members):
            self.gathered[id(self.root.get_parameter(str(m.target)))] = self.call(operator.getitem, unit, k)

    def do_call_function(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            producer, index = node.args
            self.env[node.name] = self.call(operator.getitem, self.env[producer.name], index)
            self.layouts[node.name] = (self.layouts[producer.name][index],)
            return
        s = self.strategies[node.name]
        inputs = iter([self.input_value(node, k, p, s)
                       for k, p in enumerate(tensor_leaves(node.args, node.kwargs, _is_tensor_node))])
        args, kwargs = pytree.tree_map(
            lambda x: next(inputs) if _is_tensor_node(x) else (self.env[x.name] if isinstance(x, fx.Node) else x),
            (node.args, node.kwargs))
        args, kwargs = self.localize(node, tuple(args), kwargs, s)
        lower_hook = technique(s.technique).lower if s.technique is not None else None
        if lower_hook is not None:  # the technique's runtime kernel replaces the op
            out = lower_hook(LowerContext(self.graph, self.groups, self.mesh, self.env), node, s, tuple(args), kwargs)
        elif self.mp is not None:
            out = self.graph.call_function(node.target, *retarget_dtypes(tuple(args), kwargs, self.mp))
            if _made_floating(node, self.mp.traced_dtype):  # a factory, or int -> float: cast it
                out = self.call(to_compute_dtype, out, self.mp.param_dtype)
        else:
            out = self.graph.call_function(node.target, tuple(args), kwargs)
        out.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        self.env[node.name] = out
        self.layouts[node.name] = s.outputs

    def do_call_module(self, node: fx.Node) -> None:
        raise NotImplementedError(f"call_module {node.target} in a traced graph: trace with autopar.trace")

    def do_output(self, node: fx.Node) -> None:
        def whole(x):
            if not isinstance(x, fx.Node):
                return x
            if _is_tensor_node(x) and x.name in self.layouts:
                src = self.layouts[x.name][0]
                # whole, or (local_outputs) left cut as the plan has it, partial sums reduced
                dst = Layout.interned(tuple(Replicate() if c < REPLICATE_CODE else p
                                            for p, c in zip(src.placements, src.codes))) \
                    if self.local_outputs else Layout.replicated(self.mesh.ndim)
                return self.reshard(self.env[x.name], src, dst, x.meta["val"].dim())
            return self.env[x.name]

        self.graph.output(pytree.tree_map(whole, node.args[0]))


def _made_floating(node: fx.Node, dtype: torch.dtype) -> bool:
    """``node`` makes a ``dtype`` tensor from no floating tensor input (a factory such as
    ``zeros``, or integer math such as a true division)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != dtype:
        return False
    return not any(i.meta["val"].is_floating_point() for i in tensor_leaves(node.args, node.kwargs, _is_tensor_node))


def _zero2_units(gm: fx.GraphModule, zero2: dict[str, tuple[int, ...]], root: torch.nn.Module
                 ) -> dict[str, list[fx.Node]]:
    """Per ZeRO-2 parameter node over one zero axis, the nodes of its unit (``runtime.fsdp.unit_key``
    and the same axis) in graph order, each parameter once (tied weights: the first node)."""
    units: dict[tuple, list[fx.Node]] = {}
    seen: set[int] = set()
    for n in gm.graph.nodes:
        axes = zero2.get(n.name, ()) if n.op == "get_attr" else ()
        if len(axes) != 1 or id(root.get_parameter(str(n.target))) in seen:
            continue
        seen.add(id(root.get_parameter(str(n.target))))
        units.setdefault((F.unit_key(str(n.target)), axes), []).append(n)
    return {m.name: members for members in units.values() for m in members}


def _single_use_params(gm: fx.GraphModule, followers: set[str], zero2: dict) -> set[str]:
    """Parameter nodes with one use (through a chain of followers such as a transpose) and no
    tied twin: their gradient syncs can wait for the end of a step (``defer_param_syncs``)."""
    params = {name: id(p) for name, p in gm.named_parameters(remove_duplicate=False)}
    uses_of_tensor: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and str(n.target) in params:
            uses_of_tensor[params[str(n.target)]] = uses_of_tensor.get(params[str(n.target)], 0) + 1
    out = set()
    for n in gm.graph.nodes:
        if n.op != "get_attr" or str(n.target) not in params or n.name in zero2:
            continue
        if uses_of_tensor[params[str(n.target)]] > 1:
            continue
        node = n
        while len(node.users) == 1:
            (user,) = node.users
            if user.name not in followers:
                out.add(n.name)
                break
            node = user
    return out


def lower(gm: fx.GraphModule, strategies: dict[str, Strategy], mesh: MeshSpec, groups: Sequence[C.AxisGroup],
          root: torch.nn.Module, followers: set[str] = frozenset(),
          zero2: dict[str, tuple[int, ...]] | None = None, local_inputs: bool = False,
          local_outputs: bool = False, defer_grad_sync: bool = False,
          defer_param_syncs: bool = False, recompute: Sequence[str] = (),
          mixed_precision: MixedPrecision | None = None) -> fx.GraphModule:
    """The per-rank program of ``gm`` (see module doc). ``root`` holds the local parameter
    shards under the graph's ``get_attr`` targets; ``followers`` names the nodes the planner
    folded into their producer's decision (they keep their own gradient syncs); ``zero2`` maps
    ZeRO-2 parameter nodes to their zero axes (``root`` holds their flat pieces);
    ``local_inputs=True`` makes a program whose inputs are already this rank's pieces, and
    ``local_outputs=True`` one whose outputs stay cut as the plan leaves them.
    ``defer_grad_sync=True`` leaves out the gradient all-reduces that ``runtime.grad_buckets``
    can run bucketed and overlapped (``passes/defer_sync.py``); the program's
    ``meta[DEFERRED_KEY]`` maps each such parameter's target to its axes' AxisGroups.
    ``defer_param_syncs=True`` (pipelines: one program run per micro-batch) leaves out the
    gradient all-reduces of single-use parameters and lists them in the program's
    ``deferred_param_syncs``; the caller all-reduces those gradients once per step.
    ``recompute`` names the runs of repeated blocks (``Plan.recompute``) whose ops run under
    a checkpoint (``passes/recompute_regions.py``).
    ``mixed_precision`` (a ``runtime.mixed_precision.MixedPrecision``) runs the program in bf16
    on fp32 parameters, as that module describes; None keeps the traced dtypes."""
    lowering = _Lowering(gm, strategies, mesh, groups, set(followers), dict(zero2 or {}), root, local_inputs,
                         local_outputs, defer_grad_sync, defer_param_syncs, mixed_precision)
    graph = lowering.run()
    graph.lint()
    program = fx.GraphModule(root, graph)
    for name in (*lowering.groups.names, FSDP_ATTR):  # all of them, read by the graph or not: the model's state
        setattr(program, name, getattr(root, name))
    program.meta[DEFERRED_KEY] = {t: tuple(getattr(program, str(n.target)) for n in axes)
                                  for t, axes in lowering.deferred.items()}
    # (parameter target, mesh axis): gradient all-reduces the caller runs once per step
    program.deferred_param_syncs = sorted(lowering.step_deferred)
    return checkpoint_blocks(program, recompute)
