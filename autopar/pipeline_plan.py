"""A chosen pipeline made into a Plan (``pipeline_plan``), and the planner's two ways in: a
pipeline pinned by ``strategy="pp"`` or a ``pp=`` mesh axis (``pinned_pipeline_plan``), and,
under ``strategy="auto"``, the pipeline if it is predicted faster than the plan without stages
(``pipeline_if_faster``; by at least ``PIPELINE_MARGIN`` when a plan without stages fits).
The search itself is ``autopar.pipeline_search``; the stage plans
``autopar.pipeline_stages``. The planner is handed in as ``plan_fn`` (neither module imports
``autopar.planner``, which imports them).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch.fx as fx

from autopar.cost_model.comm import p2p_s
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.pipeline import activations_in_flight
from autopar.cost_model.hardware import Hardware
from autopar.mesh import MeshSpec
from autopar.passes.split_stages import block_count, even_stage_blocks
from autopar.trace import graph_fingerprint

from .errors import AutoparError
from .pipeline_candidates import global_batch
from .pipeline_search import PipelineChoice, search_pipeline
from .pipeline_stages import info_from_stage_plans, plan_stages, row_bytes, stage_lower_bound
from .plan import Plan, SolverStats

__all__ = ["PIPELINE_MARGIN", "pipeline_plan", "pinned_pipeline_plan", "pipeline_if_faster"]

# Under strategy="auto", a model that fits without stages is pipelined only when the pipeline is
# predicted at least this much faster than the best plan without them. Why a margin, not a plain
# "faster": a pipeline changes the user's loop (``pm.step(*batch)`` runs forward and backward)
# and its costs are the least certain the planner prices. On 4 CPU ranks (bench/fidelity.py,
# ten runs, 2026-12) the pipelined plans measured 5-17% further above their prediction than data
# parallelism did, and the planner's pipelined pick, predicted 7-19% faster than data parallel,
# measured 0.95-1.03x of it. A pipeline that wins by more than that, or one needed to fit at
# all, is still chosen; a pinned one (``strategy="pp"``, a ``pp=`` axis) is never second-guessed.
PIPELINE_MARGIN = 0.10


def pipeline_plan(choice: PipelineChoice, gm: fx.GraphModule, n_gpus: int, hw: Hardware, train: TrainingSpec,
                  budget: float, strategy: str, model_name: str, plan_fn: Callable[..., Plan],
                  micro_graph: Callable[[int], fx.GraphModule] | None, baselines: tuple = (), seconds: float = 0.0,
                  note: str = "") -> Plan:
    """A Plan whose mesh is pp x the stage mesh, with the pipeline's predictions, stages and
    stage plans (``pipeline_stages``; planned on ``micro_graph(m)``, the model traced for one
    micro-batch: without it, as when ``plan`` is given a traced graph, the plan has no stage
    plans and cannot run). Its nodes carry the layouts of the three priced pieces (whole batch).
    ``comm_seconds``/``comm_bytes`` are those of the device that sends the most: its chunks'
    collectives, the sends between stages and the tied-weight all-reduces. Raises
    AutoparError when the stages cannot be built (callers skip the candidate)."""
    sub, info = choice.sub, choice.info
    p, m = info.n_stages, info.n_microbatches
    mesh = MeshSpec(("pp", *sub.mesh.axes), (p, *sub.mesh.sizes), (choice.pp_link, *sub.mesh.links))
    stage_plans: tuple = ()
    comm_s, exposed_s, comm_bytes = 0.0, 0.0, {}
    step, params, acts = choice.step_seconds, choice.param_bytes, choice.activation_bytes
    if micro_graph is not None:
        stage_plans, info, step, layouts_bound = _best_split_stage_plans(micro_graph(m), info, sub.mesh, choice.pp_link,
                                                                         hw, train, budget, plan_fn, model_name, n_gpus)
        # the Plan's bound covers every pipeline the search priced (whole-batch pieces, loose where
        # micro-batches run less efficiently); this one's stage layouts are bounded far closer
        note = (note + "; " if note else "") + (f"this pipeline's stage layouts: lower bound "
                                                f"{layouts_bound * 1e3:,.2f} ms (gap {_gap(layouts_bound, step)})")
        worst = max(range(p), key=lambda k: info.stages[k].peak_memory_bytes)
        params = sum(stage_plans[s].param_state_bytes - stage_plans[s].bucket_bytes
                     for s in range(worst, p * info.virtual_stages, p))
        acts = info.stages[worst].peak_memory_bytes - params
        for k in range(p):
            chunks = stage_plans.chunks[k::p]
            # the sends and the tied weights' syncs run on the schedule's path: never hidden
            path = sum(m * (p2p_s(c.send_bytes, choice.pp_link) + p2p_s(c.send_grad_bytes, choice.pp_link))
                       for c in chunks) + sum(t.seconds for t in info.tied if k in t.positions)
            s = sum(c.seconds_per_step(m) for c in chunks) + path
            sent = info.predicted_bytes(k)
            if sum(sent.values()) >= sum(comm_bytes.values()):
                comm_s, comm_bytes = s, sent
                exposed_s = sum(c.exposed_per_step(m) for c in chunks) + path
    else:
        note = (note + "; " if note else "") + "no stage plans (plan() was given a traced graph: plan the model)"
    stats = SolverStats("pipeline search + HiGHS per stage", "Optimal", seconds, step, choice.lower_bound_s,
                        sum(s.solver.n_variables for s in stage_plans), sum(s.solver.n_constraints for s in stage_plans),
                        sum(s.solver.ilps_solved for s in stage_plans), seconds, note)
    busy = step - info.bubble_seconds
    return Plan(model=model_name, n_devices=n_gpus, mesh=mesh, hardware=hw.name, strategy=strategy,
                optimizer=train.optimizer, mixed_precision=train.mixed_precision, memory_budget_bytes=budget,
                step_seconds=step, compute_seconds=max(busy - exposed_s, 0.0), comm_seconds=comm_s,
                param_state_bytes=params, activation_bytes=acts,
                comm_bytes=comm_bytes, solver=stats, baselines=tuple(baselines), nodes=sub.nodes,
                graph_fingerprint=graph_fingerprint(gm), pipeline=info,
                recompute=(info.block_prefix,) if info.recompute else (), stage_plans=tuple(stage_plans))


def _best_split_stage_plans(micro: fx.GraphModule, info, sub: MeshSpec, link, hw: Hardware, train: TrainingSpec,
                            budget: float, plan_fn: Callable[..., Plan], model_name: str, n_gpus: int):
    """``_fitting_stage_plans`` of the search's split of the blocks, and of the even split where
    that differs (one model chunk per device): whichever composes to the faster step. The search
    balances the stages by whole-batch pieces priced with no memory limit; the stage ILPs hold
    the schedule's activations in their memory rows, and where those bind, the stages the
    search gave more blocks lose their fast layouts. GPT-3 175B on 1024 at batch 1536 without
    recompute: blocks (11, 12, 13, 13, 13, 13, 13, 8) compose to 48.86 s, 12 each to 46.98 s."""
    splits = [info.stage_blocks]
    even = even_stage_blocks(sum(info.stage_blocks), info.n_stages)
    if info.virtual_stages == 1 and even != info.stage_blocks:
        splits.append(even)
    best, error = None, None
    for blocks in splits:
        try:
            got = _fitting_stage_plans(micro, dataclasses.replace(info, stage_blocks=blocks), sub, link, hw, train,
                                       budget, plan_fn, model_name, n_gpus)
        except AutoparError as exc:  # this split does not fit: the other may
            error = error or exc
            continue
        if best is None or got[2] < best[2]:
            best = got
    if best is None:
        raise error
    return best


def _fitting_stage_plans(micro: fx.GraphModule, info, sub: MeshSpec, link, hw: Hardware, train: TrainingSpec,
                         budget: float, plan_fn: Callable[..., Plan], model_name: str, n_gpus: int):
    """The stage plans of ``micro`` (one micro-batch), their PipelineInfo, step time and a lower
    bound on the step of any stage layouts of this pipeline (``stage_lower_bound``).

    The search priced whole-batch pieces scaled to one micro-batch; what runs are these stage
    plans, each solved for one micro-batch, so the plan predicts what they compose to, as a
    pipeline pinned by hand does. Each stage ILP weighs the step of m micro-batches and counts
    the activations its pp position holds in flight (``cost_model.stage_weights``); its row
    does not hold what the walk adds (gradients in flight in one op's backward, the fresh
    gradient of micro-batches after the first) nor, interleaved, the device's other chunks:
    where the composed peak still exceeds the budget, the stages are solved again with their
    rows lowered by the excess. Raises AutoparError when no stage plans fit."""
    p, m, v = info.n_stages, info.n_microbatches, info.virtual_stages
    n_chunks = len(info.stage_blocks)
    options = dict(hardware=hw, optimizer=train.optimizer, mixed_precision=train.mixed_precision,
                   memory_budget_bytes=budget, recompute="full" if info.recompute else "none")
    budgets = [budget] * n_chunks
    bound = None
    for _ in range(_REFITS):
        stage_plans = plan_stages(micro, info.stage_blocks, sub, p, link, plan_fn, options, model_name, budgets,
                                  n_microbatches=m, schedule=info.schedule)
        if bound is None:  # the budget's own rows: those of the refits bound their rows only
            bound = stage_lower_bound(stage_plans, p, m, v, link, hw.idle_speedup(n_gpus))
        got, step = info_from_stage_plans(stage_plans, p, m, v, info.schedule, sub,
                                          info.block_prefix, info.stage_blocks, link, info.recompute,
                                          hw.idle_speedup(n_gpus), hw.pipeline_core_shares(p, sub.n_devices))
        peak = max(s.peak_memory_bytes for s in got.stages)
        if peak <= budget:
            return stage_plans, got, step, bound
        for k, stage in enumerate(got.stages):
            over = stage.peak_memory_bytes - budget
            if over <= 0:
                continue
            mine = range(k, n_chunks, p)
            flight = activations_in_flight(info.schedule, p, m, k, v)
            for s in mine:  # the row it was solved under, or what it holds there if less
                budgets[s] = min(budgets[s], row_bytes(stage_plans[s], flight)) - 1.02 * over / len(mine)
    raise AutoparError(f"the stage plans of {p} stages x {m} micro-batches on {sub} need {peak / 2**30:.1f} GiB per "
                       f"device with the schedule's activations in flight, over the {budget / 2**30:.1f} GiB budget")


def _gap(bound: float, step: float) -> str:
    return f"{max(0.0, (step - bound) / step) * 100:.1f}%" if step > 0 and bound == bound else "n/a"


_REFITS = 4  # stage plans solved again with a tighter budget (_fitting_stage_plans)


def pinned_pipeline_plan(gm: fx.GraphModule, n_gpus: int, mesh: str | MeshSpec | None, hw: Hardware,
                         train: TrainingSpec, budget: float, model_name: str, t0: float, plan_fn: Callable[..., Plan],
                         micro_graph: Callable[[int], fx.GraphModule] | None, progress=None) -> Plan:
    """``strategy="pp"`` or a mesh with a ``pp`` axis: the best pipeline under that pin."""
    pp = stage_mesh = None
    if mesh is not None:
        spec = MeshSpec.parse(mesh, n_gpus) if isinstance(mesh, str) else mesh
        spec.check_devices(n_gpus)
        if "pp" in spec.axes:
            k = spec.axes.index("pp")
            if k != 0:
                raise AutoparError(f"mesh {spec}: the pp axis must come first (outermost), e.g. pp=4,dp=2,tp=8")
            pp = spec.sizes[0]
            rest = spec.axes[1:]
            if rest:
                stage_mesh = hw.mesh_spec(rest, spec.sizes[1:])
    choice = search_pipeline(gm, n_gpus, hw, train, budget, plan_fn=plan_fn, pp=pp, stage_mesh=stage_mesh,
                             progress=progress)
    if choice is None:
        blocks = block_count(gm)
        raise AutoparError(f"no pipeline fits {n_gpus} devices with budget {budget / 2**30:.1f} GiB per device "
                           f"(the model has {blocks} repeated blocks; a pipeline needs at least 3 and pp <= blocks"
                           + (f"; pinned pp={pp}" if pp else "") + "); raise the memory budget, change the pin, "
                           "or use strategy='auto'")
    return pipeline_plan(choice, gm, n_gpus, hw, train, budget, "pp", model_name, plan_fn, micro_graph,
                         seconds=time.perf_counter() - t0, note="pipeline pinned by strategy='pp' or a pp= mesh axis")


def pipeline_if_faster(gm: fx.GraphModule, best: Plan | None, n_gpus: int, hw: Hardware, train: TrainingSpec,
                       budget: float, model_name: str, t0: float, plan_fn: Callable[..., Plan],
                       micro_graph: Callable[[int], fx.GraphModule] | None, baselines: tuple = (),
                       progress=None) -> Plan | None:
    """``strategy="auto"``: the pipeline plan if one is predicted at least ``PIPELINE_MARGIN``
    faster than ``best`` (or ``best`` is None: nothing fits without stages), else ``best`` (its
    note naming a faster pipeline it kept out). A pipeline whose stages cannot be built is
    skipped (``best`` is returned), never an error of the whole plan."""
    if best is not None and global_batch(gm) < 4:
        # fewer than 2 micro-batches per stage of even a 2-stage pipeline: half the devices
        # would idle, so with a plan that fits the search is skipped (it costs seconds at scale)
        return best
    # the plan without stages is kept unless a pipeline is faster: candidates that cannot beat it
    # are pruned inside the search, which leaves every pipeline that does beat it as it was
    incumbent = best.step_seconds if best is not None else float("inf")
    beat = incumbent * (1 - PIPELINE_MARGIN)
    choice = search_pipeline(gm, n_gpus, hw, train, budget, plan_fn=plan_fn, progress=progress, incumbent_s=incumbent)
    if choice is None or choice.step_seconds >= incumbent:
        return best
    if choice.step_seconds >= beat:
        sub = str(choice.sub.mesh)
        return _kept(best, choice.step_seconds, f"pp={choice.info.n_stages}" + (f",{sub}" if sub else ""),
                     choice.info.n_microbatches)
    if best is not None:  # the bound covers the plans without stages too
        other = best.solver.lower_bound  # NaN: the plan without stages has no bound, so neither has the union
        choice = dataclasses.replace(choice, lower_bound_s=min(choice.lower_bound_s, other) if other == other
                                     else float("nan"))
    note = ("pipeline stages win: " + (f"{choice.step_seconds * 1e3:,.1f} ms vs {best.step_seconds * 1e3:,.1f} ms "
                                       f"without" if best is not None else "nothing fits without them"))
    try:
        built = pipeline_plan(choice, gm, n_gpus, hw, train, budget, "auto", model_name, plan_fn, micro_graph,
                              baselines, seconds=time.perf_counter() - t0, note=note)
    except AutoparError as exc:  # the stages cannot be built: skip the candidate
        if progress:
            progress(f"pipeline skipped: {exc}")
        return best
    if best is not None and built.step_seconds >= beat:
        # its stage plans, priced as they run, do not beat the plan without stages by the margin
        if progress:
            progress(f"pipeline skipped: its stage plans take {built.step_seconds * 1e3:,.1f} ms per step "
                     f"(the search's estimate was {choice.step_seconds * 1e3:,.1f} ms), "
                     f"{best.step_seconds * 1e3:,.1f} ms without stages")
        if built.step_seconds >= best.step_seconds:
            return best
        return _kept(best, built.step_seconds, str(built.mesh), built.pipeline.n_microbatches)
    if best is not None:
        won = f"pipeline stages win: {built.step_seconds * 1e3:,.1f} ms vs {best.step_seconds * 1e3:,.1f} ms without"
        built = dataclasses.replace(built, solver=dataclasses.replace(
            built.solver, mesh_search=built.solver.mesh_search.replace(note, won, 1)))
    return built


def _kept(best: Plan, seconds: float, mesh: str, n_micro: int) -> Plan:
    """``best``, its search note saying which faster pipeline it kept out and why."""
    gain = 1 - seconds / best.step_seconds
    why = (f"pipeline {mesh} ({n_micro} micro-batches) predicted {seconds * 1e3:,.1f} ms, {gain:.0%} faster, not "
           f"chosen: auto pipelines a model that fits without stages only when {PIPELINE_MARGIN:.0%} faster "
           "(pin one with strategy='pp' or a pp= mesh axis)")
    note = best.solver.mesh_search
    return dataclasses.replace(best, solver=dataclasses.replace(best.solver, mesh_search=f"{note}; {why}" if note
                                                                else why))
