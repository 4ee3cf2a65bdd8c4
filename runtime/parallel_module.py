"""autopar.parallelize: an unmodified model -> a module that trains across the ranks.

Under ``torchrun`` (or any initialized default process group) every rank calls
``parallelize(model, example_inputs=...)``. Rank 0 plans (or reads the given plan) and
broadcasts it, so all ranks run one plan. Each rank keeps only its shards of the parameters
(as ``nn.Parameter``, so any torch optimizer works on them) and runs the lowered program.

Feeding data: pass the *global* batch on every rank (each rank cuts its own slice, for free),
or read only the slice ``model.input_slices()`` names for this rank (so data loading at scale
reads each sample once) and call ``model(*pieces, local_inputs=True)``. Outputs come back whole, as
the single-device model returns them, or left cut with ``local_outputs=True`` (``output_slices``).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.cost_model.local_hardware import default_mixed_precision, local_hardware
from autopar.errors import AutoparError
from autopar.mesh import MeshSpec
from autopar.passes.annotate import STRATEGIES_KEY, annotate
from autopar.passes.lower import DEFERRED_KEY, FSDP_ATTR, lower
from autopar.plan import Plan
from autopar.planner import plan as make_plan
from autopar.strategy import Layout, Strategy
from autopar.trace import graph_fingerprint, trace

from . import collectives as C
from .fsdp import fsdp_gather, regather_saved_weights
from .grad_buckets import GradBuckets
from .lazy import LazyParallelModule
from .materialize import ShardSource, adopt, has_meta, local_shard, trace_meta
from .mixed_precision import policy_for
from .shard_info import ShardInfo, tag_parameters

__all__ = ["parallelize", "ParallelModule"]


def _coords(rank: int, sizes: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(sizes):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def _shard_slices(shape: Sequence[int], layout: Layout, coords, sizes) -> tuple[slice, ...]:
    bounds = [(0, s) for s in shape]
    for code, size, c in zip(layout.codes, sizes, coords):
        if code >= 0:
            lo, hi = bounds[code]
            step = (hi - lo) // size
            bounds[code] = (lo + c * step, lo + (c + 1) * step)
    return tuple(slice(lo, hi) for lo, hi in bounds)


def _set_attr(root: nn.Module, target: str, value: Any, is_param: bool) -> None:
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


def _match_strategies(gm: fx.GraphModule, plan: Plan) -> dict[str, Strategy]:
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


def _has_fsdp_gathers(program: fx.GraphModule) -> bool:
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
        # parameters() or state_dict()), its weights swapped for meta tensors (_release_weights).
        self.__dict__["_gm"] = gm
        self.device_mesh = device_mesh
        self._coords = coords
        self._groups = groups
        self._params = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
        self._inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._zero2 = _zero2_axes(plan, gm)
        # Per-model run-time state (nothing of it is process-wide): the axis groups above, the
        # ZeRO-3 gather state the lowering put on the program, and (set by _build) the buckets
        # of the gradient all-reduces the lowering left out.
        self.fsdp_state = getattr(program, FSDP_ATTR)
        self.grad_buckets: GradBuckets | None = None

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
        if not _has_fsdp_gathers(program):  # no saved-tensor hooks where nothing is re-gathered
            return program(*args, **kwargs)
        with regather_saved_weights(self.fsdp_state, program):  # ZeRO-3 weights are not kept gathered for backward (runtime/fsdp.py)
            return program(*args, **kwargs)

    def input_slices(self) -> list[tuple[slice, ...] | None]:
        """Per model input, the slice of the global tensor this rank uses (None: not a tensor)."""
        out = []
        for n in self._inputs:
            s = self._strategies.get(n.name)
            out.append(None if s is None else
                       _shard_slices(n.meta["val"].shape, s.output, self._coords, self.plan.mesh.sizes))
        return out

    def output_slices(self) -> list[tuple[slice, ...] | None]:
        """Per output tensor (in pytree-flattened order), the slice of the whole output this rank
        holds under ``local_outputs=True`` (None: not a tensor)."""
        out_node = next(n for n in self._gm.graph.nodes if n.op == "output")
        slices = []
        for leaf in torch.utils._pytree.tree_leaves(out_node.args[0]):
            s = self._strategies.get(leaf.name) if isinstance(leaf, fx.Node) else None
            slices.append(None if s is None else
                          _shard_slices(leaf.meta["val"].shape, s.outputs[0], self._coords, self.plan.mesh.sizes))
        return slices

    def shards(self) -> list[ShardInfo]:
        """What this rank holds of every parameter and buffer, and over which mesh axes it is
        split (``runtime/shard_info.py``). Tied weights appear once per name; later names set
        ``tied_to`` the first."""
        out: list[ShardInfo] = []
        first: dict[int, str] = {}
        for target, node in self._params.items():
            is_param = _is_param(self.program, target)
            local = self.program.get_parameter(target) if is_param else self.program.get_buffer(target)
            layout = self._strategies[node.name].output if node.name in self._strategies else None
            cuts = () if layout is None else tuple((a, c) for a, c in enumerate(layout.codes) if c >= 0)
            tied = first.setdefault(id(local), target)
            zero2 = tuple(sorted(self._zero2.get(node.name, ())))
            split = sorted({a for a, _ in cuts} | set(zero2))
            out.append(ShardInfo(target, local, is_param, tuple(node.meta["val"].shape), cuts, zero2,
                                 None if tied == target else tied, tuple(self._groups[a].group for a in split)))
        return out

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
                local = self.program.get_parameter(target) if _is_param(self.program, target) \
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
                if _is_param(self.program, target):
                    g = self.program.get_parameter(target).grad
                    out[target] = None if g is None else self._gather_full(g, node)
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
                dst = self.program.get_parameter(target) if _is_param(self.program, target) \
                    else self.program.get_buffer(target)
                if piece.shape != dst.shape:
                    raise ValueError(f"{target}: shape {tuple(state[target].shape)} does not fit the plan's "
                                     f"shard {tuple(dst.shape)}")
                dst.copy_(piece)


def _zero2_axes(plan: Plan, gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """Parameter nodes the plan keeps as ZeRO-2 pieces, and their zero axes."""
    params = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"} & \
        {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    targets = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return {n.name: tuple(n.zero_axes) for n in plan.nodes
            if n.zero_axes and targets.get(n.name) in params}


def _is_param(module: nn.Module, target: str) -> bool:
    try:
        module.get_parameter(target)
        return True
    except AttributeError:
        return False


_PLAN_FAILED = "autopar: planning failed\n"


def _broadcast_plan(plan_json: str | None) -> str:
    box = [plan_json]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def parallelize(model: nn.Module, n_gpus: int | None = None, example_inputs: Sequence[Any] | None = None, *,
                plan: Plan | str | None = None, example_kwargs: dict | None = None, device: str | None = None,
                weights: str | None = None, seed: int = 0, hardware=None, mixed_precision: bool | None = None,
                **plan_options) -> nn.Module:
    """Run ``model`` across the ranks of the default process group (see module doc).

    Without ``example_inputs``/``example_kwargs`` it returns a lazy module that plans on its
    first call (``runtime/lazy.py``). ``hardware`` defaults to where it runs and
    ``mixed_precision`` to bf16 on CUDA, fp32 on CPU (``cost_model/local_hardware.py``).
    ``weights=PATH`` reads each rank's slices of a safetensors checkpoint; a model on the meta
    device is materialized shard by shard (``runtime/materialize.py``, ``seed``)."""
    if example_inputs is None and example_kwargs is None:
        return LazyParallelModule(model, n_gpus, dict(plan=plan, device=device, weights=weights, seed=seed,
                                                      hardware=hardware, mixed_precision=mixed_precision,
                                                      **plan_options), parallelize_with_inputs)
    return parallelize_with_inputs(model, n_gpus, () if example_inputs is None else example_inputs, plan=plan,
                        example_kwargs=example_kwargs, device=device, weights=weights, seed=seed, hardware=hardware,
                        mixed_precision=mixed_precision, **plan_options)


def parallelize_with_inputs(model: nn.Module, n_gpus: int | None, example_inputs: Sequence[Any], *, plan=None,
                 example_kwargs=None, device=None, weights=None, seed=0, hardware=None, mixed_precision=None,
                 in_place: bool = False, **plan_options):
    """``parallelize`` with the inputs known (the lazy module calls it on its first batch with
    ``in_place=True``: the user's Parameter objects become the shards)."""
    if not dist.is_initialized():
        raise AutoparError("autopar.parallelize needs torch.distributed: launch with torchrun "
                           "(e.g. torchrun --nproc_per_node 4 train.py); it initializes the process group")
    world = dist.get_world_size()
    n = world if n_gpus is None else n_gpus
    if n != world:
        raise AutoparError(f"n_gpus={n} but the world size is {world}; launch {n} processes or drop n_gpus")
    device_type = _device_type(device)
    plan_options = dict(plan_options, hardware=local_hardware(hardware, device_type),
                        mixed_precision=default_mixed_precision(device_type) if mixed_precision is None
                        else mixed_precision)
    meta = has_meta(model)
    if meta and ("n_microbatches" in plan_options or "schedule" in plan_options or plan_options.get("pipeline")):
        raise AutoparError("a model on the meta device cannot be pipelined yet; build it on CPU, "
                           "or drop the pipeline options (n_microbatches, schedule, pipeline=True)")
    if "n_microbatches" in plan_options or "schedule" in plan_options:
        _refuse_pipelined_mixed_precision(bool(plan_options["mixed_precision"]))
        from .pipeline import parallelize_pipeline_options  # a pinned pipeline: pp= on the mesh

        return parallelize_pipeline_options(model, example_inputs, device=device, **plan_options)
    gm = trace_meta(model, example_inputs, example_kwargs, device_type) if meta else \
        trace(model, example_inputs, example_kwargs)
    if plan is None:
        text = None
        if dist.get_rank() == 0:
            try:
                # auto pipelines only when asked (pipeline=True): a pipelined model is driven by
                # pm.step(*batch), not by pm(*batch) and loss.backward()
                options = dict(plan_options, pipeline=bool(plan_options.get("pipeline", False)))
                text = make_plan(gm, n, model_name=type(model).__name__, **options).to_json()
            except Exception as exc:  # every rank must learn of it, or the others wait forever
                _broadcast_plan(_PLAN_FAILED + f"{type(exc).__name__}: {exc}")
                raise
        text = _broadcast_plan(text)
        if text.startswith(_PLAN_FAILED):
            raise AutoparError(f"planning on rank 0 failed: {text[len(_PLAN_FAILED):]}")
        the_plan = Plan.from_json(text)
    else:
        the_plan = plan if isinstance(plan, Plan) else Plan.from_json(plan)
    if the_plan.n_devices != world:
        raise AutoparError(f"the plan is for {the_plan.n_devices} devices but the world size is {world}; "
                           f"re-plan with autopar.plan(model, {world}, ...) or launch {the_plan.n_devices} processes")
    if the_plan.graph_fingerprint and the_plan.graph_fingerprint != graph_fingerprint(gm):
        raise AutoparError(f"the plan was made for another model or other input shapes (plan of "
                           f"{the_plan.model!r}, graph fingerprint {the_plan.graph_fingerprint}; this model's is "
                           f"{graph_fingerprint(gm)}); re-plan with autopar.plan(model, {world}, example_inputs)")
    if the_plan.pipeline is not None:  # stages on sub-meshes, run by a pipeline schedule: pm.step(*batch)
        _refuse_pipelined_mixed_precision(the_plan.mixed_precision)
        from .pipeline import parallelize_plan_pipeline

        return parallelize_plan_pipeline(model, example_inputs, the_plan, device, plan_options)
    strategies = _match_strategies(gm, the_plan)
    return _build(model, gm, the_plan, strategies, device_type, weights, seed, in_place)


def _device_type(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")


def _build(model: nn.Module, gm: fx.GraphModule, plan: Plan, strategies: dict[str, Strategy], device_type: str,
           weights: str | None = None, seed: int = 0, in_place: bool = False) -> ParallelModule:
    """Each rank's shards (``runtime/materialize.py``) and the lowered program. ``in_place``: the
    user's own Parameter objects become the shards (restored if building fails)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh: MeshSpec = plan.mesh
    mp = policy_for(plan.mixed_precision)
    # The model's own process groups: without a backend override DeviceMesh reuses the default
    # group for an axis spanning the whole world, and two models would share it.
    dm = init_device_mesh(device_type, mesh.sizes, mesh_dim_names=mesh.axes,
                          backend_override={a: dist.get_backend() for a in mesh.axes})
    coords = _coords(dist.get_rank(), mesh.sizes)
    groups = [C.AxisGroup(a, dm.get_group(a), s, c) for a, s, c in zip(mesh.axes, mesh.sizes, coords)]
    full = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    zero2 = _zero2_axes(plan, gm)
    root = nn.Module()
    shared: dict[int, tuple[str, Layout]] = {}  # tied weights: one local Parameter for all names
    first_node: dict[str, str] = {}
    source = ShardSource(model, coords, mesh.sizes, weights, seed)
    adopted: list[tuple[nn.Parameter, torch.Tensor]] = []  # (user Parameter, what it held): undone on failure
    try:
        with torch.no_grad():
            for node in gm.graph.nodes:
                if node.op != "get_attr":
                    continue
                target = str(node.target)
                is_param = target in full
                layout = strategies[node.name].output if node.name in strategies else Layout.replicated(mesh.ndim)
                if is_param and id(full[target]) in shared:
                    first, first_layout = shared[id(full[target])]
                    if first_layout != layout or zero2.get(node.name) != zero2.get(first_node[first]):
                        raise AutoparError(f"tied parameters {first} and {target} were planned with different "
                                           f"layouts ({first_layout} vs {layout}, or ZeRO-2 axes); untie them or "
                                           f"pin one layout")
                    _set_attr(root, target, root.get_parameter(first), True)
                    continue
                if is_param:
                    shared[id(full[target])] = (target, layout)
                    first_node[target] = node.name
                tensor = full[target] if is_param else buffers.get(target)
                if tensor is None:
                    tensor = functools.reduce(getattr, target.split("."), gm)
                local = source.piece(target, tensor, layout, is_param)
                if node.name in zero2:  # the optimizer sees this rank's flat piece only
                    local = C.zero2_shard(local, [groups[a] for a in sorted(zero2[node.name])])
                if is_param and in_place:
                    adopted.append((full[target], full[target].data))
                    local = adopt(full[target], local)
                _set_attr(root, target, local, is_param)
        followers = {name for name, n in plan_followers(plan).items()}
        program = lower(gm, strategies, mesh, groups, root, followers, zero2, defer_grad_sync=True,
                        recompute=plan.recompute, mixed_precision=mp)
    except BaseException:
        for param, before in reversed(adopted):
            adopt(param, before)
        raise
    finally:
        source.done()
    _release_weights(gm)
    relower = functools.partial(lower, gm, strategies, mesh, groups, root, followers, zero2, defer_grad_sync=True,
                                recompute=plan.recompute, mixed_precision=mp)
    pm = ParallelModule(program, plan, strategies, gm, dm, coords, groups, relower)
    pm.__dict__["shard_source_peak_bytes"] = source.peak_bytes  # bench/load_memory.py reads it
    # Gradient all-reduces the lowering left out run bucketed and overlapped (runtime/grad_buckets.py).
    pm.grad_buckets = GradBuckets([(root.get_parameter(t), axes) for t, axes in program.meta[DEFERRED_KEY].items()],
                                  reduce_dtype=None if mp is None else mp.reduce_dtype)
    tag_parameters(pm.shards())  # optimizers that need whole-tensor norms read each Parameter's cut
    return pm


def _device_type(device: str | None) -> str:
    return device or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")


def _refuse_pipelined_mixed_precision(mixed_precision: bool) -> None:
    if mixed_precision:
        raise AutoparError("bf16 mixed precision does not run under pipelined plans yet (stages send fp32 "
                           "activations); pass mixed_precision=False, or plan without pipeline stages")


def _release_weights(gm: fx.GraphModule) -> None:
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
