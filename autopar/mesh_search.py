"""The exact search over candidate meshes (``autopar.planner``'s steps 2 and 3): each mesh's LP
bound, then ILPs in bound order until no unsolved mesh's bound beats the best plan, and a second
pass with ZeRO-2 and recompute options where memory may bind. ``Solved`` is a mesh's plan with
the least step time any plan on any searched mesh could take (``search_bound``)."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from .cost_model.costs import TrainingSpec
from .cost_model.evaluate import Prediction, evaluate
from .cost_model.hardware import Hardware
from .cost_model.ilp import InfeasibleBudgetError, SolveResult, solve
from .cost_model.problem import PinError, Problem, build_problem
from .cost_model.stage_weights import held_peak_bytes
from .errors import AutoparError, format_bytes
from .mesh import MeshSpec
from .passes.annotate import annotate
from .technique import Pin
from .zero2_bound import options_bound

__all__ = ["Progress", "QUIET", "Solved", "Bound", "prepare_problem", "solve_mesh", "mesh_bounds", "search_meshes",
           "rounded_lp", "search_with_zero2", "search_quiet", "plan_bound"]


@dataclass
class Solved:
    mesh: MeshSpec
    problem: Problem
    result: SolveResult
    prediction: Prediction
    # the least step time any plan on any mesh this search covered could take (valid LP or
    # MIP dual bounds, min over meshes); NaN until the mesh search sets it
    search_bound: float = math.nan
    tight_elsewhere: bool = False  # some mesh the search bounded may be limited by memory
    # meshes the solver could not bound (a status such as 'Solve error'): the search is not exact
    # over them, so the plan reports no lower bound (NaN), never one that may not hold
    unbounded: tuple[str, ...] = ()
    # a first pass's (no ZeRO-2, no recompute options): the least step time any plan on any
    # mesh it bounded could take WITH those options (``options_bound``); NaN where unknown
    options_bound: float = math.nan


def prepare_problem(gm: fx.GraphModule, mesh: MeshSpec, hw: Hardware, train: TrainingSpec, pin: Pin | None,
             zero2: bool = False) -> Problem:
    annotate(gm, mesh)
    # ZeRO-2 options enter the search when memory asks for them (search_with_zero2) or a family
    # pins them: releasing gradient all-reduces makes the LP relaxation fractional (gpt2 on 8:
    # 3 ILPs and 37 s instead of one integral LP in 2 s).
    return build_problem(gm, mesh, hw, train, pin, zero2=zero2 or (pin is not None and pin.zero2))


class MemoryBinds(AutoparError):
    """A first pass's plan on a mesh walks over the budget (``solve_mesh(defer_over_budget=True)``):
    the mesh is left to the second pass, whose ZeRO-2 and recompute options it needs anyway."""


def solve_mesh(problem: Problem, budget: float | None, time_limit_s: float,
               first: SolveResult | None = None, defer_over_budget: bool = False) -> Solved:
    """The mesh's plan under ``budget`` (``first``: a solve already made with the budget's row,
    such as an integral LP). The ILP's memory row is the sum of what a plan keeps; the walked
    peak also holds one op's gradients in flight (cost_model/grad_transients.py), a max the
    linear row cannot carry. A plan whose walk goes over the budget is solved again with the
    row tightened by its excess (halfway back to the last row with a plan where a row had
    none), ``_RESOLVES`` times at most, until a plan's walk fits; a mesh where none does is
    infeasible (never a plan over its budget). The rows never loosen again after a fit: the
    rows between a fit and an overshoot are the hard ones for HiGHS (on gpt-longseq's 2x2
    mesh with ZeRO-2 and recompute options, 1-7 s at the first rows, the time limit there).
    ``defer_over_budget``: raise ``MemoryBinds`` instead of re-solving (a first pass whose second
    pass will run: ``search_with_zero2``).

    A plan must be a function of its inputs (the ranks and the process that checks them plan
    alike), so only solves that reached their optimum count: a solve stopped by its wall-clock
    limit answers by how loaded the machine was, and ends the re-solving (the mesh is then
    infeasible here, as far as this search knows). The first solve and its re-solves share the
    time limit."""
    def walked(pred: Prediction, choice: dict) -> float:  # a pipeline stage: with its micro-batches in flight
        return held_peak_bytes(problem, choice, pred)

    # the first solve and its re-solves share the time limit: a mesh whose walks go over the
    # budget cannot take several limits (GPT-3 175B on 1024, m0=128,m1=8: 337 s in all)
    deadline = time.perf_counter() + time_limit_s
    result = first if first is not None else solve(problem, budget, time_limit_s=time_limit_s)
    pred = evaluate(problem, result.choice)
    if budget is None or walked(pred, result.choice) <= budget:
        return Solved(problem.mesh, problem, result, pred)
    if defer_over_budget:
        raise MemoryBinds(f"the plan on mesh {problem.mesh} walks over the budget of {format_bytes(budget)}")
    first_bound, least = result.lower_bound_s, walked(pred, result.choice)
    over_row, dead_row, row = budget, -math.inf, budget  # rows known to give a plan over the budget, none at all
    walk: float | None = least
    for _ in range(_RESOLVES):
        if walk is None:
            dead_row = row
            row = (dead_row + over_row) / 2
        else:
            over_row = min(over_row, row)
            row -= walk - budget
            if row <= dead_row:
                row = (dead_row + over_row) / 2
        if over_row - dead_row < 0.01 * budget:
            break  # the rows tried bracket the budget's within 1%
        left = deadline - time.perf_counter()
        if left <= 0:
            break  # the mesh's share is spent
        try:
            result = solve(problem, row, time_limit_s=left)
        except InfeasibleBudgetError:
            walk = None
            continue
        except AutoparError:  # no plan within the time limit
            break
        if result.status != "Optimal":
            break  # stopped by the clock: not a function of the inputs
        pred = evaluate(problem, result.choice)
        walk = walked(pred, result.choice)
        least = min(least, walk)
        if walk <= budget:
            # a tighter row's dual bound does not bound the budget's plans: the first solve's does
            bound = min(result.lower_bound_s, first_bound) if first_bound == first_bound else math.nan
            return Solved(problem.mesh, problem, dataclasses.replace(result, lower_bound_s=bound), pred)
    raise InfeasibleBudgetError(
        f"no plan on mesh {problem.mesh} fits the memory budget of {format_bytes(budget)} per device once "
        f"the gradients in flight are walked: the least found needs {format_bytes(least)}", least)


# re-solves of a mesh whose walked peak exceeds the budget (solve_mesh)
_RESOLVES = 4


@dataclass(frozen=True)
class Progress:
    """Progress lines on stderr (``plan(progress=True)``), each with the time since ``t0``, the
    start of the plan() call that owns it; ``Progress(False)`` prints nothing."""

    enabled: bool
    t0: float = 0.0

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"  [autopar {time.perf_counter() - self.t0:5.1f} s] {message}", file=sys.stderr, flush=True)


QUIET = Progress(False)


@dataclass
class Bound:
    """A mesh's LP bound. ``problem`` and ``lp`` are None when a helper process computed it:
    the problem (fx nodes and all) stays there, and is rebuilt here only if the mesh is solved."""

    index: int
    objective: float
    integral: bool
    problem: Problem | None = None
    lp: SolveResult | None = None
    tight: bool = False  # the LP's rounded plan needs over 90% of the budget: memory may bind
    # first pass only: a bound on this mesh's plans with ZeRO-2 and recompute options too
    options_bound: float = math.nan
    # the step of the LP solution rounded to a plan (each decision's largest option) where that
    # plan fits the budget, else NaN: search_meshes solves the best such mesh's ILP first
    rounded_s: float = math.nan


def mesh_bounds(gm, items, hw, train, budget, time_limit_s, progress, zero2: bool = False
            ) -> tuple[list[Bound], float, str, tuple[str, ...]]:
    """LP bounds of the meshes ``items`` ((index, (mesh, pin)) pairs), the least memory any
    infeasible one needs, why a mesh could not follow its pinned family ("" if none), and the
    meshes the solver failed on (no bound: each is skipped alone, never the rest of the search)."""
    out, need, pin_error, failed = [], math.inf, "", []
    for index, (mesh, pin) in items:
        try:
            problem = prepare_problem(gm, mesh, hw, train, pin, zero2)
        except PinError as exc:  # e.g. a 3-axis mesh whose data axis exceeds the batch
            progress(f"mesh {mesh}: skipped ({exc.short})")
            pin_error = str(exc)
            continue
        try:
            lp = solve(problem, budget, time_limit_s=time_limit_s, relax=True, presolve=_presolve(zero2))
        except InfeasibleBudgetError as exc:
            need = min(need, exc.need_bytes)
            continue
        except AutoparError as exc:  # e.g. HiGHS's 'Solve error' on a huge mesh: this mesh only
            progress(f"mesh {mesh}: no LP bound ({exc})")
            failed.append(str(mesh))
            continue
        pred = evaluate(problem, lp.choice)  # a pipeline stage: with its micro-batches in flight
        held = held_peak_bytes(problem, lp.choice, pred)
        tight = budget is not None and held > 0.9 * budget
        rounded = pred.step_seconds if budget is None or held <= budget else math.nan
        wider = math.nan if zero2 else options_bound(problem, lp, hw)
        out.append(Bound(index, lp.objective_s, lp.integral, problem, lp, tight, wider, rounded))
        progress(f"mesh {mesh}: lower bound {lp.objective_s * 1e3:.3f} ms ({problem.n_variables()} vars"
                            f"{', integral' if lp.integral else ''})")
    return out, need, pin_error, tuple(failed)


def _presolve(zero2: bool) -> bool:
    """Whether a mesh's LP bound runs HiGHS's presolve. With ZeRO-2 and recompute options the LPs
    are the large fractional ones (bounds; the plans come from ILPs, which keep presolve), and
    they solve faster without it: its dependent-equation search over the edge rows took most of
    their time (GPT-3 175B on 1024: m0=128,m1=2,m2=4 2.5 -> 0.7 s, m0=2,m1=16,m2=32 1.1 -> 0.5 s,
    same optimum). Without those options the LP is often integral, its solution the plan, and
    presolve stays: skipping it picked another of equally fast plans (ZeRO-3 on gpt-tiny, whose
    measured step peak then missed the prediction by 17-39%: tests/test_recompute.py)."""
    return not zero2


def search_meshes(gm, meshes_and_pins, hw, train, budget, time_limit_s, progress, max_ilps: int = 3,
            helper: "Any" = None, zero2: bool = False, deferred: list[str] | None = None
            ) -> tuple[Solved | None, int, str]:
    """Exact search over meshes: LP bounds first, then ILPs in bound order (module doc). An
    integral LP solution is already the ILP optimum of its mesh and needs no ILP. A
    ``helper`` process bounds some of the meshes meanwhile (the planner's forked helper), with the
    same options (``train``, ``zero2``: parameters' ZeRO-2 options, see ``search_with_zero2``).
    ``deferred`` (a first pass): a mesh whose plan walks over the budget is not re-solved but
    appended there, keeping its LP bound, and counts as tight (``Solved.tight_elsewhere``)."""
    if helper is not None and (helper.zero2 != zero2 or helper.bounds_train != train):
        raise ValueError("the helper bounds meshes with other options than this search's")
    search_started = time.perf_counter()
    # with a helper, the meshes are taken from a queue the two processes share (planner._Helper)
    items = helper.take_meshes() if helper is not None else list(enumerate(meshes_and_pins))
    bounded, infeasible_need, pin_error, failed = mesh_bounds(gm, items, hw, train, budget, time_limit_s, progress,
                                                              zero2)
    if helper is not None:
        more, need, helper_pin_error, helper_failed = helper.bounds()
        bounded += more
        infeasible_need = min(infeasible_need, need)
        pin_error = pin_error or helper_pin_error
        failed += helper_failed
    if not bounded and pin_error and not math.isfinite(infeasible_need) and not failed:
        raise PinError(pin_error)
    bounded.sort(key=lambda b: (b.objective, b.index))
    defer = deferred is not None  # a first pass: over-budget meshes go to the second (solve_mesh)
    _dive_first(bounded)
    bounds_seconds = time.perf_counter() - search_started
    best: Solved | None = None
    solved, ilp_seconds = 0, 0.0
    bound = math.inf  # min over meshes of a valid lower bound on their plans (module doc)
    unsolved: list[str] = []
    note = "exact over meshes (every other mesh's LP bound is no better)"
    for k, b in enumerate(bounded):
        mesh, pin = meshes_and_pins[b.index]
        if best is not None and b.objective >= best.prediction.step_seconds * (1 - 1e-9):
            bound = min(bound, b.objective)  # sorted after the first (_dive_first): no later mesh is lower
            break  # no plan on this or any later mesh can beat the best one
        # The ILPs share the time limit, each at most its 1/max_ilps share: the next starts only
        # while its share still fits (max_ilps ILPs that use theirs; more where they end sooner:
        # 7.5B GPT on 128, the fourth, m0=16,m1=8, was the best plan and 1.6 s away)
        # Once a plan exists, the time limit is the whole search's: the bounds' time counts, and
        # so do ILPs that found no plan within the budget (GPT-3 175B on 1024: uncounted, they
        # took the ILPs to 374 s of a 60 s limit, after 53 s of bounds)
        spent = bounds_seconds + ilp_seconds
        if (solved >= max_ilps or best is not None) and spent + time_limit_s / max_ilps > time_limit_s:
            bound = min(bound, b.objective)
            note = (f"mesh search stopped after {solved} ILPs ({spent:.0f} s with the bounds); unsolved meshes "
                    f"have lower bounds from {b.objective * 1e3:.3f} ms (a bound, not a plan)")
            break
        if b.problem is None:  # bounded by the helper: build it here (same inputs, same problem)
            b.problem = prepare_problem(gm, mesh, hw, train, pin, zero2)
            b.lp = solve(b.problem, budget, time_limit_s=time_limit_s, relax=True, presolve=_presolve(zero2))
        problem, lp = b.problem, b.lp
        started = time.perf_counter()
        try:
            if lp.integral:  # the ILP's optimum, unless its walk goes over the budget
                s = solve_mesh(problem, budget, time_limit_s / max_ilps, first=lp, defer_over_budget=defer)
            else:
                # the search's ILPs share the time limit: a hard mesh cannot stall the plan
                s = solve_mesh(problem, budget, time_limit_s / max_ilps, defer_over_budget=defer)
        except MemoryBinds:
            deferred.append(str(mesh))  # type: ignore[union-attr]  # raised only where defer
            bound = min(bound, b.objective)
            progress(f"mesh {mesh}: its plan walks over the budget; left to the pass with more memory options")
            continue
        except InfeasibleBudgetError as exc:
            infeasible_need = min(infeasible_need, exc.need_bytes)
            # its LP bound still counts: re-solves stopped by the clock prove no infeasibility
            bound = min(bound, b.objective)
            progress(f"mesh {mesh}: no plan found within the budget ({format_bytes(exc.need_bytes)} the least)")
            continue
        except AutoparError:  # the time limit hit before any plan: the mesh keeps its LP bound
            s = rounded_lp(mesh, problem, lp, budget)
            if s is None:
                bound = min(bound, b.objective)
                unsolved.append(str(mesh))
                progress(f"mesh {mesh}: ILP stopped at its time limit without a plan")
                continue
        finally:
            ilp_seconds += time.perf_counter() - started
        solved += 1
        # the ILP's dual bound, never above the LP's (both bound this mesh's plans)
        bound = min(bound, b.objective, s.result.lower_bound_s if s.result.lower_bound_s == s.result.lower_bound_s
                    else b.objective)
        progress(f"mesh {mesh}: {'LP integral' if lp.integral else 'ILP ' + s.result.status} "
                            f"{s.prediction.step_seconds * 1e3:.3f} ms in {s.result.seconds:.1f} s")
        if best is None or s.prediction.step_seconds < best.prediction.step_seconds:
            best = s
    if unsolved:
        note += f"; no plan within the time limit on {', '.join(unsolved)} (their LP bounds count)"
    if failed:
        note = note.replace("exact over meshes", "searched meshes", 1)
        note += f"; the solver failed on {', '.join(failed)} (no bound there: the plan's gap is unknown)"
    if best is None and failed and not math.isfinite(infeasible_need):
        raise AutoparError(f"the ILP solver failed on every mesh it could bound ({', '.join(failed)}) and no "
                           "other mesh was planned; pin a mesh (mesh='dp=..,tp=..') or raise the time limit")
    if best is None and math.isfinite(infeasible_need):
        raise InfeasibleBudgetError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device: the smallest any plan needs "
            f"is {format_bytes(infeasible_need)}; raise --memory-budget to at least that, use more devices, "
            f"or shrink the batch or sequence", infeasible_need)
    if best is not None:
        best.search_bound = min(bound, best.prediction.step_seconds)
        best.unbounded = failed
        best.tight_elsewhere = math.isfinite(infeasible_need) or any(b.tight for b in bounded) or bool(deferred)
        wider = [b.options_bound for b in bounded]
        best.options_bound = min(wider) if wider and all(w == w for w in wider) else math.nan
    return best, solved, note


def _dive_first(bounded: list[Bound]) -> None:
    """Move the mesh whose rounded LP plan is fastest to the front of the ILP order, where it
    beats the first mesh's (or the first one's does not fit): best-first by bound proves the
    plan, but under the time limit the search also needs a good plan early, and a mesh whose LP
    already rounds to a fast plan is the likeliest to give one in its ILP. A 7.5B GPT on 128
    A100s: the lowest bounds were 3-axis meshes (2157-2161 ms) whose ILPs planned 2199-2321 ms
    in 9-16 s each, and the time limit stopped the search before m0=16,m1=8 (bound 2186.7 ms,
    its LP rounds to 2184.5 ms, its ILP 2184.3 ms in under 2 s). The rest stay in bound order,
    so the search's stopping rule and reported bound are unchanged."""
    if len(bounded) < 2:
        return
    steps = [b.rounded_s if b.rounded_s == b.rounded_s else math.inf for b in bounded]  # NaN: over the budget
    k = min(range(len(bounded)), key=lambda i: (steps[i], i))
    if steps[k] < steps[0]:
        bounded.insert(0, bounded.pop(k))


def rounded_lp(mesh, problem, lp: SolveResult, budget) -> "Solved | None":
    """The LP solution rounded (each decision's largest option) as a plan, if it fits: the
    incumbent of a mesh whose ILP stopped at its time limit before finding one."""
    pred = evaluate(problem, lp.choice)
    if budget is not None and pred.peak_memory_bytes > budget:
        return None
    result = dataclasses.replace(lp, objective_s=pred.step_seconds, status="LP rounded (ILP time limit)")
    return Solved(mesh, problem, result, pred)


def search_with_zero2(gm, candidates, hw, train, budget, time_limit_s, progress, helper, skip_first: bool = False,
                      helper_again: "Callable[[], Any] | None" = None):
    """The mesh search without ZeRO-2 options (nor recompute, under ``recompute="auto"``), then,
    where memory is tight (no plan fits, or the best one uses over 90% of the budget), again
    with them; the faster plan wins, so they never make a plan slower. The second pass's options
    include the first's, so the first only saves time: ``skip_first`` (the planner's guess that
    nothing fits without them) goes to the second at once, and a wrong guess costs time, never
    a plan. ``helper`` bounds part of the first searched pass's meshes (the second's where
    ``skip_first``); ``helper_again()`` starts one for the second pass."""
    def run(zero2: bool, helper, meshes, deferred: list[str] | None = None):
        spec = train if zero2 or train.recompute != "auto" else dataclasses.replace(train, recompute="none")
        return search_meshes(gm, meshes, hw, spec, budget, time_limit_s, progress, helper=helper, zero2=zero2,
                             deferred=deferred)

    def first_pass(deferred: list[str] | None, helper):
        try:
            return (*run(False, helper, candidates, deferred), None)
        except PinError:
            raise
        except AutoparError as exc:  # nothing fits, or the solver failed on every mesh: the second pass may plan
            return None, 0, "", exc

    if skip_first:
        progress("memory is tight on every mesh (the forward's outputs over the devices exceed the budget): "
                 "searching with ZeRO-2 and recompute options at once")
        return run(True, helper, candidates)
    # A mesh whose first-pass plan walks over the budget is left to the second pass, which then
    # runs (memory binds there) with options that include the first's: its re-solves under
    # tightened rows (HiGHS's hard rows; gpt-tiny on 4 devices under 2 MB: 9 s of 12) would only
    # buy a fallback. Should the second pass plan nothing, the first runs again in full.
    deferred: list[str] = []
    best, n_solved, note, error = first_pass(deferred, helper)
    held = math.inf if best is None else held_peak_bytes(best.problem, best.result.choice, best.prediction)
    if (best is not None and held <= 0.9 * budget and not best.tight_elsewhere
            and best.options_bound == best.options_bound and not _options_may_win(best, held, budget, candidates)):
        # Memory is not tight on any mesh. ZeRO-2 could still shorten the optimizer step a little;
        # its ILP is too slow to try every time (6 s for gpt2 on one mesh), and the zero2
        # baseline catches the cases where it is faster (plan() never returns a slower plan).
        # The reported bound must hold for those options too: the first pass's LPs with the
        # columns they lack priced by its duals (autopar.zero2_bound; where that gives no bound,
        # a memory row binds somewhere, and the pass runs).
        return _widened(best), n_solved, note
    # Memory may bind on some mesh, not only on the best one: there ZeRO-2 and recompute can buy
    # faster layouts, so the first pass's bounds do not bound that mesh's plans (a 7.5B GPT on
    # 128 A100s: m0=16,m1=2,m2=4 fit loosely, while dp=32,tp=4 with recompute is faster).
    # Every mesh is bounded again with them: the second pass's bounds hold for both passes.
    why = ("memory is tight for the best plan" if best is None or held > 0.9 * budget else
           "the options may reach a faster plan on this mesh" if len(candidates) == 1 else
           "memory is tight for some meshes")
    progress(f"{why}: searching again with ZeRO-2 (split gradients and optimizer "
                        "state)" + (" and activation recompute" if train.recompute == "auto" else ""))
    try:
        again, n_again, note_again = run(True, helper_again() if helper_again is not None else None, candidates)
    except PinError:
        raise
    except AutoparError as exc:
        again, n_again, note_again = None, 0, ""
        error = error or exc
    if again is None and deferred:  # the deferred meshes' first-pass plans, re-solved after all
        progress(f"no plan with the options: planning {', '.join(deferred)} again without them")
        best, n_first, note, error = first_pass(None, None)
        n_solved += n_first
    if again is None:
        if best is None:
            raise error  # type: ignore[misc]
        return _widened(best), n_solved + n_again, note
    if best is None or again.prediction.step_seconds < best.prediction.step_seconds:
        if best is not None:
            again.unbounded += best.unbounded
        return again, n_solved + n_again, note_again + " (with ZeRO-2 and recompute options)"
    best.search_bound = min(best.search_bound, again.search_bound)
    best.unbounded += again.unbounded
    return best, n_solved + n_again, note + " (bounds with ZeRO-2 and recompute options)"


# A single mesh's plan using over this share of the budget, whose options bound is lower by
# more than this share of its step, is planned again with ZeRO-2 and recompute options
# (``_options_may_win``).
_OPTIONS_MEMORY_SHARE, _OPTIONS_GAP = 0.5, 0.1


def _options_may_win(best: Solved, held: float, budget: float, candidates) -> bool:
    """Whether a pinned mesh (one candidate) gets the second pass although its memory is not
    tight: its plan holds over half the budget and the first pass's options bound is more than
    10% under its step, so ZeRO-2 or recompute may well buy a faster plan on that mesh (a 7.5B
    GPT on 128 A100s pinned to dp=16,tp=8: 2896.6 ms at 87% of the budget, bound 1865.9 ms;
    auto found 2184.3 ms on the same mesh with the options). One mesh's second pass is one LP
    and at most one ILP; over every mesh of a free search it would double the search, and
    there the baselines (zero2 among them) and ``tight_elsewhere`` already decide. Pipeline
    stages (``problem.stage``) keep one pass: the pipeline search plans many of them (each
    stage of each candidate split), and a second pass each would multiply its time."""
    if len(candidates) != 1 or best.problem.stage is not None or held <= _OPTIONS_MEMORY_SHARE * budget:
        return False
    return best.options_bound < (1.0 - _OPTIONS_GAP) * best.prediction.step_seconds


def _widened(best: Solved) -> Solved:
    """A first pass's plan whose search bound also holds for ZeRO-2 and recompute options (the
    second pass did not bound them): min with ``options_bound``; where that is unknown, the plan
    reports no bound."""
    if best.options_bound == best.options_bound:
        best.search_bound = min(best.search_bound, best.options_bound)
    else:
        best.unbounded += ("ZeRO-2/recompute options (no LP dual prices)",)
    return best


def search_quiet(gm, meshes_and_pins, hw, train, budget, time_limit_s):
    try:  # a baseline family takes its best mesh by LP bound: one ILP per family
        return search_meshes(gm, meshes_and_pins, hw, train, budget, time_limit_s, QUIET, max_ilps=1)[0]
    except (InfeasibleBudgetError, PinError):  # over budget, or the family does not apply
        return None


def plan_bound(best: Solved) -> float:
    """The plan's reported lower bound: over every mesh the search covered (``search_bound``),
    or, for a single solve, the ILP's own dual bound."""
    if best.unbounded:  # some mesh has no bound (module doc of Solved.unbounded)
        return math.nan
    r = best.result
    own = r.lower_bound_s if r.lower_bound_s == r.lower_bound_s else math.nan
    # The ILP's objective subtracts the communication hidden behind compute as the step does
    # (cost_model.ilp_model._add_overlap), so its bounds bound the step as they are.
    return (min(best.search_bound, own) if own == own else best.search_bound) \
        if best.search_bound == best.search_bound else own
