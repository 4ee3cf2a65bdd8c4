"""Pipeline stage search: the number of stages, their blocks, the sub-mesh inside a stage, the
micro-batch count and the schedule, chosen together with the sharding inside each stage.

As Alpa's inter-operator pass (Zheng et al. 2022, arXiv 2201.12023), stages are contiguous
runs of layers on sub-meshes, each priced by the intra-operator ILP. Repeated blocks make
this cheap: per sub-mesh shape the ILP prices three small pieces of the traced graph once
(``split_stages(gm, (1, L - 2, 1))``: embeddings + one block, the middle blocks that share one
block's decisions, one block + head), and every stage candidate is a sum of those parts.
With identical blocks, Alpa's dynamic program over stage boundaries reduces to how many blocks
each stage holds; ``_balance`` finds the counts that minimize the slowest stage under each
stage's memory budget exactly (bisection on the bottleneck time, greedy fill per candidate).

Scaling to a micro-batch: a piece is priced for the whole batch on its sub-mesh; per micro-batch,
work on activations (compute, activation collectives, activation memory, sends) scales by 1/m,
parameter reshards (ZeRO-3 gathers) are paid per micro-batch, and the optimizer step and the
parameter gradient synchronizations once per step, after the pipeline drains (as Megatron-LM
and torchtitan run them); the kernels' floors and the activation collectives' latencies
(``Part.fixed_seconds``) are paid in full by every micro-batch. Simplifications: the layouts
inside a stage are those that are fastest for the whole batch with no memory limit (memory is
then checked per stage under the budget), and the rest of the work scales with the batch.
Small micro-batches cost more than that where the whole batch's layouts split the batch over
more devices than a micro-batch has samples (``_SubMesh.batch_split``): gpt2-xl (batch 8) on
64, pp=4 on dp=2,tp=8 at 4 micro-batches was estimated at 50.7 ms with its blocks' batch cut 8
ways on the tp axis, which a micro-batch of 2 cannot run; its stage plans, made at the
micro-batch, cut the sequence there instead and took 71.5 ms, slower than the 65.9 ms plan
without stages, after 1.2-1.7 s spent building them. So where a plan without stages exists,
the search composes only micro-batch counts that can run the whole batch's layouts; where none
does, it composes them all, and the chosen pipeline's stage plans, priced at the micro-batch
(``autopar.pipeline_plan``), are what the plan gets. Either way the stage plans decide against
the plan without stages.

Search cost: the (stage count, sub-mesh) candidates are priced independently, part of them by
a forked child (``autopar.forking.share_work``). Recomputed blocks are priced (one more problem
build per sub-mesh) only where they may win: under ``recompute="auto"`` a sub-mesh is skipped
when a lower bound on its recomputed pipelines (``_recompute_bound``: the same pipelines
without recompute and without a memory limit, bubble included) is no better than the best
pipeline without recompute, so the choice is the one pricing every sub-mesh would make.
Given a plan the caller keeps unless a pipeline beats it (``incumbent_s``), a sub-mesh prices
its middle piece first and skips the other two where that piece alone bounds every pipeline on
it above the incumbent (``_middle_bound``): the middle piece is most of the work at scale.

The chosen pipeline's stages are then planned for one micro-batch each (``pipeline_stages``),
and made into a Plan by ``autopar.pipeline_plan``: the Plan carries those stage plans, their
bytes and the weights tied across stages, and the runtime runs exactly them. The planner is
handed in as ``plan_fn`` (this module never imports ``autopar.planner``, which imports it). A
weight tied across stages is priced here as one all-reduce of its whole gradient between the
first and last stage per step.

The runtime (``runtime.pipeline``) matches this for parameters with a single use that are
stored whole on the synced axis (nearly all weights under DP and Megatron layouts); ZeRO-3 and
ZeRO-2 pieces are gathered and reduce-scattered per micro-batch, there and here; a parameter used
twice (tied weights inside a stage) is synchronized per micro-batch there but priced once here
(``cost_model.stage_weights`` weighs the stage plans' ILPs alike).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from autopar.cost_model.hardware import Hardware
from autopar.cost_model.pipeline import StageCost, activations_in_flight, pipeline_cost, tied_sync_cost
from autopar.cost_model.problem import build_problem
from autopar.cost_model.recompute import recompute_transient_bytes
from autopar.cost_model.comm import p2p_s
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.liveness import backward_transient_peaks
from autopar.mesh import Link, MeshSpec
from autopar.passes.annotate import annotate
from autopar.passes.split_stages import block_container, split_stages

from .errors import AutoparError
from .forking import share_work
from .pipeline_candidates import global_batch, microbatch_counts, sub_meshes
from .pipeline_info import PipelineInfo, PipelineStageInfo
from .pipeline_parts import Part, batch_split, boundary_bytes, kernel_floor_seconds, least_compute, split_costs
from .plan import Plan

__all__ = ["PipelineChoice", "search_pipeline"]


@dataclass(frozen=True)
class _SubMesh:
    mesh: MeshSpec
    embed: Part  # non-block work before the blocks (embeddings)
    block: Part  # one block
    head: Part  # non-block work after the blocks (head, loss)
    send_bytes: float  # per boundary, whole batch
    grad_bytes: float
    batch: int  # the batch the parts were priced for
    nodes: tuple  # NodePlans of the three pieces (the layouts inside a stage)
    block_rc: Part | None = None  # one block recomputed: keeps its input only (cost_model/recompute.py)
    transient_bytes: float = 0.0  # one recomputed block's activations, alive during its backward
    tied_bytes: float = 0.0  # gradients of weights tied between the first and last piece
    middle_choice: dict | None = None  # the middle piece's solved choice (what _with_recompute prices)
    block_floor: Part | None = None  # one block less its ZeRO-3 re-gathers: recompute costs no less
    # per piece (embed, block, head): (gradients in flight in one op's backward, whole batch;
    # the largest parameter gradient): cost_model/liveness.backward_transient_peaks
    grad_transients: tuple = ((0.0, 0.0),) * 3
    # into how many pieces the middle piece's layouts cut the batch (pipeline_parts.batch_split):
    # a micro-batch of fewer samples cannot run them, so its estimate would not hold
    batch_split: int = 1


def _price_submesh(pieces, p: int, mesh: MeshSpec, n_blocks: int, hw: Hardware, train: TrainingSpec,
                   time_limit_s: float, batch: int, make_plan: Callable[..., Plan], prefix: str,
                   incumbent_s: float = float("inf")) -> "_SubMesh | float | None":
    """The pieces priced on ``mesh`` (None: they cannot be), or, where the middle piece alone
    shows that no pipeline of ``p`` stages on it steps faster than ``incumbent_s``
    (``_middle_bound``), that bound: the other two pieces are then left unpriced."""
    def solve(g: fx.GraphModule) -> Plan:
        return make_plan(g, mesh.n_devices, mesh=mesh, hardware=hw, baselines=False, memory_budget_bytes=1e30,
                         optimizer=train.optimizer, mixed_precision=train.mixed_precision,
                         time_limit_s=time_limit_s, model_name="stage", pipeline=False)

    def costs(plan: Plan, regathers: bool = True) -> Part:
        part = split_costs(plan.problem, plan.choice, regathers)
        return dataclasses.replace(part, fixed_seconds=part.fixed_seconds + kernel_floor_seconds(plan.problem, hw))

    try:
        mid = solve(pieces[1])  # first: where it prunes, the end pieces are never built
        send, grad = boundary_bytes(pieces[0], train)
        floor = costs(mid, regathers=False).scale(1.0 / (n_blocks - 2))
        block = costs(mid).scale(1.0 / (n_blocks - 2))
        if incumbent_s < float("inf"):
            # the end pieces as the search composes them (each less one block, clipped at zero),
            # bounded without planning them: their least compute less the middle's block
            ends = tuple(least_compute(pieces[k], mesh.n_devices, hw, train) - block for k in (0, 2))
            bound = _middle_bound(floor, p, mesh, n_blocks, send, grad, batch, hw, prefix, ends)
            if bound >= incumbent_s:
                return bound
        plans = [solve(pieces[0]), mid, solve(pieces[2])]
    except AutoparError:  # the batch does not divide on this mesh, or the like
        return None
    first, last = costs(plans[0]), costs(plans[2])
    nodes = tuple(n for p in plans for n in p.nodes)
    tied = sum(_weight_bytes(pieces[0], target) for target, stages in pieces.tied.items() if 2 in stages)
    grad_t = tuple(backward_transient_peaks(p.problem, p.choice) for p in plans)
    return _SubMesh(mesh, first - block, block, last - block, send, grad, batch, nodes, None, 0.0, tied,
                    dict(plans[1].choice), floor, grad_t, batch_split(mid.problem, mid.choice, batch))


def _middle_bound(floor: Part, p: int, mesh: MeshSpec, n_blocks: int, send: float, grad: float, batch: int,
                  hw: Hardware, prefix: str, ends: tuple[Part, Part] = (Part(), Part())) -> float:
    """No pipeline of p stages on ``mesh`` steps faster, with or without recompute, whatever the
    end pieces cost: ``_recompute_bound`` on a sub-mesh whose every block costs ``floor`` (one
    block less its ZeRO-3 re-gathers, at most what a block costs with or without recompute)
    and whose embeddings, head and tied weights cost nothing. The end pieces' parts are
    ``first - block`` and ``last - block`` clipped at zero per field, the tied weights' bytes
    at least zero, and a pipeline's step grows with every device's time, so each pipeline the
    search would compose from the priced pieces is at least this one's."""
    sub = _SubMesh(mesh, ends[0], floor, ends[1], send, grad, batch, (), block_floor=floor)
    return _recompute_bound(sub, p, n_blocks, hw, prefix)


def _with_recompute(sub: _SubMesh, pieces, n_blocks: int, hw: Hardware, train: TrainingSpec) -> _SubMesh:
    """``sub`` with its middle blocks' layouts priced again, every block recomputed."""
    annotate(pieces[1], sub.mesh)  # the choice's option indices are this mesh's strategies
    rc_problem = build_problem(pieces[1], sub.mesh, hw, dataclasses.replace(train, recompute="full"))
    rc_choice = {**sub.middle_choice, **{t.key: 1 for t in rc_problem.recompute}}
    transient = recompute_transient_bytes(rc_problem, rc_choice)
    block_rc = (split_costs(rc_problem, rc_choice) - Part(act_bytes=transient)).scale(1.0 / (n_blocks - 2))
    # the same kernels' floors (the forward run again adds its own: not priced, so this stays below)
    block_rc = dataclasses.replace(block_rc, fixed_seconds=sub.block.fixed_seconds)
    return dataclasses.replace(sub, block_rc=block_rc, transient_bytes=transient)


def _least_slowest(cost: list[list[float]], p: int, n_blocks: int) -> float:
    """min over splits of ``n_blocks`` into p contiguous stages (each >= 1 block) of the slowest
    stage, stage k with n blocks costing ``cost[k][n - 1]`` (non-decreasing in n): bisection on
    the answer, greedy fill per candidate (as ``_balance``, with no memory limit)."""
    def fits(t_max: float) -> bool:
        left = n_blocks
        for k in range(p):
            take = min(max((n for n in range(1, len(cost[k]) + 1) if cost[k][n - 1] <= t_max), default=0),
                       left - (p - k - 1))
            if take < 1:
                return False
            left -= take
        return left == 0

    values = sorted({c for row in cost for c in row})
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(values[mid]) else (mid + 1, hi)
    return values[lo]


def _recompute_bound(sub: _SubMesh, p: int, n_blocks: int, hw: Hardware, prefix: str) -> float:
    """No pipeline of p stages on ``sub`` with its blocks recomputed steps faster: recompute only
    adds time, so each is at least the same pipeline without recompute and without a memory
    limit, and ``pipeline_cost`` grows with every device's time. Per micro-batch count m: the
    devices' times (sends included) sum to the same for any split; 1F1B and GPipe step
    max(m * mean, ((m - 1) t_max + sum) / idle_speedup), with t_max at least the least slowest
    device over all splits (``_least_slowest``), and the syncs after the drain at least their
    mean over devices; interleaved (even split) is priced as it is (``_compose``). A recomputed
    block skips the backward re-gathers of ZeRO-3 weights (its recompute gathers them again, as
    forward work), so the blocks are taken less those (``block_floor``)."""
    sub = dataclasses.replace(sub, block=sub.block_floor)
    whole = sub.embed + sub.block.scale(n_blocks) + sub.head
    link = hw.mesh_spec(("pp", *sub.mesh.axes), (p, *sub.mesh.sizes)).links[0]
    after = whole.step_seconds / p + tied_sync_cost(sub.tied_bytes, 2 if p > 1 else 1, link)[1]
    best = float("inf")
    for m in microbatch_counts(sub.batch, p, sub.mesh):
        sends = [(p2p_s(sub.send_bytes / m, link) if k < p - 1 else 0.0) + (p2p_s(sub.grad_bytes / m, link) if k
                                                                              else 0.0) for k in range(p)]
        cost = [[part.micro_seconds(m) + sends[k] for part in
                 (_stage_part(sub, n, k == 0, k == p - 1) for n in range(1, n_blocks - p + 2))] for k in range(p)]
        total = whole.micro_seconds(m) + sum(sends)
        step = (m - 1) * _least_slowest(cost, p, n_blocks) + total
        best = min(best, max(m * total / p, step / hw.idle_speedup(p * sub.mesh.n_devices)) + after)
        if n_blocks % (2 * p) == 0 and m % p == 0:
            got = _compose(sub, (n_blocks // (2 * p),) * (2 * p), p, m, 2, "interleaved-1f1b", hw, prefix,
                           float("inf"))
            best = min(best, got.step_seconds)
    return best


def _weight_bytes(gm: fx.GraphModule, target: str) -> float:
    val = next(n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target) == target).meta["val"]
    return float(val.numel() * val.element_size())


@dataclass(frozen=True)
class PipelineChoice:
    step_seconds: float
    peak_memory_bytes: float
    info: PipelineInfo
    sub: _SubMesh
    pp_link: Link
    param_bytes: float  # of the device with the highest peak
    activation_bytes: float
    lower_bound_s: float = float("nan")  # no pipeline the search covers is faster (_work_bound)


def _stage_part(sub: _SubMesh, n: int, first: bool, last: bool, rc: bool = False) -> Part:
    part = (sub.block_rc if rc else sub.block).scale(n)
    if first:
        part = part + sub.embed
    if last:
        part = part + sub.head
    return part


def _grad_transient(sub: _SubMesh, m: int, last: bool, first: bool) -> float:
    """Gradients in flight in a stage's busiest op backward (one micro-batch), or the fresh
    gradient of its largest parameter that micro-batches after the first add into ``.grad``."""
    pieces = [sub.grad_transients[1]] + ([sub.grad_transients[0]] if first else []) + \
        ([sub.grad_transients[2]] if last else [])
    return max(max(ops / m, grads if m > 1 else 0.0) for ops, grads in pieces)


def _stage_cost(part: Part, m: int, sub: _SubMesh, last: bool, first: bool, rc: bool = False) -> StageCost:
    return StageCost(seconds=part.micro_seconds(m), param_state_bytes=part.param_bytes,
                     activation_bytes=part.act_bytes / m, send_bytes=0.0 if last else sub.send_bytes / m,
                     send_grad_bytes=0.0 if first else sub.grad_bytes / m,
                     transient_bytes=(sub.transient_bytes / m if rc else 0.0) + _grad_transient(sub, m, last, first))


def _balance(sub: _SubMesh, p: int, m: int, schedule: str, n_blocks: int, budget: float, rc: bool = False
             ) -> tuple[int, ...] | None:
    """Blocks per stage minimizing the slowest stage's micro-batch time, every stage within
    ``budget`` (see module doc); None if no split fits."""
    # stage k holding n blocks (parts[k][n - 1]) and its micro-batch time, tabulated once: the
    # bisection below reads them at every step (recomputing the parts there took 2 s of gpt2-xl
    # on 64 devices' plan)
    parts = [[_stage_part(sub, n, k == 0, k == p - 1, rc) for n in range(1, n_blocks - p + 2)] for k in range(p)]
    times = [[part.micro_seconds(m) for part in row] for row in parts]

    def stage_time(n: int, k: int) -> float:
        return times[k][n - 1]

    def mem_cap(k: int) -> int:
        flight = activations_in_flight(schedule, p, m, k)
        lo = 0
        for n in range(1, n_blocks - p + 2):
            part = parts[k][n - 1]
            transient = (sub.transient_bytes / m if rc else 0.0) + _grad_transient(sub, m, k == p - 1, k == 0)
            if part.param_bytes + flight * part.act_bytes / m + transient > budget:
                break
            lo = n
        return lo

    mem_caps = [mem_cap(k) for k in range(p)]
    if min(mem_caps) < 1 or sum(mem_caps) < n_blocks:
        return None

    def fill(t_max: float) -> tuple[int, ...] | None:
        counts, left = [], n_blocks
        for k in range(p):
            cap = 0
            for n in range(1, mem_caps[k] + 1):
                if stage_time(n, k) <= t_max:
                    cap = n
            take = min(cap, left - (p - k - 1))
            if take < 1:
                return None
            counts.append(take)
            left -= take
        return tuple(counts) if left == 0 else None

    candidates = sorted({stage_time(n, k) for k in range(p) for n in range(1, n_blocks - p + 2)})
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = fill(candidates[mid])
        if got is not None:
            best, hi = got, mid - 1
        else:
            lo = mid + 1
    return best


def _compose(sub: _SubMesh, counts: tuple[int, ...], p: int, m: int, v: int, schedule: str, hw: Hardware,
             prefix: str, budget: float, rc: bool = False) -> PipelineChoice | None:
    link = hw.mesh_spec(("pp", *sub.mesh.axes), (p, *sub.mesh.sizes)).links[0]
    n_chunks = p * v
    parts = [_stage_part(sub, n, s == 0, s == n_chunks - 1, rc) for s, n in enumerate(counts)]
    costs = [_stage_cost(part, m, sub, s == n_chunks - 1, s == 0, rc) for s, part in enumerate(parts)]
    pc = pipeline_cost(costs, schedule, m, link, v, hw.idle_speedup(p * sub.mesh.n_devices),
                       hw.pipeline_core_shares(p, sub.mesh.n_devices))
    # once per step, after the pipeline drains: optimizer and parameter gradient syncs
    after = max(sum(parts[k + j * p].step_seconds for j in range(v)) for k in range(p))
    after += tied_sync_cost(sub.tied_bytes, 2 if p > 1 else 1, link)[1]  # tied weights: first <-> last stage
    if pc.peak_memory_bytes > budget:
        return None
    starts = [sum(counts[:s]) for s in range(n_chunks)]
    stages, worst = [], (0.0, 0.0, 0.0)
    for k in range(p):
        param = sum(parts[k + j * p].param_bytes for j in range(v))
        if pc.stage_memory_bytes[k] > worst[0]:
            worst = (pc.stage_memory_bytes[k], param, pc.stage_memory_bytes[k] - param)
        mine = [k + j * p for j in range(v)]
        extras = "+".join(x for x, on in (("embeddings", 0 in mine), ("head", n_chunks - 1 in mine)) if on)
        stages.append(PipelineStageInfo(k, starts[k], sum(counts[s] for s in mine), extras,
                                        pc.stage_seconds[k], pc.stage_memory_bytes[k]))
    info = PipelineInfo(p, schedule, m, v, str(sub.mesh), prefix, tuple(counts), pc.bubble_fraction,
                        pc.bubble_seconds, pc.p2p_bytes_per_step, tuple(stages), rc)
    return PipelineChoice(pc.step_seconds + after, pc.peak_memory_bytes, info, sub, link, worst[1], worst[2])


def _work_bound(sub: _SubMesh, p: int, n_blocks: int) -> float:
    """No pipeline of ``p`` stages on ``sub`` steps faster than its whole work spread evenly:
    a step is at least m times the busiest device's micro-batch time (``pipeline_cost``), that is
    at least the batch work over p, and the syncs after the drain at least the step work over p
    (sends, parameter gathers and the bubble only add; recompute only adds compute)."""
    block = sub.block if sub.block_rc is None else Part(
        *(min(a, b) for a, b in zip(sub.block._fields(), sub.block_rc._fields())))
    whole = sub.embed + block.scale(n_blocks) + sub.head
    return (whole.batch_seconds + whole.step_seconds) / p


def search_pipeline(gm: fx.GraphModule, n_gpus: int, hw: Hardware, train: TrainingSpec, budget: float, *,
                    plan_fn: Callable[..., Plan], pp: int | None = None, stage_mesh: MeshSpec | None = None,
                    time_limit_s: float = 10.0, progress=None, incumbent_s: float = float("inf")
                    ) -> PipelineChoice | None:
    """The fastest pipeline that fits (see module doc), or None when none does or the model
    has fewer than 3 repeated blocks. ``pp`` / ``stage_mesh`` pin the stage count / sub-mesh.
    ``incumbent_s``: the step of a plan the caller keeps unless a pipeline is faster; candidates
    that provably cannot beat it are priced in part or not at all (``_middle_bound``,
    ``_recompute_bound``), and only micro-batch counts that can run the whole batch's layouts
    are composed (module doc): the result is the best of those wherever it beats ``incumbent_s``."""
    try:
        prefix, indices = block_container(gm)
    except AutoparError:
        return None
    n_blocks = len(indices)
    if n_blocks < 3:
        return None
    batch = global_batch(gm)
    try:
        pieces = split_stages(gm, (1, n_blocks - 2, 1))
    except AutoparError:  # a model the stage cut cannot run: no pipeline
        return None
    pps = [pp] if pp else [d for d in range(2, n_blocks + 1) if n_gpus % d == 0 and n_gpus // d >= 1]
    todo = [(p, mesh) for p in pps for mesh in ([stage_mesh] if stage_mesh is not None else
                                                 sub_meshes(n_gpus // p, hw))]
    kw = dict(n_blocks=n_blocks, batch=batch, budget=budget, hw=hw, prefix=prefix, progress=progress,
              strict=incumbent_s < float("inf"))
    # the sub-meshes are priced independently: a forked child prices part of them (autopar.forking);
    # 2-axis sub-meshes cost about twice a 1-axis one (more strategies per op)
    priced = share_work(todo, lambda pm: _price_submesh(pieces, pm[0], pm[1], n_blocks, hw, train, time_limit_s,
                                                        batch, plan_fn, prefix, incumbent_s),
                        weight=lambda pm: float(pm[1].ndim))
    # a candidate pruned by its middle piece keeps its bound for the search-wide one
    pruned = [x for x in priced if isinstance(x, float)]
    priced = [x if isinstance(x, _SubMesh) else None for x in priced]
    if progress and pruned:
        progress(f"pipeline: {len(pruned)} of {len(todo)} sub-meshes cannot beat {incumbent_s * 1e3:,.1f} ms")
    best = _best_of(todo, priced, (False,) if train.recompute in ("none", "auto") else (), None, **kw)
    if train.recompute != "none":
        # recomputed blocks, priced where they may win: a sub-mesh whose bound (_recompute_bound) is no
        # better than incumbent_s, or under "auto" than the best pipeline without recompute, is skipped
        limit = min(incumbent_s, best.step_seconds) if best is not None and train.recompute == "auto" else incumbent_s
        keep = [k for k, (pm, sub) in enumerate(zip(todo, priced)) if sub is not None and (
            limit == float("inf") or _recompute_bound(sub, pm[0], n_blocks, hw, prefix) < limit)]
        if progress:
            progress(f"pipeline recompute: {len(keep)} of {sum(x is not None for x in priced)} sub-meshes may win")
        again = share_work([priced[k] for k in keep], lambda sub: _with_recompute(sub, pieces, n_blocks, hw, train))
        priced = [dict(zip(keep, again)).get(k, sub) for k, sub in enumerate(priced)]
        best = _best_of([todo[k] for k in keep], [priced[k] for k in keep], (True,), best, **kw)
    bound = min([_work_bound(sub, pm[0], n_blocks) for pm, sub in zip(todo, priced) if sub is not None] + pruned,
                default=float("inf"))
    # unclipped by best.step_seconds: a valid bound is below it anyway (tests check that)
    return None if best is None else dataclasses.replace(best, lower_bound_s=bound)


def _best_of(todo, priced, rcs: tuple[bool, ...], best: PipelineChoice | None, *, n_blocks: int, batch: int,
             budget: float, hw: Hardware, prefix: str, progress, strict: bool = False) -> PipelineChoice | None:
    """The fastest pipeline (or ``best``) over the priced sub-meshes, micro-batch counts, the
    recompute options ``rcs`` and the schedules; ``strict``: only micro-batches that can run
    the whole batch's layouts."""
    for p in dict.fromkeys(pm[0] for pm in todo):
        for (_, mesh), sub in ((pm, sub) for pm, sub in zip(todo, priced) if pm[0] == p):
            if sub is None or not rcs:
                continue
            # Beside a plan without stages, micro-batches too small for the whole batch's layouts
            # are left out: their estimate prices layouts they cannot run (module doc), and
            # building such a candidate to find that out cost more than the rest of the search.
            # Where nothing fits without stages they stay: the stage plans, made at the
            # micro-batch, lay them out anew.
            counts = [m for m in microbatch_counts(batch, p, mesh)
                      if not strict or (batch // m) % sub.batch_split == 0]
            for m, rc in ((m, rc) for m in counts for rc in rcs):
                for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)):
                    if v > 1 and (n_blocks % (p * v) or m % p):
                        continue
                    if v == 1:
                        counts = _balance(sub, p, m, schedule, n_blocks, budget, rc)
                    else:
                        counts = (n_blocks // (p * v),) * (p * v)
                    if counts is None:
                        continue
                    got = _compose(sub, counts, p, m, v, schedule, hw, prefix, budget, rc)
                    if got is not None and (best is None or got.step_seconds < best.step_seconds):
                        best = got
        if progress and rcs:
            progress(f"pipeline pp={p}{' (recompute)' if rcs == (True,) else ''}: best so far "
                     f"{best.step_seconds * 1e3:,.1f} ms" if best else f"pipeline pp={p}: nothing fits yet")
    return best
