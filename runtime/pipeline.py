"""Pipeline parallelism at run time: stages on sub-meshes, run by torch.distributed.pipelining.

The world is a mesh ``pp x (sub-mesh)``: ``pp`` outermost, so a stage's ranks are consecutive
(inside a node when the sub-mesh fits one) and the pipeline crosses the outer links. Each stage
is one piece of the traced graph (``passes.split_stages``, cut between repeated blocks), planned
on the sub-mesh by the ordinary planner for one micro-batch and lowered by the ordinary
lowering: tensor / data parallelism and ZeRO inside a stage are layouts, as without pipelining.
A stage hands its successor whole tensors (the lowering makes outputs whole and cuts inputs), so
rank r of stage k sends to rank r of stage k + 1, whatever layouts the two plans chose.

The schedules are torch's own (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``).
The last stage computes the model's loss itself (it is part of the traced graph), so the
schedule's ``loss_fn`` only takes that value out of the stage's output.

What the user calls (a pipeline runs forward and backward together, so there is no separate
``loss.backward()``)::

    pm = parallelize(model, example_inputs=batch, mesh="pp=2,dp=2,tp=2", n_microbatches=4,
                     schedule="1f1b")                  # or parallelize_pipeline(...)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)  # this rank's stage shards
    loss = pm.step(*batch)                             # forward + backward of the global batch
    opt.step(); opt.zero_grad()

``step`` returns the batch's loss (the mean of the micro-batch losses, equal to the full-batch
loss of a mean-reduced loss) on every rank, and leaves the gradients of the batch in ``.grad``.

Gradient synchronization: a stage program runs once per micro-batch, so the lowering leaves out
the gradient all-reduces of parameters with a single use (nearly all weights) and ``step`` runs
them once, after the schedule (gradients summed over micro-batches first: the same result, 1/m
of the traffic). Syncs of parameters used twice still run per micro-batch. Known cost: the
tensors handed between stages are whole, not cut as the sub-mesh holds them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError, BadArgumentError
from autopar.mesh import MeshSpec
from autopar.passes.lower import lower
from autopar.passes.split_stages import block_count, even_stage_blocks, split_stages
from autopar.plan import Plan
from autopar.strategy import Layout
from autopar.trace import trace

from . import collectives as C
from .parallel_module import (ParallelModule, _coords, _match_strategies, _release_weights, _set_attr, _zero2_axes,
                              local_shard, plan_followers)

__all__ = ["parallelize_pipeline", "PipelineModule", "SCHEDULES", "saved_activation_bytes", "parallelize_plan_pipeline",
           "parallelize_pipeline_options"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
    if name not in classes:
        raise AutoparError(f"unknown pipeline schedule {name!r}; pick one of {', '.join(SCHEDULES)}")
    return classes[name]


def _loss_of(output: Any, _target: Any) -> torch.Tensor:
    """The schedule's loss_fn: the last stage already returns the model's loss."""
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output


class PipelineModule(nn.Module):
    """This rank's pipeline stages (``stages``: ParallelModules on the stage sub-mesh) and the
    schedule that runs them. ``plans[k]`` is stage k's plan (one micro-batch on the sub-mesh)."""

    def __init__(self, stages: list[ParallelModule], stage_ids: list[int], schedule, plans: list[Plan],
                 stage_blocks: tuple[int, ...], n_microbatches: int, schedule_name: str,
                 pp_group, pp_ranks: list[int], device_mesh):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.stage_ids = stage_ids
        self.plans = plans
        self.stage_blocks = stage_blocks
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule_name
        self.device_mesh = device_mesh
        self.__dict__["_schedule"] = schedule
        self.__dict__["_pp_group"] = pp_group
        self._pp_ranks = pp_ranks  # global ranks of this rank's pipeline, stage order of the pp axis

    @property
    def n_stages(self) -> int:
        return len(self.plans)

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one global batch (every rank may pass it; only the first
        stage reads it). Returns the batch loss on every rank; gradients are in ``.grad``."""
        first = 0 in self.stage_ids
        last = self.n_stages - 1 in self.stage_ids
        losses: list[torch.Tensor] = []
        # The loss is computed inside the last stage; the schedule still wants one target per
        # micro-batch to hand its loss_fn, so it gets a placeholder it splits and ignores.
        target = torch.zeros(self.n_microbatches) if last else None
        self._schedule.step(*(inputs if first else ()), target=target, losses=losses, return_outputs=False)
        self._sync_deferred_grads()
        loss = torch.stack([x.detach() for x in losses]).mean() if last else torch.zeros(())
        # Every rank learns the loss from the rank that holds the last stage in its pipeline.
        dist.broadcast(loss, src=self._pp_ranks[-1], group=self._pp_group)
        return loss

    def _sync_deferred_grads(self) -> None:
        """The gradient all-reduces the stage programs left for the end of the step (their
        parameters' only use is partial on the axis): once per step, not once per micro-batch."""
        with torch.no_grad():
            for stage in self.stages:
                for target, axis in stage.program.deferred_param_syncs:
                    p = stage.program.get_parameter(target)
                    if p.grad is not None:
                        p.grad.copy_(C.sum_tensor(p.grad, stage._groups[axis]))

    def deferred_sync_bytes(self) -> dict[str, float]:
        """Bytes this rank sends for the once-per-step gradient all-reduces (ring formula)."""
        from autopar.cost_model.comm import bytes_sent_per_rank

        total = 0.0
        for stage in self.stages:
            for target, axis in stage.program.deferred_param_syncs:
                p = stage.program.get_parameter(target)
                total += bytes_sent_per_rank("all_reduce", p.numel() * p.element_size(), stage._groups[axis].size)
        return {"all_reduce": total} if total else {}

    def forward(self, *args, **kwargs):
        raise AutoparError("a pipelined model runs forward and backward together: call pm.step(*batch) "
                           "(returns the loss, leaves gradients in .grad), then opt.step()")

    def _gather_dicts(self, per_stage: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        merged: dict[str, torch.Tensor] = {}
        for d in per_stage:
            merged.update(d)
        box: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(box, merged)
        out: dict[str, torch.Tensor] = {}
        for d in box:
            out.update(d)
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters of every stage, on every rank (names as in the user's model)."""
        return self._gather_dicts([s.full_state_dict() for s in self.stages])

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Unsharded gradients of every stage's parameters, on every rank."""
        return self._gather_dicts([s.full_grads() for s in self.stages])


def _stage_module(gm: fx.GraphModule, plan: Plan, full: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                  dm_sub, groups: list[C.AxisGroup], coords: tuple[int, ...]) -> ParallelModule:
    """One stage's ParallelModule: its weights cut to this rank's shards, its lowered program.
    (parallel_module._build does the same for a whole world; a stage's mesh is a sub-mesh and
    its weights were broadcast once for the whole model, so this is its own short builder.)"""
    strategies = _match_strategies(gm, plan)
    mesh = plan.mesh
    zero2 = _zero2_axes(plan, gm)
    root = nn.Module()
    first_target: dict[int, str] = {}  # tied weights inside a stage: one local Parameter
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            target = str(node.target)
            if target in full and id(full[target]) in first_target:
                _set_attr(root, target, root.get_parameter(first_target[id(full[target])]), True)
                continue
            if target in full:
                first_target[id(full[target])] = target
            layout = strategies[node.name].output if node.name in strategies else Layout.replicated(mesh.ndim)
            is_param = target in full
            tensor = full[target] if is_param else buffers.get(target)
            if tensor is None:
                tensor = functools.reduce(getattr, target.split("."), gm)
            local = local_shard(tensor.detach().clone(), layout, coords, mesh.sizes)
            if node.name in zero2:
                local = C.zero2_shard(local, [groups[a] for a in sorted(zero2[node.name])])
            _set_attr(root, target, local, is_param)
    followers = set(plan_followers(plan))
    program = lower(gm, strategies, mesh, groups, root, followers, zero2, defer_param_syncs=True,
                    recompute=plan.recompute)
    relower = functools.partial(lower, gm, strategies, mesh, groups, root, followers, zero2, defer_param_syncs=True,
                                recompute=plan.recompute)
    _release_weights(gm)
    return ParallelModule(program, plan, strategies, gm, dm_sub, coords, groups, relower)


def _plan_stages(stage_gms, sub: MeshSpec, model_name: str, plan_options: dict) -> list[str]:
    """Rank 0 plans every stage for one micro-batch on the sub-mesh; all ranks get the JSON."""
    from autopar.planner import plan as make_plan

    texts: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            texts = [[make_plan(g, sub.n_devices, mesh=sub if sub.ndim else None, baselines=False,
                                model_name=f"{model_name}/stage{k}", **plan_options).to_json()
                      for k, g in enumerate(stage_gms)]]
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            texts = [f"{type(exc).__name__}: {exc}"]
            dist.broadcast_object_list(texts, src=0)
            raise
    dist.broadcast_object_list(texts, src=0)
    if isinstance(texts[0], str):
        raise AutoparError(f"planning the pipeline stages on rank 0 failed: {texts[0]}")
    return texts[0]


def _rank0_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as rank 0 has it (copies; the user's model is left alone), tied names
    sharing one tensor."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in copies:
                t = p.detach().clone()
                dist.broadcast(t, src=0)
                copies[id(p)] = t
            out[name] = copies[id(p)]
    return out


def _example_args(gm: fx.GraphModule, grad_in: bool, dev: torch.device) -> tuple[tuple, tuple]:
    """Stage inputs and outputs as empty tensors of their (micro-batch) shapes. Given both,
    PipelineStage skips its run-time shape inference, which would run the stage program (and
    its collectives) on uninitialized tensors: integer targets out of range break the loss."""
    def empty(node: fx.Node, grad: bool) -> torch.Tensor:
        val = node.meta["val"]
        t = torch.zeros(tuple(val.shape), dtype=val.dtype, device=dev)
        return t.requires_grad_(grad and val.dtype.is_floating_point)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = torch.utils._pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    return (tuple(empty(n, grad_in) for n in placeholders),
            tuple(empty(n, True) for n in outputs if isinstance(n, fx.Node)))


def _microbatch(inputs: Sequence[Any], m: int) -> tuple[Any, ...]:
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % m:
                raise AutoparError(f"an input of shape {tuple(x.shape)} cannot be cut into {m} equal micro-batches "
                                   f"along dim 0; pick n_microbatches dividing the batch size")
            x = x[: x.shape[0] // m]
        out.append(x)
    return tuple(out)


def parallelize_pipeline(model: nn.Module, example_inputs: Sequence[Any], *, pp: int, n_microbatches: int,
                         schedule: str = "1f1b", stage_mesh: str | MeshSpec | None = None,
                         stage_blocks: Sequence[int] | None = None, virtual_stages: int = 1,
                         device: str | None = None, **plan_options) -> PipelineModule:
    """Pipeline ``model`` over ``pp`` stage groups of the world (see module doc).

    ``example_inputs`` is one global batch. ``stage_mesh`` is the mesh inside a stage (e.g.
    ``"dp=2,tp=2"``; default: one axis over world / pp ranks); ``stage_blocks`` the blocks per
    stage (default: as even as they divide); ``virtual_stages`` > 1 (interleaved-1f1b) gives each
    rank that many stages, round robin. ``plan_options`` go to the planner of each stage
    (``strategy``, ``hardware``, ``memory_budget_bytes``, ...)."""
    if not dist.is_initialized():
        raise AutoparError("pipeline parallelism needs torch.distributed: launch with torchrun")
    world = dist.get_world_size()
    if pp < 1 or world % pp:
        raise AutoparError(f"pp={pp} does not divide the world size {world}; pick pp among the divisors of {world}")
    cls = _schedule_class(schedule)
    v = int(virtual_stages)
    if (v > 1) != (schedule == "interleaved-1f1b"):
        raise AutoparError(f"schedule {schedule!r} with virtual_stages={v}: interleaved-1f1b needs virtual_stages >= 2 "
                           f"and the others run one stage per rank")
    n_sub = world // pp
    sub = MeshSpec.parse(stage_mesh, n_sub) if isinstance(stage_mesh, str) else stage_mesh
    if sub is None:
        sub = MeshSpec.parse(f"dp={n_sub}", n_sub)
    if sub.n_devices != n_sub:
        raise AutoparError(f"stage mesh {sub} has {sub.n_devices} devices but world {world} / pp {pp} = {n_sub}; "
                           f"pick a stage mesh of {n_sub} devices")
    if "pp" in sub.axes:
        raise AutoparError("the stage mesh cannot itself have a pp axis; give pp= separately")
    full = _rank0_weights(model)
    gm = trace(model, _microbatch(example_inputs, n_microbatches))
    n_stages = pp * v
    blocks = tuple(stage_blocks) if stage_blocks is not None else even_stage_blocks(block_count(gm), n_stages)
    if len(blocks) != n_stages:
        raise AutoparError(f"stage_blocks {blocks} names {len(blocks)} stages, but pp={pp} x virtual_stages={v} "
                           f"= {n_stages}")
    stage_gms = split_stages(gm, blocks)
    plans = [Plan.from_json(t) for t in _plan_stages(stage_gms, sub, type(model).__name__, plan_options)]

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    device_type = device or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    dm = init_device_mesh(device_type, (pp, *sub.sizes), mesh_dim_names=("pp", *sub.axes))
    rank = dist.get_rank()
    pp_index, sub_rank = divmod(rank, n_sub)
    coords = _coords(sub_rank, sub.sizes)  # init_device_mesh lays ranks out row-major, pp outermost
    groups = [C.AxisGroup(a, dm.get_group(a), s, c) for a, s, c in zip(sub.axes, sub.sizes, coords)]
    pp_group = dm.get_group("pp")
    pp_ranks = [dist.get_global_rank(pp_group, i) for i in range(pp)]
    buffers = dict(model.named_buffers())
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    stage_ids = [pp_index + j * pp for j in range(v)]  # round robin: interleaved schedules expect it
    modules, pipe_stages = [], []
    for s in stage_ids:
        pm = _stage_module(stage_gms[s], plans[s], full, buffers, dm[sub.axes], groups, coords)
        modules.append(pm)
        ins, outs = _example_args(stage_gms[s], s > 0, dev)
        pipe_stages.append(PipelineStage(pm, s, n_stages, dev, input_args=ins, output_args=outs, group=pp_group))
    sched = cls(pipe_stages if v > 1 else pipe_stages[0], n_microbatches, loss_fn=_loss_of)
    return PipelineModule(modules, stage_ids, sched, plans, blocks, n_microbatches, schedule, pp_group, pp_ranks, dm)


def parallelize_plan_pipeline(model: nn.Module, example_inputs: Sequence[Any], plan: Plan, device: str | None,
                              plan_options: dict) -> PipelineModule:
    """``parallelize`` with a plan that has pipeline stages: run its stages, micro-batches and
    schedule; each stage is planned again for one micro-batch on the plan's stage mesh."""
    info = plan.pipeline
    world = dist.get_world_size()
    if plan.n_devices != world:
        raise AutoparError(f"the plan is for {plan.n_devices} devices but the world size is {world}; "
                           f"re-plan with autopar.plan(model, {world}, ...) or launch {plan.n_devices} processes")
    options = {k: v for k, v in plan_options.items() if k not in ("strategy", "mesh", "baselines")}
    options.setdefault("hardware", plan.hardware)
    options["recompute"] = "full" if info.recompute else "none"  # the stages recompute as the plan priced them
    return parallelize_pipeline(model, example_inputs, pp=info.n_stages, n_microbatches=info.n_microbatches,
                                schedule=info.schedule, stage_mesh=info.stage_mesh, stage_blocks=info.stage_blocks,
                                virtual_stages=info.virtual_stages, device=device, **options)


def parallelize_pipeline_options(model: nn.Module, example_inputs: Sequence[Any], *, mesh: str | MeshSpec | None = None,
                                 n_microbatches: int | None = None, schedule: str = "1f1b", device: str | None = None,
                                 virtual_stages: int = 1, stage_blocks: Sequence[int] | None = None,
                                 **plan_options) -> PipelineModule:
    """``parallelize(model, example_inputs=..., mesh="pp=2,dp=2,tp=2", n_microbatches=4,
    schedule="1f1b")``: the pipeline pinned by hand; the stages' sharding is planned."""
    world = dist.get_world_size()
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise BadArgumentError(f"n_microbatches must be a positive integer dividing the batch, got {n_microbatches!r}; "
                               "e.g. n_microbatches=4")
    # a schedule or batch that cannot work fails here, not after planning
    _schedule_class(schedule)
    _microbatch(example_inputs, n_microbatches)
    spec = MeshSpec.parse(mesh, world) if isinstance(mesh, str) else mesh
    if spec is None or not spec.axes or spec.axes[0] != "pp":
        raise AutoparError(f"n_microbatches/schedule ask for a pipeline, so the mesh needs a leading pp axis, "
                           f"e.g. mesh='pp=2,dp=2'; got {mesh!r}")
    rest = ",".join(f"{a}={s}" for a, s in zip(spec.axes[1:], spec.sizes[1:])) or None
    if plan_options.get("strategy") == "pp":  # the pipeline is pinned here; stages plan their own sharding
        plan_options.pop("strategy")
    plan_options.pop("baselines", None)
    return parallelize_pipeline(model, example_inputs, pp=spec.sizes[0], n_microbatches=n_microbatches,
                                schedule=schedule, stage_mesh=rest, stage_blocks=stage_blocks,
                                virtual_stages=virtual_stages, device=device, **plan_options)


@contextlib.contextmanager
def saved_activation_bytes(exclude: Sequence[torch.Tensor] = ()) -> Iterator[dict[str, int]]:
    """``with saved_activation_bytes(params) as mem:`` - the peak, over the block, of the bytes of
    tensors autograd holds for backward (activations), storages counted once, the storages of
    ``exclude`` (the weights) not at all. CPU torch keeps no allocator statistics; this counts
    what pipelining schedules differ in: activations in flight."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    refs: dict[int, int] = {}
    state = {"live": 0, "peak": 0}

    class _Held:  # lives as long as autograd keeps the saved tensor
        __slots__ = ("key", "nbytes", "tensor", "__weakref__")

    def release(key: int, nbytes: int) -> None:
        refs[key] -= 1
        if refs[key] == 0:
            del refs[key]
            state["live"] -= nbytes

    def pack(t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        h = _Held()
        h.tensor, h.key, h.nbytes = t, key, t.untyped_storage().nbytes()
        if key in skip or key == 0:
            return h
        if key not in refs:
            refs[key] = 0
            state["live"] += h.nbytes
            state["peak"] = max(state["peak"], state["live"])
        refs[key] += 1
        weakref.finalize(h, release, key, h.nbytes)
        return h

    def unpack(h):
        return h.tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield state
