"""The first pass of the mesh search leaves a mesh whose plan walks over the budget to the second
pass (``autopar.mesh_search.search_with_zero2``): no re-solves under tightened rows there, the
same plan as when it re-solved, and the first pass in full when the second plans nothing."""

import math
import types

import autopar.mesh_search as mesh_search
from autopar.cost_model.hardware import get_hardware
from autopar.errors import AutoparError
from autopar.models import get_model
from autopar.planner import plan

BUDGET = 1.9e6  # under it, gpt-tiny's first-pass plan on m0=2,m1=2 walks over (its gradients in flight)


def test_an_over_budget_mesh_is_not_resolved_in_the_first_pass_and_the_plan_is_unchanged(monkeypatch):
    model, inputs = get_model("gpt-tiny", batch_size=8, seq_len=16, device="meta")  # as tests/test_runtime.py runs it
    rows: list[float | None] = []  # the memory row of every ILP the mesh search solved
    real_solve = mesh_search.solve

    def counted(problem, budget=None, *args, relax=False, **kwargs):
        if not relax:
            rows.append(budget)
        return real_solve(problem, budget, *args, relax=relax, **kwargs)

    monkeypatch.setattr(mesh_search, "solve", counted)
    lines: list[str] = []
    monkeypatch.setattr(mesh_search.Progress, "__call__", lambda self, message: lines.append(message))
    deferred = plan(model, 4, inputs, hardware="a100-80gb", mixed_precision=False, baselines=False,
                    memory_budget_bytes=BUDGET, progress=True)
    assert any("walks over the budget" in line for line in lines), lines
    tightened = [row for row in rows if row is not None and row < BUDGET]
    assert not tightened, f"the first pass re-solved under tightened rows {tightened}"

    # the search as it was: every mesh re-solved in the first pass, whatever the second does
    real_solve_mesh = mesh_search.solve_mesh
    monkeypatch.setattr(mesh_search, "solve_mesh", lambda *a, defer_over_budget=False, **k: real_solve_mesh(*a, **k))
    rows.clear()
    resolved = plan(model, 4, inputs, hardware="a100-80gb", mixed_precision=False, baselines=False,
                    memory_budget_bytes=BUDGET)
    assert any(row is not None and row < BUDGET for row in rows), "the premise: re-solves happen"
    assert deferred.step_seconds <= resolved.step_seconds * (1 + 1e-9), (deferred.step_seconds, resolved.step_seconds)
    assert deferred.peak_memory_bytes_per_device <= BUDGET
    assert str(deferred.mesh) == str(resolved.mesh)


def _fake_passes(monkeypatch, second):
    """``search_meshes`` faked: the first pass defers its one mesh, the second does ``second()``,
    and a first pass without deferral plans it. Returns the calls as (zero2, deferring)."""
    calls: list[tuple[bool, bool]] = []
    planned = mesh_search.Solved("mesh0", types.SimpleNamespace(stage=None), types.SimpleNamespace(),
                                 types.SimpleNamespace(step_seconds=1.0, peak_memory_bytes=0.0), search_bound=0.5)

    def search_meshes(gm, meshes, hw, train, budget, time_limit_s, progress, helper=None, zero2=False, deferred=None):
        calls.append((zero2, deferred is not None))
        if zero2:
            return second(planned)
        if deferred is not None:
            deferred.append("mesh0")
            return None, 0, ""
        return planned, 1, "first pass"

    monkeypatch.setattr(mesh_search, "search_meshes", search_meshes)
    return calls, planned


def _search():
    train = types.SimpleNamespace(recompute="none")
    return mesh_search.search_with_zero2(None, [("mesh0", None)], get_hardware("a100-80gb"), train, 1.0, 60.0,
                                         mesh_search.QUIET, None)


def test_the_first_pass_runs_in_full_when_the_second_plans_nothing(monkeypatch):
    def fails(planned):
        raise AutoparError("the solver stopped before any plan")

    calls, planned = _fake_passes(monkeypatch, fails)
    best, n_solved, note = _search()
    assert calls == [(False, True), (True, False), (False, False)], calls
    assert best is planned and note == "first pass" and n_solved == 1


def test_no_second_first_pass_when_the_second_plans(monkeypatch):
    def plans(planned):
        again = mesh_search.Solved("mesh0", planned.problem, planned.result,
                                   types.SimpleNamespace(step_seconds=0.9, peak_memory_bytes=0.0), search_bound=0.8)
        return again, 1, "second pass"

    calls, _ = _fake_passes(monkeypatch, plans)
    best, n_solved, note = _search()
    assert calls == [(False, True), (True, False)], calls
    assert best.prediction.step_seconds == 0.9 and math.isclose(best.search_bound, 0.8)
