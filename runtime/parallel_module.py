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
from autopar.errors import AutoparError, BadArgumentError
from autopar.pipeline_info import microbatch_inputs
from autopar.pipeline_stages import hand_pipeline_plan
from autopar.planner import plan as make_plan
from autopar.mesh import MeshSpec
from autopar.passes.lower import DEFERRED_KEY, lower
from autopar.plan import Plan
from autopar.strategy import Layout, Strategy
from autopar.trace import graph_fingerprint, trace

from . import collectives as C
from .grad_buckets import GradBuckets
from .lazy import LazyParallelModule
from .pipeline import check_schedule, parallelize_plan_pipeline
from .materialize import ShardSource, adopt, has_meta, local_shard, trace_meta  # noqa: F401 (local_shard: public here too)
from .mixed_precision import policy_for
from .shard_info import tag_parameters
from .sharded_module import (ParallelModule, match_strategies, mesh_coords, plan_followers, release_weights, set_attr,
                             zero2_axes)

__all__ = ["parallelize", "ParallelModule", "parallelize_pipeline"]

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
        return parallelize_pipeline_options(model, example_inputs, device=device, **plan_options)
    gm = trace_meta(model, example_inputs, example_kwargs, device_type) if meta else \
        trace(model, example_inputs, example_kwargs)
    if plan is None:
        # auto pipelines only when asked (pipeline=True): a pipelined model is driven by
        # pm.step(*batch), not by pm(*batch) and loss.backward()
        options = dict(plan_options, pipeline=bool(plan_options.get("pipeline", False)))
        mesh = plan_options.get("mesh")
        staged = options["pipeline"] or options.get("strategy") == "pp" or "pp" in (
            mesh.axes if isinstance(mesh, MeshSpec) else MeshSpec.parse(mesh, n).axes if mesh else ())
        # a pipeline's stage plans are made for one micro-batch: the planner traces the model again
        the_plan = _plan_on_rank0(lambda: make_plan(model, n, example_inputs, model_name=type(model).__name__, **options)
                                  if staged else make_plan(gm, n, model_name=type(model).__name__, **options))
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
        return parallelize_plan_pipeline(model, example_inputs, the_plan, device)
    strategies = match_strategies(gm, the_plan)
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
    coords = mesh_coords(dist.get_rank(), mesh.sizes)
    groups = [C.AxisGroup(a, dm.get_group(a), s, c) for a, s, c in zip(mesh.axes, mesh.sizes, coords)]
    full = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    zero2 = zero2_axes(plan, gm)
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
                    set_attr(root, target, root.get_parameter(first), True)
                    continue
                if is_param:
                    shared[id(full[target])] = (target, layout)
                    first_node[target] = node.name
                tensor = full[target] if is_param else buffers.get(target)
                if tensor is None:
                    tensor = functools.reduce(getattr, target.split("."), gm)
                local = source.piece(target, tensor, layout, is_param)
                if node.name in zero2:  # the optimizer sees this rank's flat piece only
                    piece, local = local, C.zero2_shard(local, [groups[a] for a in sorted(zero2[node.name])])
                    source.replaced(piece, local)  # the layout piece is dropped
                    del piece
                if is_param and in_place:
                    adopted.append((full[target], full[target].data))
                    local = adopt(full[target], local)
                set_attr(root, target, local, is_param)
        followers = {name for name, n in plan_followers(plan).items()}
        program = lower(gm, strategies, mesh, groups, root, followers, zero2, defer_grad_sync=True,
                        recompute=plan.recompute, mixed_precision=mp)
    except BaseException:
        for param, before in reversed(adopted):
            adopt(param, before)
        raise
    finally:
        source.done()
    release_weights(gm)
    relower = functools.partial(lower, gm, strategies, mesh, groups, root, followers, zero2, defer_grad_sync=True,
                                recompute=plan.recompute, mixed_precision=mp)
    pm = ParallelModule(program, plan, strategies, gm, dm, coords, groups, relower)
    pm.__dict__["shard_source_peak_bytes"] = source.peak_bytes  # bench/load_memory.py reads it
    # Gradient all-reduces the lowering left out run bucketed and overlapped (runtime/grad_buckets.py).
    pm.grad_buckets = GradBuckets([(root.get_parameter(t), axes) for t, axes in program.meta[DEFERRED_KEY].items()],
                                  reduce_dtype=None if mp is None else mp.reduce_dtype)
    tag_parameters(pm.shards())  # optimizers that need whole-tensor norms read each Parameter's cut
    return pm


def _refuse_pipelined_mixed_precision(mixed_precision: bool) -> None:
    if mixed_precision:
        raise AutoparError("bf16 mixed precision does not run under pipelined plans yet (stages send fp32 "
                           "activations); pass mixed_precision=False, or plan without pipeline stages")


def _plan_on_rank0(make) -> Plan:
    """``make()`` on rank 0, its JSON broadcast; every rank learns of a failure."""
    text = None
    if dist.get_rank() == 0:
        try:
            text = make().to_json()
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            _broadcast_plan(_PLAN_FAILED + f"{type(exc).__name__}: {exc}")
            raise
    text = _broadcast_plan(text)
    if text.startswith(_PLAN_FAILED):
        raise AutoparError(f"planning on rank 0 failed: {text[len(_PLAN_FAILED):]}")
    return Plan.from_json(text)


def parallelize_pipeline(model: nn.Module, example_inputs: Sequence[Any], *, pp: int, n_microbatches: int,
                         schedule: str = "1f1b", stage_mesh: str | MeshSpec | None = None,
                         stage_blocks: Sequence[int] | None = None, virtual_stages: int = 1,
                         device: str | None = None, **plan_options):
    """Pipeline ``model`` over ``pp`` stage groups of the world (``runtime/pipeline.py``): rank 0
    plans each stage for one micro-batch on ``stage_mesh`` (``autopar.pipeline_stages``), every
    rank runs that plan. ``plan_options`` go to the planner of each stage (``strategy``,
    ``hardware``, ``memory_budget_bytes``, ``recompute``, ...)."""
    if not dist.is_initialized():
        raise AutoparError("pipeline parallelism needs torch.distributed: launch with torchrun")
    world = dist.get_world_size()
    check_schedule(schedule)
    microbatch_inputs(example_inputs, n_microbatches)  # a batch that cannot be cut fails here, on every rank
    the_plan = _plan_on_rank0(lambda: hand_pipeline_plan(
        model, example_inputs, world, pp=pp, n_microbatches=n_microbatches, schedule=schedule, stage_mesh=stage_mesh,
        stage_blocks=stage_blocks, virtual_stages=virtual_stages, plan_fn=make_plan, **plan_options))
    return parallelize_plan_pipeline(model, example_inputs, the_plan, device)


def parallelize_pipeline_options(model: nn.Module, example_inputs: Sequence[Any], *, mesh: str | MeshSpec | None = None,
                                 n_microbatches: int | None = None, schedule: str = "1f1b", device: str | None = None,
                                 virtual_stages: int = 1, stage_blocks: Sequence[int] | None = None, **plan_options):
    """``parallelize(model, example_inputs=..., mesh="pp=2,dp=2,tp=2", n_microbatches=4,
    schedule="1f1b")``: the pipeline pinned by hand; the stages' sharding is planned."""
    world = dist.get_world_size()
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise BadArgumentError(f"n_microbatches must be a positive integer dividing the batch, got {n_microbatches!r}; "
                               "e.g. n_microbatches=4")
    check_schedule(schedule)  # a schedule or batch that cannot work fails here, not after planning
    microbatch_inputs(example_inputs, n_microbatches)
    spec = MeshSpec.parse(mesh, world) if isinstance(mesh, str) else mesh
    if spec is None or not spec.axes or spec.axes[0] != "pp":
        raise AutoparError(f"n_microbatches/schedule ask for a pipeline, so the mesh needs a leading pp axis, "
                           f"e.g. mesh='pp=2,dp=2'; got {mesh!r}")
    rest = ",".join(f"{a}={s}" for a, s in zip(spec.axes[1:], spec.sizes[1:])) or None
    if plan_options.get("strategy") == "pp":  # the pipeline is pinned here; stages plan their own sharding
        plan_options.pop("strategy")
    plan_options.pop("baselines", None)
    plan_options.pop("pipeline", None)
    return parallelize_pipeline(model, example_inputs, pp=spec.sizes[0], n_microbatches=n_microbatches,
                                schedule=schedule, stage_mesh=rest, stage_blocks=stage_blocks,
                                virtual_stages=virtual_stages, device=device, **plan_options)
