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
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from .cost_model.costs import TrainingSpec
from .cost_model.evaluate import Prediction, evaluate
from .cost_model.hardware import Hardware, get_hardware
from .cost_model.ilp import InfeasibleBudgetError, SolveResult, solve
from .cost_model.problem import PinError, Problem, build_problem
from .cost_model.recompute import chosen_recompute
from .errors import AutoparError, BadArgumentError, format_bytes
from .plan_arguments import check_plan_arguments
from .mesh import MeshSpec
from .passes.annotate import annotate
from .passes.rules import tensor_leaves
from .pipeline_info import microbatch_inputs
from .pipeline_search import pinned_pipeline_plan, pipeline_if_faster
from .plan import BaselineResult, NodePlan, Plan, SolverStats
from . import technique as families
from .techniques import catalog  # noqa: F401 (imports every technique file, so each registers)
from .technique import Pin
from .techniques.pins import OuterDataAxis
from .trace import graph_fingerprint, trace

__all__ = ["plan", "STRATEGY_FAMILIES", "candidate_meshes", "auto_candidates"]

aten = torch.ops.aten
# every registered technique's families (autopar.techniques), between the search and pipelining
STRATEGY_FAMILIES = ("auto",) + tuple(f.name for f in families.families()) + ("pp",)


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
    f = families.family(family)
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


# --- solving -------------------------------------------------------------------------------

@dataclass
class _Solved:
    mesh: MeshSpec
    problem: Problem
    result: SolveResult
    prediction: Prediction
    # the least step time any plan on any mesh this search covered could take (valid LP or
    # MIP dual bounds, min over meshes); NaN until the mesh search sets it
    search_bound: float = math.nan
    tight_elsewhere: bool = False  # some mesh the search bounded may be limited by memory


def _prepare(gm: fx.GraphModule, mesh: MeshSpec, hw: Hardware, train: TrainingSpec, pin: Pin | None,
             zero2: bool = False) -> Problem:
    annotate(gm, mesh)
    # ZeRO-2 options enter the search when memory asks for them (_search_with_zero2) or a family
    # pins them: releasing gradient all-reduces makes the LP relaxation fractional (gpt2 on 8:
    # 3 ILPs and 37 s instead of one integral LP in 2 s).
    return build_problem(gm, mesh, hw, train, pin, zero2=zero2 or (pin is not None and pin.zero2))


def _solve(problem: Problem, budget: float | None, time_limit_s: float) -> _Solved:
    result = solve(problem, budget, time_limit_s=time_limit_s)
    return _Solved(problem.mesh, problem, result, evaluate(problem, result.choice))


_T0 = [0.0]  # when the running plan() started: progress lines show the time since


def _progress(enabled: bool, message: str) -> None:
    if enabled:
        print(f"  [autopar {time.perf_counter() - _T0[0]:5.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass
class _Bound:
    """A mesh's LP bound. ``problem`` and ``lp`` are None when a helper process computed it:
    the problem (fx nodes and all) stays there, and is rebuilt here only if the mesh is solved."""

    index: int
    objective: float
    integral: bool
    problem: Problem | None = None
    lp: SolveResult | None = None
    tight: bool = False  # the LP's rounded plan needs over 90% of the budget: memory may bind


def _bounds(gm, items, hw, train, budget, time_limit_s, progress, zero2: bool = False
            ) -> tuple[list[_Bound], float, str]:
    """LP bounds of the meshes ``items`` ((index, (mesh, pin)) pairs), the least memory any
    infeasible one needs, and why a mesh could not follow its pinned family ("" if none)."""
    out, need, pin_error = [], math.inf, ""
    for index, (mesh, pin) in items:
        try:
            problem = _prepare(gm, mesh, hw, train, pin, zero2)
        except PinError as exc:  # e.g. a 3-axis mesh whose data axis exceeds the batch
            _progress(progress, f"mesh {mesh}: skipped ({exc.short})")
            pin_error = str(exc)
            continue
        try:
            lp = solve(problem, budget, time_limit_s=time_limit_s, relax=True)
        except InfeasibleBudgetError as exc:
            need = min(need, exc.need_bytes)
            continue
        tight = evaluate(problem, lp.choice).peak_memory_bytes > 0.9 * budget if budget is not None else False
        out.append(_Bound(index, lp.objective_s, lp.integral, problem, lp, tight))
        _progress(progress, f"mesh {mesh}: lower bound {lp.objective_s * 1e3:.3f} ms ({problem.n_variables()} vars"
                            f"{', integral' if lp.integral else ''})")
    return out, need, pin_error


def _search(gm, meshes_and_pins, hw, train, budget, time_limit_s, progress, max_ilps: int = 3,
            helper: "_Helper | None" = None, zero2: bool = False) -> tuple[_Solved | None, int, str]:
    """Exact search over meshes: LP bounds first, then ILPs in bound order (module doc). An
    integral LP solution is already the ILP optimum of its mesh and needs no ILP. A
    ``helper`` process bounds some of the meshes meanwhile (``_Helper``, never with ``zero2``:
    parameters' ZeRO-2 options, see ``_search_with_zero2``)."""
    remote = helper.indices if helper is not None else frozenset()
    items = [(i, mp) for i, mp in enumerate(meshes_and_pins) if i not in remote]
    bounded, infeasible_need, pin_error = _bounds(gm, items, hw, train, budget, time_limit_s, progress, zero2)
    if helper is not None:
        more, need, helper_pin_error = helper.bounds()
        bounded += more
        infeasible_need = min(infeasible_need, need)
        pin_error = pin_error or helper_pin_error
    if not bounded and pin_error and not math.isfinite(infeasible_need):
        raise PinError(pin_error)
    bounded.sort(key=lambda b: (b.objective, b.index))
    best: _Solved | None = None
    solved = 0
    bound = math.inf  # min over meshes of a valid lower bound on their plans (module doc)
    unsolved: list[str] = []
    note = "exact over meshes (every other mesh's LP bound is no better)"
    for k, b in enumerate(bounded):
        mesh, pin = meshes_and_pins[b.index]
        if best is not None and b.objective >= best.prediction.step_seconds * (1 - 1e-9):
            bound = min(bound, b.objective)  # the list is sorted: no later mesh is lower
            break  # no plan on this or any later mesh can beat the best one
        if solved >= max_ilps:
            bound = min(bound, b.objective)
            note = (f"mesh search stopped after {max_ilps} ILPs; unsolved meshes have lower bounds from "
                    f"{b.objective * 1e3:.3f} ms (a bound, not a plan)")
            break
        if b.problem is None:  # bounded by the helper: build it here (same inputs, same problem)
            b.problem = _prepare(gm, mesh, hw, train, pin, zero2)
            b.lp = solve(b.problem, budget, time_limit_s=time_limit_s, relax=True)
        problem, lp = b.problem, b.lp
        if lp.integral:
            s = _Solved(mesh, problem, lp, evaluate(problem, lp.choice))
        else:
            try:
                # the search's ILPs share the time limit: a hard mesh cannot stall the plan
                s = _solve(problem, budget, time_limit_s / max_ilps)
            except InfeasibleBudgetError as exc:
                infeasible_need = min(infeasible_need, exc.need_bytes)
                continue
            except AutoparError:  # the time limit hit before any plan: the mesh keeps its LP bound
                s = _rounded_lp(mesh, problem, lp, budget)
                if s is None:
                    bound = min(bound, b.objective)
                    unsolved.append(str(mesh))
                    _progress(progress, f"mesh {mesh}: ILP stopped at its time limit without a plan")
                    continue
        solved += 1
        # the ILP's dual bound, never above the LP's (both bound this mesh's plans)
        bound = min(bound, b.objective, s.result.lower_bound_s if s.result.lower_bound_s == s.result.lower_bound_s
                    else b.objective)
        _progress(progress, f"mesh {mesh}: {'LP integral' if lp.integral else 'ILP ' + s.result.status} "
                            f"{s.prediction.step_seconds * 1e3:.3f} ms in {s.result.seconds:.1f} s")
        if best is None or s.prediction.step_seconds < best.prediction.step_seconds:
            best = s
    if unsolved:
        note += f"; no plan within the time limit on {', '.join(unsolved)} (their LP bounds count)"
    if best is None and math.isfinite(infeasible_need):
        raise InfeasibleBudgetError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device: the smallest any plan needs "
            f"is {format_bytes(infeasible_need)}; raise --memory-budget to at least that, use more devices, "
            f"or shrink the batch or sequence", infeasible_need)
    if best is not None:
        best.search_bound = min(bound, best.prediction.step_seconds)
        best.tight_elsewhere = math.isfinite(infeasible_need) or any(b.tight for b in bounded)
    return best, solved, note


def _rounded_lp(mesh, problem, lp: SolveResult, budget) -> "_Solved | None":
    """The LP solution rounded (each decision's largest option) as a plan, if it fits: the
    incumbent of a mesh whose ILP stopped at its time limit before finding one."""
    pred = evaluate(problem, lp.choice)
    if budget is not None and pred.peak_memory_bytes > budget:
        return None
    result = dataclasses.replace(lp, objective_s=pred.step_seconds, status="LP rounded (ILP time limit)")
    return _Solved(mesh, problem, result, pred)


def plan(model: nn.Module | fx.GraphModule, n_gpus: int, example_inputs: Sequence[Any] = (), *,
         hardware: str | Hardware = "a100-80gb", mesh: str | MeshSpec | None = None, strategy: str = "auto",
         memory_budget_bytes: float | None = None, optimizer: str = "adamw", mixed_precision: bool | None = None,
         example_kwargs: dict | None = None, model_name: str | None = None, time_limit_s: float = 60.0,
         baselines: bool = True, progress: bool = False, pipeline: bool = True, recompute: str = "auto",
         offload: bool = False) -> Plan:
    """Plan training ``model`` on ``n_gpus`` devices of ``hardware`` (see module doc).

    ``mesh`` pins the mesh (``"dp=2,tp=4"``); ``strategy`` pins a family (one of
    ``STRATEGY_FAMILIES``); ``memory_budget_bytes`` defaults to the device's capacity.
    ``pipeline=False`` keeps ``auto`` from choosing pipeline stages (``autopar.pipeline_search``).
    ``recompute`` is ``"auto"`` (the ILP decides per run of repeated blocks whether to recompute
    its activations), ``"full"`` (every block recomputed) or ``"none"`` (``cost_model.recompute``).
    ``offload=True`` keeps optimizer state in host memory and steps it there (``cost_model.offload``;
    planned only: the runtime does not run it yet).
    """
    t0 = _T0[0] = time.perf_counter()
    check_plan_arguments(model, n_gpus, memory_budget_bytes, model_name)
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware)
    if strategy not in STRATEGY_FAMILIES:
        raise AutoparError(f"unknown strategy {strategy!r}; pick one of {', '.join(STRATEGY_FAMILIES)}")
    # bf16 mixed precision by default where low-precision math is faster (GPUs), fp32 where it
    # is not (CPUs, a calibrated CPU profile included)
    default_mp = hw.peak_flops > 1.5 * hw.peak_flops_fp32
    train = TrainingSpec(optimizer, default_mp if mixed_precision is None else mixed_precision, recompute,
                         bool(offload))
    budget = float(memory_budget_bytes) if memory_budget_bytes is not None else float(hw.memory_bytes)
    gm = model if isinstance(model, fx.GraphModule) else trace(model, example_inputs, example_kwargs,
                                                                 stack_traces=False)
    _progress(progress, f"traced {len(gm.graph.nodes)} nodes")
    if train.recompute == "selective":  # cost_model/recompute.py: not priced inside pipeline stages yet
        pipeline = False
        if strategy == "pp" or (mesh is not None and "pp=" in str(mesh)):
            raise BadArgumentError("recompute='selective' does not run under pipeline stages yet; use "
                                   "recompute='full' (or 'auto') with pipeline stages, or drop pp= from the mesh")
    # pipeline stage plans are made for one micro-batch: the model traced again at that size
    micro_graph = None if isinstance(model, fx.GraphModule) or example_kwargs else (
        lambda m: trace(model, microbatch_inputs(example_inputs, m), stack_traces=False))
    if strategy == "pp" or (mesh is not None and "pp" in (mesh.axes if isinstance(mesh, MeshSpec) else
                                                         MeshSpec.parse(mesh, n_gpus).axes)):
        return pinned_pipeline_plan(gm, n_gpus, mesh, hw, train, budget, model_name or type(model).__name__, t0,
                                    plan, micro_graph, (lambda m: _progress(progress, m)))

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
    # recompute="auto" enters the search where memory is tight, as ZeRO-2 does (_search_with_zero2):
    # the helper's bounds and the baselines are searched without it
    first_train = dataclasses.replace(train, recompute="none") if train.recompute == "auto" else train
    helper = (_Helper(gm, candidates, hw, first_train, budget, time_limit_s, progress, n_gpus, with_baselines)
              if with_baselines or len(candidates) > 1 else None)
    try:
        best, n_solved, search_note = _search_with_zero2(gm, candidates, hw, train, budget, time_limit_s, progress,
                                                         helper)
    except AutoparError:  # nothing fits (or the solver gave up): pipeline stages may still fit
        if helper is not None:
            helper.close()
        if strategy != "auto" or mesh is not None or n_gpus == 1 or not pipeline:
            raise
        pipelined = pipeline_if_faster(gm, None, n_gpus, hw, train, budget, model_name or type(model).__name__, t0,
                                       plan, micro_graph, progress=lambda m: _progress(progress, m))
        if pipelined is None:
            raise
        return pipelined
    except BaseException:
        if helper is not None:
            helper.close()
        raise
    if best is None:
        raise AutoparError(f"no mesh could be planned for {n_gpus} devices")

    if with_baselines:
        baseline_results = helper.baselines()
        _progress(progress, f"baselines priced: {', '.join(b.name for b in baseline_results)}")
        for b in baseline_results:
            if strategy == "auto" and mesh is None and b.feasible and b.step_seconds < best.prediction.step_seconds:
                # A solver limit left the search short of a baseline: never lose to it.
                fam_best = _search_quiet(gm, _family_meshes(b.name, n_gpus, hw), hw, train, budget, time_limit_s)
                if fam_best is not None:  # the search's bound still bounds every mesh
                    fam_best.search_bound = min(best.search_bound, fam_best.prediction.step_seconds)
                    best = fam_best
    else:
        baseline_results = []
    annotate(gm, best.mesh)  # leave the graph annotated for the chosen mesh
    result = _to_plan(gm, best, hw, train, budget, strategy, baseline_results, n_gpus,
                      model_name or type(model).__name__, n_solved, time.perf_counter() - t0, search_note)
    if strategy == "auto" and mesh is None and n_gpus > 1 and pipeline:
        result = pipeline_if_faster(gm, result, n_gpus, hw, train, budget, result.model, t0, plan, micro_graph,
                                    tuple(baseline_results), lambda m: _progress(progress, m))
    return result


def _search_with_zero2(gm, candidates, hw, train, budget, time_limit_s, progress, helper):
    """The mesh search without ZeRO-2 options (nor recompute, under ``recompute="auto"``), then,
    where memory is tight (no plan fits, or the best one uses over 90% of the budget), again
    with them; the faster plan wins, so they never make a plan slower."""
    def run(zero2: bool, helper, meshes):
        spec = train if zero2 or train.recompute != "auto" else dataclasses.replace(train, recompute="none")
        return _search(gm, meshes, hw, spec, budget, time_limit_s, progress, helper=helper, zero2=zero2)

    error = None
    try:
        best, n_solved, note = run(False, helper, candidates)
    except InfeasibleBudgetError as exc:
        best, n_solved, note, error = None, 0, "", exc
    if best is not None and best.prediction.peak_memory_bytes <= 0.9 * budget and not best.tight_elsewhere:
        # Memory is not tight on any mesh. ZeRO-2 could still shorten the optimizer step a little;
        # its ILP is too slow to try every time (6 s for gpt2 on one mesh), and the zero2
        # baseline catches the cases where it is faster (plan() never returns a slower plan).
        return best, n_solved, note
    # Memory may bind on some mesh, not only on the best one: there ZeRO-2 and recompute can buy
    # faster layouts, so the first pass's bounds do not bound that mesh's plans (a 7.5B GPT on
    # 128 A100s: m0=16,m1=2,m2=4 fit loosely, while dp=32,tp=4 with recompute is faster).
    # Every mesh is bounded again with them: the second pass's bounds hold for both passes.
    why = "the best plan" if best is None or best.prediction.peak_memory_bytes > 0.9 * budget else "some meshes"
    _progress(progress, f"memory is tight for {why}: searching again with ZeRO-2 (split gradients and optimizer "
                        "state)" + (" and activation recompute" if train.recompute == "auto" else ""))
    try:
        again, n_again, note_again = run(True, None, candidates)
    except InfeasibleBudgetError:
        if best is None:
            raise error
        return best, n_solved, note
    if again is None:
        return best, n_solved + n_again, note
    if best is None or again.prediction.step_seconds < best.prediction.step_seconds:
        return again, n_solved + n_again, note_again + " (with ZeRO-2 and recompute options)"
    best.search_bound = min(best.search_bound, again.search_bound)
    return best, n_solved + n_again, note + " (bounds with ZeRO-2 and recompute options)"


_BASELINE_FAMILIES = tuple(f.name for f in families.families() if f.baseline)


def _price_baselines(gm, n_gpus, hw, train, budget, time_limit_s) -> list[BaselineResult]:
    out = []
    for family in _BASELINE_FAMILIES:
        fam_best = _search_quiet(gm, _family_meshes(family, n_gpus, hw), hw, train, budget, time_limit_s)
        if fam_best is None:
            out.append(BaselineResult(family, "", math.inf, math.inf, False))
            continue
        p = fam_best.prediction
        out.append(BaselineResult(family, str(fam_best.mesh), p.step_seconds, p.peak_memory_bytes,
                                  p.peak_memory_bytes <= budget))
    return out


# A mesh's relative cost to annotate, price and bound, by its number of axes, and the
# baselines' (measured on GPT-2 XL over 64 devices: 0.24, 0.26 and 0.65 s per 1-, 2- and 3-axis
# mesh, ~1 s for the baselines in a cold process); used only to split the work between processes.
_MESH_WEIGHT = {1: 1.0, 2: 1.1, 3: 2.7}
_BASELINES_WEIGHT = 4.0

_FORKED: tuple | None = None


def _helper_work(with_baselines: bool) -> tuple[list[_Bound], float, str, list[BaselineResult]]:
    gm, items, hw, train, budget, time_limit_s, progress, n_gpus = _FORKED
    bounds, need, pin_error = _bounds(gm, items, hw, train, budget, time_limit_s, progress)
    bounds = [_Bound(b.index, b.objective, b.integral, tight=b.tight) for b in bounds]  # the problems stay here
    baselines = _price_baselines(gm, n_gpus, hw, train, budget, time_limit_s) if with_baselines else []
    return bounds, need, pin_error, baselines


def _fork_is_safe() -> bool:
    """Fork only a plain process: under torch.distributed (parallelize plans on rank 0) the
    process runs communication threads whose locks a forked child would inherit held."""
    import torch.distributed as dist

    return hasattr(os, "fork") and not (dist.is_available() and dist.is_initialized())


class _Helper:
    """A forked process that shares the search on this 2-core machine: it bounds part of the
    candidate meshes and prices the baselines while this process bounds the rest. It inherits
    the traced graph instead of pickling it; only bounds and baseline figures come back.
    Where fork is unavailable or the child fails, this process does the work itself, same
    inputs, same answer."""

    def __init__(self, gm, meshes_and_pins, hw, train, budget, time_limit_s, progress, n_gpus, baselines: bool):
        global _FORKED
        self.args = (gm, hw, train, budget, time_limit_s, n_gpus)
        self.meshes_and_pins, self.with_baselines = meshes_and_pins, baselines
        self.indices = self._split(meshes_and_pins, baselines)
        self.pool = self.future = None
        self._bounds = self._baselines = None
        items = [(i, meshes_and_pins[i]) for i in sorted(self.indices)]
        if _fork_is_safe():
            try:
                import concurrent.futures as cf
                import multiprocessing as mp

                _FORKED = (gm, items, hw, train, budget, time_limit_s, progress, n_gpus)
                self.pool = cf.ProcessPoolExecutor(1, mp_context=mp.get_context("fork"))
                self.future = self.pool.submit(_helper_work, baselines)
            except (ValueError, OSError, RuntimeError):
                self.close()
            finally:
                _FORKED = None

    @staticmethod
    def _split(meshes_and_pins, baselines: bool) -> frozenset[int]:
        """Indices the helper bounds: heaviest meshes first, each to the lighter side."""
        order = sorted(range(len(meshes_and_pins)), key=lambda i: -_MESH_WEIGHT.get(meshes_and_pins[i][0].ndim, 4.0))
        mine, theirs, remote = 0.0, _BASELINES_WEIGHT if baselines else 0.0, set()
        for i in order:
            w = _MESH_WEIGHT.get(meshes_and_pins[i][0].ndim, 4.0)
            if theirs < mine:
                theirs += w
                remote.add(i)
            else:
                mine += w
        return frozenset(remote)

    def _collect(self) -> None:
        if self._bounds is not None:
            return
        if self.pool is not None:
            try:  # a child that dies raises BrokenProcessPool here, never hangs
                self._bounds, self._need, self._pin_error, self._baselines = self.future.result()
                return
            except Exception:  # a failed child: do its share here instead
                pass
            finally:
                self.close()
        gm, hw, train, budget, time_limit_s, n_gpus = self.args
        items = [(i, self.meshes_and_pins[i]) for i in sorted(self.indices)]
        self._bounds, self._need, self._pin_error = _bounds(gm, items, hw, train, budget, time_limit_s, False)
        self._baselines = (_price_baselines(gm, n_gpus, hw, train, budget, time_limit_s)
                           if self.with_baselines else [])

    def close(self) -> None:
        if self.pool is not None:
            procs = list((getattr(self.pool, "_processes", None) or {}).values())
            self.pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.terminate()  # a search that failed here need not wait for the child
            self.pool = None

    def bounds(self) -> tuple[list[_Bound], float, str]:
        self._collect()
        return list(self._bounds), self._need, self._pin_error

    def baselines(self) -> list[BaselineResult]:
        self._collect()
        return self._baselines


def _search_quiet(gm, meshes_and_pins, hw, train, budget, time_limit_s):
    try:  # a baseline family takes its best mesh by LP bound: one ILP per family
        return _search(gm, meshes_and_pins, hw, train, budget, time_limit_s, False, max_ilps=1)[0]
    except (InfeasibleBudgetError, PinError):  # over budget, or the family does not apply
        return None


def _plan_bound(best: _Solved) -> float:
    """The plan's reported lower bound: over every mesh the search covered (``search_bound``),
    or, for a single solve, the ILP's own dual bound."""
    r = best.result
    own = r.lower_bound_s if r.lower_bound_s == r.lower_bound_s else math.nan
    if best.search_bound == best.search_bound:
        return min(best.search_bound, own) if own == own else best.search_bound
    return own


def _to_plan(gm, best: _Solved, hw, train, budget, strategy, baseline_results, n_gpus, model_name, n_solved,
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
    return Plan(
        model=model_name, n_devices=n_gpus, mesh=best.mesh, hardware=hw.name, strategy=strategy,
        optimizer=train.optimizer, mixed_precision=train.mixed_precision, memory_budget_bytes=budget,
        step_seconds=p.step_seconds, compute_seconds=p.compute_seconds, comm_seconds=p.comm_seconds,
        param_state_bytes=p.param_state_bytes, activation_bytes=p.activation_bytes, comm_bytes=p.comm_bytes,
        solver=SolverStats(r.solver, r.status, r.seconds, r.objective_s, _plan_bound(best), r.n_variables,
                           r.n_constraints, n_solved, seconds, search_note),
        baselines=tuple(baseline_results), nodes=tuple(nodes), graph_fingerprint=graph_fingerprint(gm),
        recompute=chosen_recompute(problem, choice), host_bytes=p.host_bytes, problem=problem, choice=dict(choice),
    )
