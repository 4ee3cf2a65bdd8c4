"""The per-rank module that runs a lowered plan (``ParallelModule``) and the helpers that build
one: rank coordinates on a mesh, a shard's slices, matching a plan's strategies to a traced
graph, ZeRO-2 axes, releasing the traced weights. ``parallel_module`` builds it for the whole
world, ``pipeline`` for each stage on its sub-mesh; both import it from here.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError
from autopar.passes.annotate import STRATEGIES_KEY, annotate
from autopar.passes.lower import FSDP_ATTR
from autopar.plan import Plan
from autopar.strategy import Layout, Strategy

from . import collectives as C
from .fsdp import fsdp_gather, regather_saved_weights
from .materialize import local_shard
from .shard_info import ShardInfo

__all__ = ["ParallelModule", "mesh_coords", "shard_slices", "set_attr", "match_strategies", "has_fsdp_gathers",
           "zero2_axes", "is_parameter", "release_weights", "plan_followers"]


def mesh_coords(rank: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def shard_slices(shape: Sequence[int], layout: Layout, coords, sizes) -> tuple[slice, ...]:
    bounds = [(0, s) for s in shape]
    for code, size, c in zip(layout.codes, sizes, coords):
        if code >= 0:
            lo, hi = bounds[code]
            step = (hi - lo) // size
            bounds[code] = (lo + c * step, lo + (c + 1) * step)
    return tuple(slice(lo, hi) for lo, hi in bounds)


def set_attr(root: nn.Module, target: str, value: Any, is_param: bool) -> None:
    *path, name = target.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if is_param:
        mod.register_parameter(name, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        mod.register_buffer(name, value)


def match_strategies(gm: fx.GraphModule, plan: Plan) -> dict[str, Strategy]:
    annotate(gm, plan.mesh)
    chosen: dict[str, Strategy] = {}
    names = {n.name for n in gm.graph.nodes if n.meta.get(STRATEGIES_KEY)}
    planned = {n.name: n for n in plan.nodes}
    missing = sorted(names - set(planned))
    if missing:
        raise AutoparError(
            f"the plan does not match this model: {len(missing)} graph nodes have no strategy in it "
            f"(e.g. {', '.join(missing[:3])}); was it made for another model? Re-plan with autopar.plan")
    for node in gm.graph.nodes:
        if node.name not in names:
            continue
        options = {str(s): s for s in node.meta[STRATEGIES_KEY]}
        want = planned[node.name].strategy
        if want not in options:
            raise AutoparError(f"the plan's strategy {want!r} for node {node.name} is not valid for this model "
                               f"on mesh {plan.mesh}; was the plan made for other shapes? Re-plan with autopar.plan")
        chosen[node.name] = options[want]
    return chosen


def has_fsdp_gathers(program: fx.GraphModule) -> bool:
    """Whether ``program`` gathers ZeRO-3 weights whose backward re-gathers (cached on it)."""
    found = program.meta.get("autopar_fsdp_gathers")
    if found is None:
        found = program.meta["autopar_fsdp_gathers"] = any(
            n.op == "call_function" and n.target is fsdp_gather for n in program.graph.nodes)
    return found

class ParallelModule(nn.Module):
    """The per-rank module ``parallelize`` returns. ``.plan`` is the plan it runs."""

    def __init__(self, program: fx.GraphModule, plan: Plan, strategies: dict[str, Strategy], gm: fx.GraphModule,
                 device_mesh, coords: tuple[int, ...], groups: list[C.AxisGroup], relower=None):
        super().__init__()
        self.program = program
        self.__dict__["_relower"] = relower  # builds the local-inputs/outputs programs on first use
        self.__dict__["_variants"] = {}
        self.plan = plan
        self._strategies = strategies
        # The traced graph, for its nodes and shapes only: kept outside the module tree (not in
        # parameters() or state_dict()), its weights swapped for meta tensors (release_weights).
        self.__dict__["_gm"] = gm
        self.device_mesh = device_mesh
        self._coords = coords
        self._groups = groups
        self._params = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
        self._inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._zero2 = zero2_axes(plan, gm)
        # Per-model run-time state (nothing of it is process-wide): the axis groups above, the
        # ZeRO-3 gather state the lowering put on the program, and (set by the builder) the
        # buckets of the gradient all-reduces the lowering left out.
        self.fsdp_state = getattr(program, FSDP_ATTR)
        self.grad_buckets = None

    @property
    def axis_groups(self) -> tuple[C.AxisGroup, ...]:
        """This model's AxisGroup per mesh axis (its own process groups, this rank's coordinates)."""
        return tuple(self._groups)

    def forward(self, *args, local_inputs: bool = False, local_outputs: bool = False, **kwargs):
        """Run one step's forward. Inputs are global tensors (every rank passes the whole batch),
        or, with ``local_inputs=True``, each rank's own pieces as ``input_slices`` names them.
        Outputs come back whole, or with ``local_outputs=True`` as this rank's pieces
        (``output_slices``; partial sums are reduced)."""
        program = self.program
        if local_inputs or local_outputs:
            key = (local_inputs, local_outputs)
            if key not in self._variants:
                self._variants[key] = self._relower(local_inputs=local_inputs, local_outputs=local_outputs)
            program = self._variants[key]
        if not has_fsdp_gathers(program):  # no saved-tensor hooks where nothing is re-gathered
            return program(*args, **kwargs)
        with regather_saved_weights(self.fsdp_state, program):  # ZeRO-3 weights are not kept gathered for backward (runtime/fsdp.py)
            return program(*args, **kwargs)

    def input_slices(self) -> list[tuple[slice, ...] | None]:
        """Per model input, the slice of the global tensor this rank uses (None: not a tensor)."""
        out = []
        for n in self._inputs:
            s = self._strategies.get(n.name)
            out.append(None if s is None else
                       shard_slices(n.meta["val"].shape, s.output, self._coords, self.plan.mesh.sizes))
        return out

    def output_slices(self) -> list[tuple[slice, ...] | None]:
        """Per output tensor (in pytree-flattened order), the slice of the whole output this rank
        holds under ``local_outputs=True`` (None: not a tensor)."""
        out_node = next(n for n in self._gm.graph.nodes if n.op == "output")
        slices = []
        for leaf in torch.utils._pytree.tree_leaves(out_node.args[0]):
            s = self._strategies.get(leaf.name) if isinstance(leaf, fx.Node) else None
            slices.append(None if s is None else
                          shard_slices(leaf.meta["val"].shape, s.outputs[0], self._coords, self.plan.mesh.sizes))
        return slices

    def shards(self) -> list[ShardInfo]:
        """What this rank holds of every parameter and buffer, and over which mesh axes it is
        split (``runtime/shard_info.py``). Tied weights appear once per name; later names set
        ``tied_to`` the first."""
        out: list[ShardInfo] = []
        first: dict[int, str] = {}
        for target, node in self._params.items():
            is_param = is_parameter(self.program, target)
            local = self.program.get_parameter(target) if is_param else self.program.get_buffer(target)
            layout = self._strategies[node.name].output if node.name in self._strategies else None
            cuts = () if layout is None else tuple((a, c) for a, c in enumerate(layout.codes) if c >= 0)
            tied = first.setdefault(id(local), target)
            zero2 = tuple(sorted(self._zero2.get(node.name, ())))
            split = sorted({a for a, _ in cuts} | set(zero2))
            out.append(ShardInfo(target, local, is_param, tuple(node.meta["val"].shape), cuts, zero2,
                                 None if tied == target else tied, tuple(self._groups[a].group for a in split)))
        return out

    def axis_group_of(self, axis: int) -> C.AxisGroup:
        """Mesh axis ``axis`` as the collectives take it (``runtime.collectives.AxisGroup``)."""
        return self._groups[axis]

    def axis_group(self, axis: int):
        """The torch.distributed process group of mesh axis ``axis`` (this rank's line along it)."""
        return self._groups[axis].group

    def _zero2_groups(self, node: fx.Node) -> list[C.AxisGroup]:
        return [self._groups[a] for a in sorted(self._zero2[node.name])]

    def _storage_shape(self, node: fx.Node) -> tuple[int, ...]:
        return self._strategies[node.name].output.local_shape(self.plan.mesh, node.meta["val"].shape)

    def _gather_full(self, local: torch.Tensor, node: fx.Node) -> torch.Tensor:
        layout = self._strategies[node.name].output
        t = local.detach()
        if node.name in self._zero2:  # a flat ZeRO-2 piece: first the whole local tensor
            t = C.zero2_unshard(t, self._storage_shape(node), self._zero2_groups(node))
        for a in reversed(range(len(layout.codes))):  # innermost cut first keeps pieces in order
            if layout.codes[a] >= 0:
                t = C.gather_tensor(t, layout.codes[a], self._groups[a])
        return t

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded parameters and buffers, on every rank (gathers are not byte-counted)."""
        C.COUNTER.enabled = False
        try:
            out = {}
            for target, node in self._params.items():
                local = self.program.get_parameter(target) if is_parameter(self.program, target) \
                    else self.program.get_buffer(target)
                out[target] = self._gather_full(local, node)
            return out
        finally:
            C.COUNTER.enabled = True

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """The unsharded gradient of every parameter (for checks against a single-device run)."""
        C.COUNTER.enabled = False
        try:
            out = {}
            for target, node in self._params.items():
                if is_parameter(self.program, target):
                    g = self.program.get_parameter(target).grad
                    full = None if g is None else self._gather_full(g, node)
                    # a replicated gradient is the bucket's slot (runtime/grad_buckets.py), which
                    # the next backward overwrites: a copy, so the result stays as it was
                    out[target] = full.clone() if full is not None and full.data_ptr() == g.data_ptr() else full
            return out
        finally:
            C.COUNTER.enabled = True

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded tensors (e.g. a single-device checkpoint): each rank keeps its shard."""
        with torch.no_grad():
            for target, node in self._params.items():
                if target not in state:
                    raise KeyError(f"state dict has no entry {target!r}")
                layout = self._strategies[node.name].output
                piece = local_shard(state[target], layout, self._coords, self.plan.mesh.sizes)
                if node.name in self._zero2:
                    piece = C.zero2_shard(piece, self._zero2_groups(node))
                dst = self.program.get_parameter(target) if is_parameter(self.program, target) \
                    else self.program.get_buffer(target)
                if piece.shape != dst.shape:
                    raise ValueError(f"{target}: shape {tuple(state[target].shape)} does not fit the plan's "
                                     f"shard {tuple(dst.shape)}")
                dst.copy_(piece)


def zero2_axes(plan: Plan, gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Parameter nodes the plan keeps as ZeRO-2 pieces, and their zero axes."""
    params = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"} & \
        {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    targets = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return {n.name: tuple(n.zero_axes) for n in plan.nodes
            if n.zero_axes and targets.get(n.name) in params}


def is_parameter(module: nn.Module, target: str) -> bool:
    try:
        module.get_parameter(target)
        return True
    except AttributeError:
        return False



def release_weights(gm: fx.GraphModule) -> None:
    """Rebind the traced graph's weights to meta tensors of the same shapes: each rank keeps
    only its shards. The user's own model and its tensors are left as they were (names are
    rebound in the graph module only; no tensor is changed)."""
    for mod in gm.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.device.type != "meta":
                mod._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device.type != "meta":
                mod._buffers[name] = torch.empty_like(b, device="meta")
    for name, value in list(vars(gm).items()):  # constants export attaches as plain attributes
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.device.type != "meta":
            setattr(gm, name, torch.empty_like(value, device="meta"))


def plan_followers(plan: Plan) -> dict[str, str]:
    """Nodes the planner folded into another node's decision (a follower adopts its producer's layout)."""
    return {n.name: n.follows for n in plan.nodes if getattr(n, "follows", "")}
