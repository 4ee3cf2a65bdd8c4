"""The stage plans of a pipeline Plan: each model chunk planned on the stage mesh for one
micro-batch, what each chunk sends, and the weights tied across stages.

A pipelined Plan carries them (``Plan.stage_plans``, ``PipelineInfo.chunks`` and ``.tied``) so
that ``runtime.pipeline`` runs exactly what was planned and priced, and never plans itself.
The planner is handed in as ``plan_fn`` (``autopar.planner.plan``): the planner imports this
module, not the other way round.

Pricing from the stage plans: a chunk's collectives run once per micro-batch, except its
parameter gradient all-reduces, which run once per step (``cost_model.pipeline.step_sync_bytes``);
a chunk sends its outputs forward and the gradients of its floating-point inputs back, whole, once
per micro-batch; a tied weight's gradient is all-reduced once per step between the pp positions
holding it (``cost_model.pipeline.tied_sync_cost``), on its shard as the stage plans lay it out
(every holding stage must lay it out alike, or the candidate cannot be built).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Sequence

import torch
import torch.fx as fx

from autopar.cost_model.comm import p2p_s
from autopar.cost_model.hardware import Hardware, get_hardware
from autopar.cost_model.liveness import backward_transient_peaks
from autopar.cost_model.pipeline import (StageCost, activations_in_flight, pipeline_cost, step_sync_bytes,
                                         step_sync_seconds, tied_sync_cost)
from autopar.cost_model.recompute import recompute_transient_bytes
from autopar.cost_model.stage_weights import STAGE_KEY, StageWeights
from autopar.mesh import Link, MeshSpec
from autopar.passes.split_stages import REQUIRES_GRAD_KEY, block_container, even_stage_blocks, split_stages
from autopar.trace import graph_fingerprint, trace

from .errors import AutoparError
from .pipeline_parts import microbatch_and_step_seconds
from .pipeline_info import ChunkComm, PipelineInfo, PipelineStageInfo, TiedSync, microbatch_inputs
from .plan import Plan, SolverStats

__all__ = ["StagePlans", "plan_stages", "row_bytes", "info_from_stage_plans", "stage_lower_bound", "hand_pipeline_plan"]

_TOKEN = re.compile(r"S\(\d+\)|R|P(?:\([a-z]+\))?")


class StagePlans(tuple):
    """The stage plans, in model order, with ``.chunks`` (ChunkComm each) and ``.tied``."""

    chunks: tuple[ChunkComm, ...]
    tied: tuple[TiedSync, ...]


def _boundary(gm: fx.GraphModule, first: bool, last: bool) -> tuple[float, float]:
    """(bytes a chunk sends forward, gradient bytes it sends back), one micro-batch, whole tensors."""
    send = grad = 0.0
    if not last:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        for x in torch.utils._pytree.tree_leaves(out.args[0]):
            val = x.meta.get("val") if isinstance(x, fx.Node) else None
            if isinstance(val, torch.Tensor):
                send += val.numel() * val.element_size()
    if not first:
        for n in gm.graph.nodes:
            val = n.meta.get("val") if n.op == "placeholder" else None
            if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                grad += val.numel() * val.element_size()
    return send, grad


def _local_grad_bytes(gm: fx.GraphModule, node: fx.Node, plan: Plan) -> tuple[str, float]:
    """(layout key, bytes of this rank's gradient) of weight ``node`` under ``plan``."""
    np_ = plan.node(node.name) if any(n.name == node.name for n in plan.nodes) else None
    val = node.meta["val"]
    numel = float(val.numel())
    layout, zero = ("R" * plan.mesh.ndim, ()) if np_ is None else (np_.output_layout, tuple(np_.zero_axes))
    for tok, size in zip(_TOKEN.findall(layout), plan.mesh.sizes):
        if tok.startswith("S"):
            numel /= size
    if zero:  # a flat ZeRO-2 piece, padded to divide
        k = math.prod(plan.mesh.sizes[a] for a in zero)
        numel = math.ceil(numel / k)
    return f"{layout}/{zero}", numel * val.element_size()


def _structure(gm: fx.GraphModule) -> tuple:
    """The graph up to node names and weight names: op, callee, shape, dtype and inputs (by
    position) of every node, in order."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        shape = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: ("node", index[x]))
        out.append((n.op, str(n.target) if n.op == "call_function" else "", shape, repr(args),
                    bool(n.meta.get(REQUIRES_GRAD_KEY))))
    return tuple(out)


def _renamed(plan: Plan, like: fx.GraphModule, gm: fx.GraphModule, model_name: str) -> Plan:
    """``plan`` (made for ``like``) for ``gm``, a graph of the same structure: node names mapped
    by position."""
    names = {a.name: b.name for a, b in zip(like.graph.nodes, gm.graph.nodes)}
    nodes = tuple(dataclasses.replace(n, name=names[n.name], shares_with=names.get(n.shares_with, n.shares_with),
                                      follows=names.get(n.follows, n.follows)) for n in plan.nodes)
    solver = dataclasses.replace(plan.solver, seconds=0.0, ilps_solved=0, plan_seconds=0.0,
                                 mesh_search="the same graph as an earlier stage: its plan, renamed")
    return dataclasses.replace(plan, nodes=nodes, model=model_name, graph_fingerprint=graph_fingerprint(gm),
                               solver=solver)


def plan_stages(micro_gm: fx.GraphModule, stage_blocks: tuple[int, ...], sub: MeshSpec, pp: int, pp_link: Link,
                plan_fn: Callable[..., Plan], options: dict, model_name: str,
                budgets: Sequence[float] | None = None, *, n_microbatches: int, schedule: str) -> StagePlans:
    """Plan every chunk of ``micro_gm`` (one micro-batch) cut at ``stage_blocks`` on ``sub``.
    ``options`` go to ``plan_fn`` (hardware, optimizer, budget, strategy, recompute, ...);
    ``budgets`` (one per chunk, in model order) replace the options' memory budget. Each chunk's
    ILP weighs a step of ``n_microbatches`` under ``schedule`` (``cost_model.stage_weights``:
    per-step terms over m, activations times the micro-batches its pp position holds in flight)."""
    gms = split_stages(micro_gm, stage_blocks)
    n = len(gms)
    weights = [StageWeights(n_microbatches, activations_in_flight(schedule, pp, n_microbatches, k % pp, n // pp))
               for k in range(n)]
    plans: list = [None] * n
    solved: dict = {}  # the same graph up to names (middle stages) and budget -> [(in flight, plan, graph)]
    # fewest in flight first: a plan solved with fewer in flight that fits the row of more is
    # that ILP's optimum too (its rows are looser), so middle stages of 1F1B share one solve
    # where memory does not bind
    for k in sorted(range(n), key=lambda k: weights[k].in_flight):
        g = gms[k]
        chunk_options = options if budgets is None else dict(options, memory_budget_bytes=budgets[k])
        budget = chunk_options.get("memory_budget_bytes")
        key = (_structure(g), budget)
        flight = weights[k].in_flight
        same = next(((plan, like) for f, plan, like in solved.get(key, ())
                     if f == flight or (f < flight and budget is not None and row_bytes(plan, flight) <= budget)),
                    None)
        if same is not None:
            plans[k] = _renamed(*same, g, f"{model_name}/stage{k}")
            continue
        g.meta[STAGE_KEY] = weights[k]
        plans[k] = plan_fn(g, sub.n_devices, mesh=sub if sub.ndim else None, baselines=False, pipeline=False,
                           model_name=f"{model_name}/stage{k}", **chunk_options)
        solved.setdefault(key, []).append((flight, plans[k], g))
    chunks = []
    for k, (g, p) in enumerate(zip(gms, plans)):
        per_step = step_sync_bytes(p.problem, p.choice) if p.problem is not None else {}
        per_micro = {c: b - per_step.get(c, 0.0) for c, b in p.comm_bytes.items() if b - per_step.get(c, 0.0) > 0}
        send, grad = _boundary(g, k == 0, k == n - 1)
        syncs = step_sync_seconds(p.problem, p.choice) if p.problem is not None else 0.0
        # the stage plan's step is its compute plus the communication compute does not hide
        exposed = max(p.step_seconds - p.compute_seconds - syncs, 0.0)
        chunks.append(ChunkComm(per_micro, per_step, send, grad, p.comm_seconds, syncs, exposed))
    tied = []
    for target, stages in sorted(gms.tied.items()):
        keys = set()
        nbytes = 0.0
        for s in stages:
            node = next(x for x in gms[s].graph.nodes if x.op == "get_attr" and str(x.target) == target)
            key, nbytes = _local_grad_bytes(gms[s], node, plans[s])
            keys.add(key)
        if len(keys) > 1:
            raise AutoparError(f"weight {target} is tied across pipeline stages {list(stages)}, whose plans lay it "
                               f"out differently ({sorted(keys)}); its gradient cannot be all-reduced shard by "
                               f"shard. Pin one strategy for the stages (e.g. strategy='dp') or untie it")
        positions = tuple(sorted({s % pp for s in stages}))
        sent, seconds = tied_sync_cost(nbytes, len(positions), pp_link)
        tied.append(TiedSync(target, tuple(stages), positions, nbytes, sent, seconds))
    out = StagePlans(plans)
    out.chunks, out.tied = tuple(chunks), tuple(tied)
    return out


def _transients(p: Plan, m: int) -> tuple[float, float]:
    """(activation bytes of its recomputed blocks, bytes alive once per device at a peak) of a
    stage plan (one micro-batch's). A recomputed block's activations, less its input, live only
    during that block's backward: once per device, however many micro-batches are in flight
    (``cost_model.recompute.recompute_transient_bytes``; a stage plan prices one micro-batch, so
    its ``activation_bytes`` still hold one copy of them). Besides them, the gradients in flight
    in the stage's busiest op backward, or the fresh gradient of its largest parameter that
    micro-batches after the first add into ``.grad`` (cost_model/liveness.backward_transient_peaks).
    (0, 0) for a plan read from JSON."""
    if p.problem is None or p.choice is None:
        return 0.0, 0.0
    ops, grads = backward_transient_peaks(p.problem, p.choice)
    rc = recompute_transient_bytes(p.problem, p.choice)
    return rc, rc + max(ops, grads if m > 1 else 0.0)


def row_bytes(p: Plan, in_flight: float) -> float:
    """What a stage plan holds with ``in_flight`` micro-batches in flight, as its ILP's memory
    row counts it (``cost_model.stage_weights``): its parameter state once (no gradient bucket),
    its activations per micro-batch in flight, less its recomputed blocks' activations, held once."""
    rc = _transients(p, 1)[0]
    return p.param_state_bytes - p.bucket_bytes + in_flight * (p.activation_bytes - rc) + rc


def info_from_stage_plans(stages: StagePlans, pp: int, m: int, v: int, schedule: str, stage_mesh: MeshSpec,
                          block_prefix: str, stage_blocks: tuple[int, ...], pp_link: Link,
                          recompute: bool, idle_speedup: float = 1.0,
                          core_shares: tuple[tuple[float, ...], ...] = ()) -> tuple[PipelineInfo, float]:
    """A PipelineInfo priced from the stage plans themselves (a pipeline pinned by hand), and
    the step time (schedule, then the once-per-step syncs and optimizer of the slowest device)."""
    # per micro-batch the stage's compute and activation collectives; its optimizer and parameter
    # gradient syncs once per step, after the drain, as the search prices them (a stage plan
    # read from JSON has no problem to split: all of its step per micro-batch)
    split = [microbatch_and_step_seconds(p, m) if p.problem is not None else (p.step_seconds, 0.0) for p in stages]
    # no gradient buckets in a pipeline: its syncs run once per step on .grad (runtime.pipeline)
    held = [_transients(p, m) for p in stages]
    costs = [StageCost(s[0], p.param_state_bytes - p.bucket_bytes, p.activation_bytes - h[0], c.send_bytes,
                       c.send_grad_bytes, transient_bytes=h[1])
             for p, c, s, h in zip(stages, stages.chunks, split, held)]
    pc = pipeline_cost(costs, schedule, m, pp_link, v, idle_speedup, core_shares)
    after = max(sum(split[k + j * pp][1] for j in range(v)) for k in range(pp))
    tied_s = sum(t.seconds for t in stages.tied)
    starts = [sum(stage_blocks[:s]) for s in range(pp * v)]
    infos = []
    for k in range(pp):
        mine = [k + j * pp for j in range(v)]
        extras = "+".join(x for x, on in (("embeddings", 0 in mine), ("head", pp * v - 1 in mine)) if on)
        infos.append(PipelineStageInfo(k, starts[k], sum(stage_blocks[s] for s in mine), extras,
                                       pc.stage_seconds[k], pc.stage_memory_bytes[k]))
    info = PipelineInfo(pp, schedule, m, v, str(stage_mesh), block_prefix, tuple(stage_blocks), pc.bubble_fraction,
                        pc.bubble_seconds, pc.p2p_bytes_per_step, tuple(infos), recompute, stages.tied, stages.chunks)
    return info, pc.step_seconds + after + tied_s


def _floor_seconds(p: Plan) -> float:
    """No layouts of a stage plan's graph take less per micro-batch than every op at its
    cheapest option (reshards, syncs, recompute and gathers only add); 0 read from JSON."""
    if p.problem is None:
        return 0.0
    return sum(min(d.seconds) for d in p.problem.decisions.values() if not d.is_param)


def stage_lower_bound(stages: StagePlans, pp: int, m: int, v: int, pp_link: Link, idle_speedup: float = 1.0
                      ) -> float:
    """A lower bound on the step of every choice of stage layouts of this pipeline (its stages'
    blocks, sub-mesh, ``m`` micro-batches and schedule, as ``info_from_stage_plans`` composes
    them). Per chunk j, L_j bounds its micro-batch time plus its once-per-step time over m (its
    weighted ILP's bound, ``cost_model.stage_weights``) and F_j its micro-batch time alone
    (``_floor_seconds``); s_j its sends. 1F1B / GPipe: the step is at least
    ``(m - 1) t_k + sum_j t_j + s_k`` for every stage k, so at least
    ``m (L_k + s_k) + sum_{j != k} (F_j + s_j)``; interleaved, device k at least
    ``m sum L + (m + (p - 1)/v) sum s + (p - 1)/v sum F`` over its chunks. With ``idle_speedup``
    (oversubscribed CPU ranks) it is divided by that. The tied weights' syncs are left out (their
    size depends on the layouts)."""
    floors = [_floor_seconds(p) for p in stages]
    lows = [max(p.solver.lower_bound, f) if p.solver.lower_bound == p.solver.lower_bound else f
            for p, f in zip(stages, floors)]
    sends = [p2p_s(c.send_bytes, pp_link) + p2p_s(c.send_grad_bytes, pp_link) for c in stages.chunks]
    n = len(stages)
    if v == 1:
        free = sum(f + s for f, s in zip(floors, sends))
        bound = max(m * (lows[k] + sends[k]) + free - floors[k] - sends[k] for k in range(n))
    else:
        def device(vals: list[float], k: int) -> float:
            return sum(vals[j] for j in range(k, n, pp))

        bound = max(m * device(lows, k) + (m + (pp - 1) / v) * device(sends, k) + (pp - 1) / v * device(floors, k)
                    for k in range(pp))
    return bound / idle_speedup


def hand_pipeline_plan(model, example_inputs, n_gpus: int, *, pp: int, n_microbatches: int, schedule: str,
                       stage_mesh: str | MeshSpec | None, stage_blocks, virtual_stages: int,
                       plan_fn: Callable[..., Plan], **plan_options) -> Plan:
    """A pipelined Plan pinned by hand (``pp`` stage groups, ``n_microbatches``, ``schedule``,
    ``stage_mesh`` inside a stage: default one dp axis over n / pp devices; ``stage_blocks`` per
    stage: default as even as they divide; ``virtual_stages`` chunks per device); the sharding
    inside each stage is planned by ``plan_fn`` with ``plan_options`` (strategy, hardware, ...)."""
    if pp < 1 or n_gpus % pp:
        raise AutoparError(f"pp={pp} does not divide the world size {n_gpus}; pick pp among the divisors of {n_gpus}")
    v = int(virtual_stages)
    if (v > 1) != (schedule == "interleaved-1f1b"):
        raise AutoparError(f"schedule {schedule!r} with virtual_stages={v}: interleaved-1f1b needs virtual_stages >= 2 "
                           f"and the others run one stage per rank")
    n_sub = n_gpus // pp
    hw_opt = plan_options.pop("hardware", "a100-80gb")
    hw = hw_opt if isinstance(hw_opt, Hardware) else get_hardware(hw_opt)
    sub = MeshSpec.parse(stage_mesh, n_sub) if isinstance(stage_mesh, str) else stage_mesh
    if sub is None:
        sub = MeshSpec.parse(f"dp={n_sub}", n_sub)
    if sub.n_devices != n_sub:
        raise AutoparError(f"stage mesh {sub} has {sub.n_devices} devices but world {n_gpus} / pp {pp} = {n_sub}; "
                           f"pick a stage mesh of {n_sub} devices")
    if "pp" in sub.axes:
        raise AutoparError("the stage mesh cannot itself have a pp axis; give pp= separately")
    sub = hw.mesh_spec(sub.axes, sub.sizes)
    link = hw.mesh_spec(("pp", *sub.axes), (pp, *sub.sizes)).links[0]
    gm = trace(model, example_inputs, stack_traces=False)
    micro = trace(model, microbatch_inputs(example_inputs, n_microbatches), stack_traces=False)
    prefix, indices = block_container(micro)
    n_stages = pp * v
    blocks = tuple(stage_blocks) if stage_blocks is not None else even_stage_blocks(len(indices), n_stages)
    if len(blocks) != n_stages:
        raise AutoparError(f"stage_blocks {blocks} names {len(blocks)} stages, but pp={pp} x virtual_stages={v} "
                           f"= {n_stages}")
    plan_options.pop("baselines", None)
    plan_options.pop("mesh", None)
    name = plan_options.pop("model_name", None) or type(model).__name__
    stages = plan_stages(micro, blocks, sub, pp, link, plan_fn, dict(plan_options, hardware=hw), name,
                         n_microbatches=n_microbatches, schedule=schedule)
    rc = plan_options.get("recompute") == "full"
    info, step = info_from_stage_plans(stages, pp, n_microbatches, v, schedule, sub, prefix, blocks, link, rc,
                                       hw.idle_speedup(n_gpus), hw.pipeline_core_shares(pp, sub.n_devices))
    worst = max(range(pp), key=lambda k: info.stages[k].peak_memory_bytes)
    params = sum(stages[s].param_state_bytes - stages[s].bucket_bytes for s in range(worst, n_stages, pp))
    sent = {k: info.predicted_bytes(k) for k in range(pp)}
    busiest = max(range(pp), key=lambda k: sum(sent[k].values()))
    k = max(range(pp), key=lambda k: sum(c.seconds_per_step(n_microbatches) for c in stages.chunks[k::pp]))
    comm = sum(c.seconds_per_step(n_microbatches) for c in stages.chunks[k::pp])
    exposed = sum(c.exposed_per_step(n_microbatches) for c in stages.chunks[k::pp])
    first = stages[0]
    bound = stage_lower_bound(stages, pp, n_microbatches, v, link, hw.idle_speedup(n_gpus))  # unclipped: tests hold it
    stats = SolverStats("HiGHS per stage (pipeline pinned by hand)", "Optimal", 0.0, step, bound,
                        sum(s.solver.n_variables for s in stages), sum(s.solver.n_constraints for s in stages),
                        sum(s.solver.ilps_solved for s in stages), 0.0, "pipeline pinned by hand")
    mesh = MeshSpec(("pp", *sub.axes), (pp, *sub.sizes), (link, *sub.links))
    return Plan(model=name, n_devices=n_gpus, mesh=mesh, hardware=hw.name, strategy="pp", optimizer=first.optimizer,
                mixed_precision=first.mixed_precision, memory_budget_bytes=first.memory_budget_bytes, step_seconds=step,
                compute_seconds=max(step - info.bubble_seconds - exposed, 0.0), comm_seconds=comm,
                param_state_bytes=params, activation_bytes=info.stages[worst].peak_memory_bytes - params,
                comm_bytes=sent[busiest], solver=stats, baselines=(), nodes=first.nodes,
                graph_fingerprint=graph_fingerprint(gm), pipeline=info, recompute=(prefix,) if rc else (),
                stage_plans=tuple(stages))
