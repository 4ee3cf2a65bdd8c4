"""The strategy ILP solved: one option per decision, minimum step time, under a memory budget
(the model, its rows and its solvers: ``cost_model.ilp_model``).

``solve`` branches on the recompute choices first. Under ``recompute="auto"`` a run of blocks is
recomputed or not by a binary r (``ilp_model``'s ``recompute`` rows), and the LP relaxation mixes
the two: it takes part of the memory a plan without recompute needs and part of the compute a
plan with it pays. Where keeping every activation does not fit, that mix is no plan at all, and
the LP bound was far below every plan: GPT-3 175B at batch 1536 on 1024 A100s, m0=128,m1=4,m2=2,
bounded 22.1 s with r free, 26.2 s with r = 1, while the best plan takes 26.5 s. So ``solve``
lists the recompute choices (each run: none, or one of its terms; ``recompute_branches``), drops
those whose least memory is over the budget (no LP needed: the same 175B mesh needs 111 GiB
without recompute and 85 GiB with attention-only recompute, 80 GiB budget), and solves each
remaining choice with its r fixed, folded into the options' costs and memory (no r or w columns:
``ilp_model._fold_recompute``): the LP bound of a mesh is the least over the choices, and the
ILPs run in order of those bounds until the next bound is no better than the best plan. With r
fixed, every mesh of that 175B search but two is bounded above the best plan (27.6-74.6 s,
against 22.1-62.3 s with r free), the best mesh's model has 10,802 columns and 1,682 rows
(23,419 and 14,362 with r free), and its ILP is optimal in 4-5 s where the ILP with r free ran to
its 20 s time limit with a 16.6% gap.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass

import numpy as np

from autopar.errors import AutoparError, format_bytes

from .ilp_model import MEMORY_SCALE, TIME_SCALE, Built, build_model, solve_cbc, solve_highs
from .problem import Problem
from .stage_weights import ilp_problem

__all__ = ["SolveResult", "LPDuals", "InfeasibleBudgetError", "solve", "min_memory_bytes", "max_memory_bytes",
           "recompute_branches"]



class InfeasibleBudgetError(AutoparError):
    """No plan fits the memory budget; ``need_bytes`` is the least memory any plan needs."""

    def __init__(self, message: str, need_bytes: float = float("nan")):
        super().__init__(message)
        self.need_bytes = need_bytes


@dataclass(frozen=True)
class LPDuals:
    """The memory rows' duals of an optimal LP relaxation, in seconds of objective per byte over
    the budget (HiGHS's signs: <= 0; 0 where a row is slack or absent). Where both are 0 the
    memory rows do not bind: the LP without them has the same optimum (LP duality), so every
    plan that keeps the other rows costs at least the LP's objective, whatever its memory."""

    memory: float  # the device memory row's
    host: float  # the host memory row's (ZeRO-Offload)


@dataclass(frozen=True)
class SolveResult:
    choice: dict[str, int]  # decision key -> option index
    objective_s: float
    lower_bound_s: float
    status: str
    solver: str
    seconds: float
    n_variables: int
    n_constraints: int
    integral: bool = True  # False for an LP relaxation whose solution is fractional
    # LP relaxations (``relax=True``) solved to optimality by HiGHS: their memory rows' duals
    # (None for a MIP, CBC, or an LP stopped early); ``autopar.zero2_bound`` reads them
    duals: "LPDuals | None" = None

    @property
    def gap(self) -> float:
        if self.objective_s <= 0 or self.lower_bound_s != self.lower_bound_s:
            return 0.0 if self.objective_s <= 0 else float("nan")
        return max(0.0, (self.objective_s - self.lower_bound_s) / self.objective_s)


# At most this many recompute choices are branched on (3 per run of blocks under "auto": none,
# the whole block, its attention); a model with more runs is solved with r free, as before.
_MAX_BRANCHES = 9


def recompute_branches(problem: Problem) -> list[frozenset[str]]:
    """The choices of the ILP's free recompute terms (``pinned is None``), each as the set of
    term keys on: per run of blocks, none or one of its terms (``recompute_one``). Empty where
    there is nothing to branch on, or more than ``_MAX_BRANCHES`` choices."""
    runs: dict[str, list[str]] = {}
    for term in problem.recompute:
        if term.pinned is None:
            runs.setdefault(term.prefix.partition(":")[0], []).append(term.key)
    if not runs:
        return []
    choices = [frozenset(k for k in picks if k is not None)
               for picks in itertools.product(*([None, *keys] for keys in runs.values()))]
    return choices if len(choices) <= _MAX_BRANCHES else []


def min_memory_bytes(problem: Problem, on: frozenset[str] | None = None) -> float:
    """A lower bound on any plan's memory: the least memory option of every decision, less what
    the recompute terms ``on`` (and the pinned ones) save; ``on=None``: with any choice of terms."""
    if on is None:
        branches = recompute_branches(problem)
        if branches:
            return min(min_memory_bytes(problem, b) for b in branches)
        on = frozenset(t.key for t in problem.recompute)  # every term's saving: still a lower bound
    saved: dict[str, list[float]] = {}
    for term in problem.recompute:
        if term.pinned or term.key in on:
            for key, per_option in term.decisions.items():
                mine = [s for _, s, _ in per_option]
                saved[key] = [max(a, b) for a, b in zip(saved[key], mine)] if key in saved else mine
    return sum(min(m - s for m, s in zip(d.memory_bytes, saved.get(k, [0.0] * len(d.memory_bytes))))
               for k, d in problem.decisions.items())


def max_memory_bytes(problem: Problem) -> float:
    """An upper bound on any plan's memory without the free recompute terms: every decision's
    largest option and every edge's largest pairing (the ILP's memory row at its most)."""
    return (sum(max(d.memory_bytes, default=0.0) for d in problem.decisions.values())
            + sum(max(e.memory.values()) for e in problem.edges if e.memory))


def _over_budget(budget: float | None, need: float, why: str = "") -> InfeasibleBudgetError:
    return InfeasibleBudgetError(
        f"no plan fits the memory budget of {format_bytes(budget)} per device: the smallest any plan needs is "
        f"{format_bytes(need)}{why}; raise the budget to at least that, use more devices, or shrink the batch "
        f"or sequence", need)


def solve(problem: Problem, memory_budget_bytes: float | None = None, solver: str = "highs",
          time_limit_s: float = 60.0, relax: bool = False, presolve: bool = True) -> SolveResult:
    """Choose one option per decision minimizing step time under the budget (module doc).
    ``relax=True`` solves the LP relaxation only: its objective bounds every plan from below,
    and when its solution is integral (``result.integral``) it is the ILP's optimum.
    ``presolve=False`` skips HiGHS's presolve: the same optimum, another optimal vertex where
    several tie (so another plan of equal objective where the LP is integral)."""
    t0 = time.perf_counter()
    problem = ilp_problem(problem)  # a pipeline stage weighs a step of m micro-batches (stage_weights.py)
    budget = memory_budget_bytes
    branches = recompute_branches(problem)
    needs = {b: min_memory_bytes(problem, b) for b in branches} or {None: min_memory_bytes(problem)}
    fits = [b for b, need in needs.items() if budget is None or need <= budget]
    if branches and (budget is None or max_memory_bytes(problem) <= budget):
        # the memory row cannot bind without recompute, and recomputing only adds time: the
        # choice without it is the optimum (the pipeline search's stage plans, budget 1e30)
        fits = [frozenset()]
    if not fits:
        # Every plan needs at least the least-memory option of each decision: infeasible without
        # asking HiGHS, which on huge meshes (GPT-3 175B on m0=1024) stopped with 'Solve error'.
        raise _over_budget(budget, min(needs.values()))
    models: dict = {}  # recompute choice (None: r free) -> its model

    def one(on, lp: bool, limit: float) -> tuple[SolveResult, np.ndarray]:
        if on not in models:
            models[on] = build_model(problem, budget, on)
        return _solve_once(models[on], problem, budget, solver, limit, lp, t0, on, presolve)

    if not branches:
        return one(None, relax, time_limit_s)[0]
    if relax and len(fits) > 1:
        free, values = one(None, True, time_limit_s)
        r = values[list(models[None].recompute.values())]
        if np.all(np.minimum(r, 1 - r) < 1e-6):
            return free  # r integral with r free: no choice's LP is lower
    lps = sorted(_branch_lps(one, fits, time_limit_s), key=lambda lp: lp[0].objective_s)
    if not lps:
        raise _over_budget(budget, min(needs.values()), " (constraint 'memory' binds)")
    if relax:
        return lps[0][0]
    return _branch_ilps(one, lps, t0 + time_limit_s)


def _branch_lps(one, fits, time_limit_s: float) -> list[tuple[SolveResult, frozenset[str]]]:
    """Each recompute choice's LP relaxation with its r fixed, and the choice (infeasible choices
    left out)."""
    out = []
    for on in fits:
        try:
            lp, _ = one(on, True, time_limit_s)
        except InfeasibleBudgetError:
            continue
        out.append((dataclasses.replace(lp, duals=None), on))  # one choice's duals do not price the others
    return out


def _branch_ilps(one, lps: list[tuple[SolveResult, frozenset[str]]], deadline: float) -> SolveResult:
    """The ILPs of the recompute choices in order of their LP bounds (``lps``), each with its r
    fixed, until the next bound is no better than the best plan. The lower bound is the least
    over the choices: a choice's ILP dual bound where it ran, else its LP bound."""
    best, lower, status = None, float("inf"), "Optimal"
    for lp, on in lps:
        if best is not None and lp.objective_s >= best.objective_s * (1 - 1e-9):
            lower = min(lower, lp.objective_s)
            break  # no later choice can beat the best plan
        left = deadline - time.perf_counter()
        try:
            if left <= 0:
                raise AutoparError("the time limit ran out before this choice's ILP")
            got = lp if lp.integral else one(on, False, left)[0]
        except InfeasibleBudgetError:
            continue
        except AutoparError:  # stopped before a plan: the choice keeps its LP bound
            lower, status = min(lower, lp.objective_s), "Time limit reached"
            continue
        lower = min(lower, got.lower_bound_s)
        if got.status != "Optimal":
            status = got.status
        if best is None or got.objective_s < best.objective_s:
            best = got
    if best is None:
        raise AutoparError("the ILP solver stopped before finding any plan; raise the time limit")
    return dataclasses.replace(best, lower_bound_s=min(lower, best.objective_s), status=status, duals=None)


def _solve_once(built: Built, problem: Problem, budget: float | None, solver: str, time_limit_s: float,
                relax: bool, t0: float, on: frozenset[str] | None = None, presolve: bool = True
                ) -> tuple[SolveResult, np.ndarray]:
    """One solve of ``built``, the model of the recompute choice ``on`` (None: r free)."""
    backends = {"highs": solve_highs, "cbc": solve_cbc}
    order = [solver] + [s for s in backends if s != solver]
    result, used, errors = None, None, []
    for name in order:
        try:
            result = backends[name](built.model, time_limit_s, relax, presolve)
            used = name
            break
        except ImportError as exc:  # highspy missing: CBC takes over
            errors.append(f"{name}: {exc}")
    if result is None:
        raise AutoparError(f"no ILP solver worked ({'; '.join(errors)}); install highspy or PuLP")
    status, values, objective, bound, duals = result
    if status == "Infeasible":
        raise _over_budget(budget, min_memory_bytes(problem, on), " (constraint 'memory' binds)")
    if values is None:
        raise AutoparError(f"the ILP solver stopped with status {status!r} before finding any plan; "
                           f"raise the time limit")
    m = built.model
    objective, bound = objective / TIME_SCALE, bound / TIME_SCALE
    choice = {k: int(np.argmax(values[cols])) for k, cols in built.x.items()}
    choice.update({k: int(values[c] > 0.5) for k, c in built.recompute.items()})  # recompute of block runs
    if on is not None:  # folded into the options (ilp_model._fold_recompute)
        choice.update({t.key: int(bool(t.pinned) or t.key in on) for t in problem.recompute})
    integral = bool(np.all(np.minimum(values[m_int := np.asarray(m.integer)], 1 - values[m_int]) < 1e-6))
    if relax and integral:
        status = "Optimal"  # an integral LP optimum is the ILP optimum: no branching needed
    lp_duals = None if duals is None else LPDuals(*(
        float(duals[start]) / TIME_SCALE * MEMORY_SCALE if end > start else 0.0
        for start, end in zip(built.memory_rows, built.memory_rows[1:])))
    return SolveResult(choice, objective, bound, status, used, time.perf_counter() - t0, len(m.cost),
                       len(m.row_lower), integral, lp_duals), values
