"""autopar.plan: choose the fastest training plan that fits in memory, and its baselines.

1. Trace the model once (``autopar.trace``; ``meta`` models cost no memory).
2. For each candidate mesh (the factorizations of n into 1, 2 or 3 axes, outermost axis
   across nodes; or the user's pinned mesh): annotate, price (``cost_model.problem``) and
   solve the LP relaxation, whose objective bounds every plan on that mesh from below.
3. Solve the ILP on meshes in order of their bound, stopping once the next bound is no better
   than the best plan found: the mesh search is exact. The LP relaxation is usually integral
   (then it is the ILP optimum and no branching is needed).
4. Price the baselines users would pick instead (DDP, ZeRO-2, FSDP/ZeRO-3, Megatron TP with and without
   sequence parallelism, Megatron TP x DP) with the same model: each is the same ILP with the
   family's layouts pinned. The chosen plan is never predicted slower than a feasible baseline:
   if one were (a solver time limit hit), the baseline's assignment is taken.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from .cost_model.costs import TrainingSpec
from .cost_model.offload import OffloadTargets
from .cost_model.hardware import Hardware, get_hardware
from .cost_model.recompute import chosen_recompute
from .forking import SharedQueues
from .errors import AutoparError, BadArgumentError
from .plan_arguments import check_plan_arguments
from .mesh import MeshSpec
from .offload_search import offload_plan
from .mesh_search import QUIET, Bound, Progress, Solved, mesh_bounds, plan_bound, search_quiet, search_with_zero2
from .passes.annotate import annotate
from .pipeline_info import microbatch_inputs
from .pipeline_plan import pinned_pipeline_plan, pipeline_if_faster
from .plan import BaselineResult, NodePlan, Plan, SolverStats
from .technique import families as registered_families, family as registered_family
from .techniques import catalog  # noqa: F401 (imports every technique file, so each registers)
from .technique import Pin
from .techniques.pins import OuterDataAxis
from .trace import graph_fingerprint, trace

__all__ = ["plan", "STRATEGY_FAMILIES", "candidate_meshes", "auto_candidates"]

aten = torch.ops.aten
# every registered technique's families (autopar.techniques), between the search and pipelining
STRATEGY_FAMILIES = ("auto",) + tuple(f.name for f in registered_families()) + ("pp",)


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)] if n > 1 else []
    out = []
    for d in range(2, n):
        if n % d == 0:
            out.extend((d,) + rest for rest in _factorizations(n // d, k - 1))
    return out


def candidate_meshes(n: int, hw: Hardware, max_axes: int = 3) -> list[MeshSpec]:
    """Every 1-, 2- and 3-axis factorization of n; the innermost axis is laid out inside a node."""
    meshes = []
    for k in range(1, max_axes + 1):
        for sizes in _factorizations(n, k):
            axes = tuple(f"m{a}" for a in range(k))
            meshes.append(hw.mesh_spec(axes, sizes))
    return meshes or [hw.mesh_spec(("m0",), (1,))]


def auto_candidates(n: int, hw: Hardware) -> list[tuple[MeshSpec, "Pin | None"]]:
    """The meshes ``strategy="auto"`` searches, each with the restriction its plans follow
    (3-axis meshes: the outermost axis is a data axis, ``OuterDataAxis``)."""
    return [(m, OuterDataAxis() if m.ndim == 3 else None) for m in candidate_meshes(n, hw)]


# --- families: the registered techniques' pins (autopar.techniques) ---------------------------

def _family_meshes(family: str, n: int, hw: Hardware) -> list[tuple[MeshSpec, Pin]]:
    """The (mesh, pin) candidates of the registered family ``family`` on n devices."""
    f = registered_family(family)
    if f is None:
        raise AutoparError(f"unknown strategy family {family!r}; pick one of {', '.join(STRATEGY_FAMILIES)}")
    return f.meshes(n, hw)


def _pin_for_mesh(family: str, spec: MeshSpec, n: int, hw: Hardware) -> Pin:
    """The family's pin for a user-given mesh: the one made for a mesh of as many axes."""
    options = _family_meshes(family, n, hw)
    for m, pin in options:
        if m.ndim == spec.ndim:
            return pin
    if not options:
        raise AutoparError(f"strategy {family!r} has no layout on {n} devices")
    want = sorted({m.ndim for m, _ in options})
    raise AutoparError(f"strategy {family!r} needs a mesh of {' or '.join(map(str, want))} axes "
                       f"(e.g. {options[0][0]}), got {spec}; pass such a mesh or leave the mesh out")


def plan(model: nn.Module | fx.GraphModule, n_gpus: int, example_inputs: Sequence[Any] = (), *,
         hardware: str | Hardware = "a100-80gb", mesh: str | MeshSpec | None = None, strategy: str = "auto",
         memory_budget_bytes: float | None = None, optimizer: str = "adamw", mixed_precision: bool | None = None,
         example_kwargs: dict | None = None, model_name: str | None = None, time_limit_s: float = 60.0,
         baselines: bool = True, progress: bool = False, pipeline: bool = True, recompute: str = "auto",
         offload: bool | str | Sequence[str] = False) -> Plan:
    """Plan training ``model`` on ``n_gpus`` devices of ``hardware`` (see module doc).

    ``mesh`` pins the mesh (``"dp=2,tp=4"``); ``strategy`` pins a family (one of
    ``STRATEGY_FAMILIES``); ``memory_budget_bytes`` defaults to the device's capacity.
    ``pipeline=False`` keeps ``auto`` from choosing pipeline stages (``autopar.pipeline_search``).
    ``recompute`` is ``"auto"`` (the ILP decides per run of repeated blocks whether to recompute
    its activations), ``"full"`` (every block recomputed) or ``"none"`` (``cost_model.recompute``).
    ``offload=True`` keeps optimizer state in host memory and steps it there (``cost_model.offload``);
    ``offload="auto"`` offloads only the parameter groups the budget needs, a list of groups or
    parameter names pins them (``autopar.offload_search``).
    """
    if not isinstance(offload, (bool, OffloadTargets)):  # "auto", or groups: autopar/offload_search.py
        return offload_plan(plan, model, n_gpus, example_inputs, offload, dict(
            hardware=hardware, mesh=mesh, strategy=strategy, memory_budget_bytes=memory_budget_bytes,
            optimizer=optimizer, mixed_precision=mixed_precision, example_kwargs=example_kwargs,
            model_name=model_name, time_limit_s=time_limit_s, baselines=baselines, progress=progress,
            pipeline=pipeline, recompute=recompute))
    t0 = time.perf_counter()
    say = Progress(progress, t0)
    check_plan_arguments(model, n_gpus, memory_budget_bytes, model_name)
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware)
    if strategy not in STRATEGY_FAMILIES:
        raise AutoparError(f"unknown strategy {strategy!r}; pick one of {', '.join(STRATEGY_FAMILIES)}")
    # bf16 mixed precision by default where low-precision math is faster (GPUs), fp32 where it
    # is not (CPUs, a calibrated CPU profile included)
    default_mp = hw.peak_flops > 1.5 * hw.peak_flops_fp32
    train = TrainingSpec(optimizer, default_mp if mixed_precision is None else mixed_precision, recompute,
                         offload if isinstance(offload, OffloadTargets) else bool(offload))
    budget = float(memory_budget_bytes) if memory_budget_bytes is not None else float(hw.memory_bytes)
    gm = model if isinstance(model, fx.GraphModule) else trace(model, example_inputs, example_kwargs,
                                                                 stack_traces=False, repeat_blocks=True)
    say(f"traced {len(gm.graph.nodes)} nodes")
    if train.recompute == "selective":  # cost_model/recompute.py: not priced inside pipeline stages yet
        pipeline = False
        if strategy == "pp" or (mesh is not None and "pp=" in str(mesh)):
            raise BadArgumentError("recompute='selective' does not run under pipeline stages yet; use "
                                   "recompute='full' (or 'auto') with pipeline stages, or drop pp= from the mesh")
    # pipeline stage plans are made for one micro-batch: the model traced again at that size
    micro_graph = None if isinstance(model, fx.GraphModule) or example_kwargs else (
        lambda m: trace(model, microbatch_inputs(example_inputs, m), stack_traces=False, repeat_blocks=True))
    if strategy == "pp" or (mesh is not None and "pp" in (mesh.axes if isinstance(mesh, MeshSpec) else
                                                         MeshSpec.parse(mesh, n_gpus).axes)):
        return pinned_pipeline_plan(gm, n_gpus, mesh, hw, train, budget, model_name or type(model).__name__, t0,
                                    plan, micro_graph, say)

    if mesh is not None:
        spec = MeshSpec.parse(mesh, n_gpus) if isinstance(mesh, str) else mesh
        spec.check_devices(n_gpus)
        spec = hw.mesh_spec(spec.axes, spec.sizes)
        candidates = [(spec, None if strategy == "auto" else _pin_for_mesh(strategy, spec, n_gpus, hw))]
    elif strategy == "auto":
        candidates = auto_candidates(n_gpus, hw)
    else:
        candidates = _family_meshes(strategy, n_gpus, hw)
    with_baselines = baselines and n_gpus > 1
    # recompute="auto" enters the search where memory is tight, as ZeRO-2 does (search_with_zero2):
    # the helper's bounds and the baselines are searched without it
    first_train = dataclasses.replace(train, recompute="none") if train.recompute == "auto" else train
    # the first pass (no ZeRO-2, no recompute) is skipped where it cannot fit on any mesh: then
    # the helper bounds half the meshes of the second (GPT-3 175B at batch 1536 on 1024: 46
    # meshes of the first pass saved)
    skip_first = len(candidates) > 1 and _forward_bytes(gm, train) / n_gpus > budget
    # the helper bounds part of the meshes of the search's first pass (that pass's options)
    helper = (_Helper(gm, candidates, hw, first_train, budget, time_limit_s, say, n_gpus, with_baselines,
                      zero2=skip_first, bounds_train=train if skip_first else first_train)
              if with_baselines or len(candidates) > 1 else None)
    again = (lambda: _Helper(gm, candidates, hw, first_train, budget, time_limit_s, say, n_gpus, False,
                             zero2=True, bounds_train=train)) if len(candidates) > 1 else None
    try:
        best, n_solved, search_note = search_with_zero2(gm, candidates, hw, train, budget, time_limit_s, say,
                                                         helper, skip_first, again)
        if best is None:  # every ILP stopped at its time limit without a plan
            raise AutoparError(f"no mesh could be planned for {n_gpus} devices within the time limit "
                               f"({time_limit_s:.0f} s); raise time_limit_s or pin a mesh")
    except AutoparError:  # nothing fits (or the solver gave up): pipeline stages may still fit
        if helper is not None:
            helper.close()
        if strategy != "auto" or mesh is not None or n_gpus == 1 or not pipeline:
            raise
        pipelined = pipeline_if_faster(gm, None, n_gpus, hw, train, budget, model_name or type(model).__name__, t0,
                                       plan, micro_graph, progress=say)
        if pipelined is None:
            raise
        return pipelined
    except BaseException:
        if helper is not None:
            helper.close()
        raise

    if with_baselines:
        baseline_results = helper.baselines()
        say(f"baselines priced: {', '.join(b.name for b in baseline_results)}")
        for b in baseline_results:
            if strategy == "auto" and mesh is None and b.feasible and b.step_seconds < best.prediction.step_seconds:
                # A solver limit left the search short of a baseline: never lose to it.
                fam_best = search_quiet(gm, _family_meshes(b.name, n_gpus, hw), hw, train, budget, time_limit_s)
                if fam_best is not None:  # the search's bound still bounds every mesh
                    fam_best.search_bound = min(best.search_bound, fam_best.prediction.step_seconds)
                    best = fam_best
    else:
        baseline_results = []
    if helper is not None or len(candidates) > 1:  # else the search annotated it for its one mesh last
        annotate(gm, best.mesh)  # leave the graph annotated for the chosen mesh
    result = _to_plan(gm, best, hw, train, budget, strategy, baseline_results, n_gpus,
                      model_name or type(model).__name__, n_solved, time.perf_counter() - t0, search_note)
    if isinstance(offload, OffloadTargets):
        result = dataclasses.replace(result, offload_params=tuple(offload))
    if strategy == "auto" and mesh is None and n_gpus > 1 and pipeline:
        result = pipeline_if_faster(gm, result, n_gpus, hw, train, budget, result.model, t0, plan, micro_graph,
                                    tuple(baseline_results), say)
    return result


def _forward_bytes(gm: fx.GraphModule, train: TrainingSpec) -> float:
    """Bytes of every forward op's tensor outputs (views too), the whole batch: a quick guess of
    the activations a step without recompute keeps. Over n devices above the budget, the first
    pass is skipped; a wrong guess costs time only (``mesh_search.search_with_zero2``)."""
    total = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for v in (node.meta.get("val"),) if not isinstance(node.meta.get("val"), (tuple, list)) else node.meta["val"]:
            if isinstance(v, torch.Tensor):
                total += v.numel() * (train.activation_bytes_per_elem if v.dtype.is_floating_point
                                      else v.element_size())
    return total


_BASELINE_FAMILIES = tuple(f.name for f in registered_families() if f.baseline)


def _price_family(family, gm, n_gpus, hw, train, budget, time_limit_s) -> BaselineResult:
    fam_best = search_quiet(gm, _family_meshes(family, n_gpus, hw), hw, train, budget, time_limit_s)
    if fam_best is None:
        return BaselineResult(family, "", math.inf, math.inf, False)
    p = fam_best.prediction
    return BaselineResult(family, str(fam_best.mesh), p.step_seconds, p.peak_memory_bytes,
                          p.peak_memory_bytes <= budget)


# A mesh's relative cost to annotate, price and bound, by its number of axes (measured on GPT-2 XL
# over 64 devices: 0.24, 0.26 and 0.65 s per 1-, 2- and 3-axis mesh): the heaviest go first.
_MESH_WEIGHT = {1: 1.0, 2: 1.1, 3: 2.7}


class _Helper:
    """A forked process that shares the search on this 2-core machine (``autopar.forking.SharedQueues``):
    the two processes take the candidate meshes to bound from one queue, heaviest first, each
    when it is free; then the baseline families from another, the child at once, this process
    after the ILPs it solves meanwhile. The child inherits the traced graph instead of pickling
    it; only bounds and baseline figures come back. Where fork is unavailable or the child
    fails, this process does the work itself, same inputs, same answer."""

    def __init__(self, gm, meshes_and_pins, hw, train, budget, time_limit_s, progress, n_gpus, baselines: bool,
                 zero2: bool = False, bounds_train: TrainingSpec | None = None):
        bounds_train = train if bounds_train is None else bounds_train
        self.zero2, self.bounds_train = zero2, bounds_train  # the options the bounds are taken with
        parent = os.getpid()

        def work(q: int, item):
            if q == 1:
                return _price_family(item, gm, n_gpus, hw, train, budget, time_limit_s)
            bounds, need, pin_error, failed = mesh_bounds(gm, [item], hw, bounds_train, budget, time_limit_s,
                                                          progress if os.getpid() != parent else QUIET, zero2)
            if os.getpid() != parent:  # the problems stay in the child
                bounds = [Bound(b.index, b.objective, b.integral, tight=b.tight, options_bound=b.options_bound,
                                rounded_s=b.rounded_s) for b in bounds]
            return bounds, need, pin_error, failed

        def weight(q: int, item) -> float:
            return _MESH_WEIGHT.get(item[1][0].ndim, 4.0) if q == 0 else 1.0

        self.queues = SharedQueues([list(enumerate(meshes_and_pins)), list(_BASELINE_FAMILIES) if baselines else []],
                                   work, weight)
        self._bounds = None

    def take_meshes(self):
        """This process's meshes to bound, (index, (mesh, pin)) each, taken as it asks."""
        for _, item in self.queues.take(0):
            yield item

    def bounds(self) -> tuple[list[Bound], float, str, tuple[str, ...]]:
        """The child's bounds (after ``take_meshes`` is exhausted)."""
        if self._bounds is None:
            got = self.queues.theirs(0)
            rows = [got[i] for i in sorted(got)]
            self._bounds = ([b for r in rows for b in r[0]], min((r[1] for r in rows), default=math.inf),
                            next((r[2] for r in rows if r[2]), ""), tuple(f for r in rows for f in r[3]))
        return list(self._bounds[0]), *self._bounds[1:]

    def baselines(self) -> list[BaselineResult]:
        """Every baseline family's result, in order: this process prices what the child has not
        taken yet, then collects the child's."""
        mine = {i: self.queues.work(1, family) for i, family in self.queues.take(1)}
        got = {**self.queues.theirs(1), **mine}
        return [got[i] for i in sorted(got)]

    def close(self) -> None:
        self.queues.close()


def _to_plan(gm, best: Solved, hw, train, budget, strategy, baseline_results, n_gpus, model_name, n_solved,
             seconds, search_note) -> Plan:
    problem, choice = best.problem, best.result.choice
    nodes = []
    for node in gm.graph.nodes:
        if node.name not in problem.rep_of:
            continue
        st = problem.strategy_of(node.name, choice)
        key = problem.rep_of[node.name]
        zero_axes: tuple[int, ...] = ()
        if key in problem.decisions and problem.decisions[key].is_param:
            zero_axes = problem.decisions[key].options[choice[key]][1]
        op = str(node.target) if node.op == "call_function" else node.op
        follows = problem.followers[key][0] if key in problem.followers else ""
        nodes.append(NodePlan(node.name, op, str(st), str(st.outputs[0]) if st.outputs else "",
                              tuple(str(l) for l in st.inputs), zero_axes, key, follows))
    p = best.prediction
    r = best.result
    # the gap is the plan's step against the bound: the ILP's objective is that step up to what
    # its linear model leaves out (ZeRO-3's backward re-gathers and per-unit latency)
    return Plan(
        model=model_name, n_devices=n_gpus, mesh=best.mesh, hardware=hw.name, strategy=strategy,
        optimizer=train.optimizer, mixed_precision=train.mixed_precision, memory_budget_bytes=budget,
        step_seconds=p.step_seconds, compute_seconds=p.compute_seconds, comm_seconds=p.comm_seconds,
        param_state_bytes=p.param_state_bytes, activation_bytes=p.activation_bytes, comm_bytes=p.comm_bytes,
        solver=SolverStats(r.solver, r.status, r.seconds, p.step_seconds, plan_bound(best), r.n_variables,
                           r.n_constraints, n_solved, seconds, search_note),
        baselines=tuple(baseline_results), nodes=tuple(nodes), graph_fingerprint=graph_fingerprint(gm),
        recompute=chosen_recompute(problem, choice), host_bytes=p.host_bytes, problem=problem, choice=dict(choice),
        step_peak_bytes=p.step_peak_bytes, bucket_bytes=p.bucket_bytes,
    )
