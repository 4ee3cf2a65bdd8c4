"""Pipeline parallelism at run time: stages on sub-meshes, run by torch.distributed.pipelining.

The world is a mesh ``pp x (sub-mesh)``: ``pp`` outermost, so a stage's ranks are consecutive
(inside a node when the sub-mesh fits one) and the pipeline crosses the outer links. Each stage
is one piece of the traced graph (``passes.split_stages``, cut between repeated blocks), run
as the Plan's stage plan says (``Plan.stage_plans``: each planned on the sub-mesh for one
micro-batch when the plan was made, ``autopar.pipeline_stages``; this module never plans) and
lowered by the ordinary lowering: tensor / data parallelism and ZeRO inside a stage are layouts,
as without pipelining.
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

Weights tied across stages (``PipelineInfo.tied``: an embedding tied to the head): every holding
stage keeps a copy; after the schedule, each copy's gradient is summed over the stages that hold
it by one all-reduce in a process group of the ranks at those pp positions (same place in the
stage mesh), so the copies get equal gradients and stay equal under any optimizer.
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

from autopar.cost_model.comm import bytes_sent_per_rank
from autopar.errors import AutoparError
from autopar.passes.lower import lower
from autopar.passes.split_stages import split_stages
from autopar.pipeline_info import TiedSync, microbatch_inputs
from autopar.plan import Plan
from autopar.strategy import Layout
from autopar.trace import trace

from . import collectives as C
from .materialize import local_shard
from .sharded_module import (ParallelModule, match_strategies, mesh_coords, plan_followers, release_weights, set_attr,
                             zero2_axes)

__all__ = ["PipelineModule", "SCHEDULES", "saved_activation_bytes", "parallelize_plan_pipeline", "check_schedule"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def check_schedule(name: str) -> None:
    """Raise a clear error for a schedule name torch's pipelining does not have."""
    _schedule_class(name)


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
                 pp_group, pp_ranks: list[int], device_mesh, tied: list[tuple[TiedSync, C.AxisGroup | None]],
                 info=None, aliases: dict[str, tuple[str, ...]] | None = None):
        super().__init__()
        self.info = info  # the plan's PipelineInfo (predicted bytes per pp position: info.predicted_bytes)
        self.__dict__["_aliases"] = aliases or {}  # every name of a tied tensor in the user's model
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
        self.__dict__["_tied"] = tied  # (weight tied across stages, its group here or None: one position)

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
        self._sync_tied_grads()
        loss = torch.stack([x.detach() for x in losses]).mean() if last else torch.zeros(())
        # Every rank learns the loss from the rank that holds the last stage in its pipeline.
        dist.broadcast(loss, src=self._pp_ranks[-1], group=self._pp_group)
        return loss

    def _sync_deferred_grads(self) -> None:
        """The gradient all-reduces the stage programs left for the end of the step (their
        parameters' only use is partial on the axis): once per step, not once per micro-batch.

        Gradients of one stage, axis and dtype go in buckets: each bucket is one all-reduce,
        at most the largest of those gradients in size, so the step's transient memory is what
        a per-parameter all-reduce held (the cost model prices a pipeline without gradient
        buckets) while tens of calls become a few: on gloo a call costs ~2 ms whatever its size
        (bench/fidelity.py's pp=2 x dp=2 stage: 36 calls, 67 ms of a 750 ms step)."""
        with torch.no_grad():
            for stage in self.stages:
                groups: dict[tuple, list[torch.Tensor]] = {}
                for target, axis in stage.program.deferred_param_syncs:
                    grad = stage.program.get_parameter(target).grad
                    if grad is not None:
                        groups.setdefault((axis, grad.dtype), []).append(grad)
                for (axis, _), grads in groups.items():
                    for bucket in _buckets(grads):
                        _sum_bucket(bucket, stage.axis_group_of(axis))

    def _sync_tied_grads(self) -> None:
        """Weights tied across stages: each copy's gradient becomes the sum over the stages that
        hold it (this rank's copies summed here, the other positions' by one all-reduce)."""
        with torch.no_grad():
            for sync, group in self._tied:
                copies = [stage.program.get_parameter(sync.target) for s, stage in zip(self.stage_ids, self.stages)
                          if s in sync.stages]
                if not copies:
                    continue
                total = sum(p.grad if p.grad is not None else torch.zeros_like(p) for p in copies)
                if group is not None:
                    total = C.all_reduce(total, False, group)
                for p in copies:
                    p.grad = total.clone()

    def deferred_sync_bytes(self) -> dict[str, float]:
        """Bytes this rank sends for the once-per-step gradient all-reduces (ring formula)."""
        total = 0.0
        for stage in self.stages:
            for target, axis in stage.program.deferred_param_syncs:
                p = stage.program.get_parameter(target)
                total += bytes_sent_per_rank("all_reduce", p.numel() * p.element_size(), stage.axis_group_of(axis).size)
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
        for names in self._aliases.values():  # a tied tensor under each of its names, as the model has it
            have = next((n for n in names if n in out), None)
            if have is not None:
                out.update({n: out[have] for n in names})
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters of every stage, on every rank (names as in the user's model)."""
        return self._gather_dicts([s.full_state_dict() for s in self.stages])

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Unsharded gradients of every stage's parameters, on every rank."""
        return self._gather_dicts([s.full_grads() for s in self.stages])


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` in order, cut into runs of at most the largest one's bytes."""
    cap = max(g.numel() * g.element_size() for g in grads)
    out, size = [[]], 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if out[-1] and size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


def _sum_bucket(bucket: list[torch.Tensor], group: C.AxisGroup) -> None:
    """Every gradient of ``bucket`` replaced by its sum over ``group``, in one all-reduce."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        C.sum_in_place(bucket[0], group)
        return
    flat = C.sum_in_place(torch.cat([g.reshape(-1) for g in bucket]), group)
    offset = 0
    for g in bucket:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _stage_module(gm: fx.GraphModule, plan: Plan, full: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                  dm_sub, groups: list[C.AxisGroup], coords: tuple[int, ...]) -> ParallelModule:
    """One stage's ParallelModule: its weights cut to this rank's shards, its lowered program.
    (parallel_module's builder does the same for a whole world; a stage's mesh is a sub-mesh and
    its weights were broadcast once for the whole model, so this is its own short builder.)"""
    strategies = match_strategies(gm, plan)
    mesh = plan.mesh
    zero2 = zero2_axes(plan, gm)
    root = nn.Module()
    first_target: dict[int, str] = {}  # tied weights inside a stage: one local Parameter
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            target = str(node.target)
            if target in full and id(full[target]) in first_target:
                set_attr(root, target, root.get_parameter(first_target[id(full[target])]), True)
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
            set_attr(root, target, local, is_param)
    followers = set(plan_followers(plan))
    program = lower(gm, strategies, mesh, groups, root, followers, zero2, defer_param_syncs=True,
                    recompute=plan.recompute)
    relower = functools.partial(lower, gm, strategies, mesh, groups, root, followers, zero2, defer_param_syncs=True,
                                recompute=plan.recompute)
    release_weights(gm)
    return ParallelModule(program, plan, strategies, gm, dm_sub, coords, groups, relower)


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


def _aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The names of each parameter the model holds under several (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {v[0]: tuple(v) for v in names.values() if len(v) > 1}


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


def _tied_groups(tied: tuple[TiedSync, ...], n_sub: int, sub_rank: int) -> list[tuple[TiedSync, C.AxisGroup | None]]:
    """One process group per tied weight and place in the stage mesh: the ranks at the pp
    positions holding it (every rank creates every group, in one order, as new_group needs)."""
    out = []
    for sync in tied:
        mine = None
        for r in range(n_sub):
            ranks = [pos * n_sub + r for pos in sync.positions]
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if r == sub_rank and group is not None and dist.get_rank() in ranks:
                mine = C.AxisGroup(f"tied/{sync.target}", group, len(ranks), ranks.index(dist.get_rank()))
        out.append((sync, mine))
    return out


def parallelize_plan_pipeline(model: nn.Module, example_inputs: Sequence[Any], plan: Plan,
                              device: str | None = None) -> PipelineModule:
    """Run a pipelined ``plan`` (its stages, stage plans, micro-batches and schedule; see
    module doc). ``example_inputs`` is one global batch."""
    if not dist.is_initialized():
        raise AutoparError("pipeline parallelism needs torch.distributed: launch with torchrun")
    info = plan.pipeline
    world = dist.get_world_size()
    if info is None:
        raise AutoparError("parallelize_plan_pipeline needs a plan with pipeline stages (plan.pipeline is None); "
                           "use autopar.parallelize for plans without them")
    if plan.n_devices != world:
        raise AutoparError(f"the plan is for {plan.n_devices} devices but the world size is {world}; "
                           f"re-plan with autopar.plan(model, {world}, ...) or launch {plan.n_devices} processes")
    pp, v, m = info.n_stages, info.virtual_stages, info.n_microbatches
    n_stages = pp * v
    if len(plan.stage_plans) != n_stages:
        raise AutoparError(f"the pipelined plan has {len(plan.stage_plans)} stage plans for {n_stages} stages (a plan "
                           f"made from a traced graph has none); re-plan from the model: autopar.plan(model, {world}, "
                           f"example_inputs)")
    cls = _schedule_class(info.schedule)
    sub = plan.stage_plans[0].mesh
    n_sub = world // pp
    full = _rank0_weights(model)
    gm = trace(model, microbatch_inputs(example_inputs, m))
    stage_gms = split_stages(gm, info.stage_blocks)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    device_type = device or ("cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu")
    sizes, axes = sub.sizes, sub.axes
    # The model's own process groups (see parallel_module._build: no group shared with another model)
    dm = init_device_mesh(device_type, (pp, *sizes), mesh_dim_names=("pp", *axes),
                          backend_override={a: dist.get_backend() for a in ("pp", *axes)})
    rank = dist.get_rank()
    pp_index, sub_rank = divmod(rank, n_sub)
    coords = mesh_coords(sub_rank, sizes)  # init_device_mesh lays ranks out row-major, pp outermost
    groups = [C.AxisGroup(a, dm.get_group(a), s, c) for a, s, c in zip(axes, sizes, coords)]
    pp_group = dm.get_group("pp")
    pp_ranks = [dist.get_global_rank(pp_group, i) for i in range(pp)]
    buffers = dict(model.named_buffers())
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    stage_ids = [pp_index + j * pp for j in range(v)]  # round robin: interleaved schedules expect it
    tied = _tied_groups(info.tied, n_sub, sub_rank)
    modules, pipe_stages = [], []
    for s in stage_ids:
        pm = _stage_module(stage_gms[s], plan.stage_plans[s], full, buffers, dm[axes], groups, coords)
        modules.append(pm)
        ins, outs = _example_args(stage_gms[s], s > 0, dev)
        pipe_stages.append(PipelineStage(pm, s, n_stages, dev, input_args=ins, output_args=outs, group=pp_group))
    sched = cls(pipe_stages if v > 1 else pipe_stages[0], m, loss_fn=_loss_of)
    return PipelineModule(modules, stage_ids, sched, list(plan.stage_plans), info.stage_blocks, m, info.schedule,
                          pp_group, pp_ranks, dm, tied, info, _aliases(model))


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
