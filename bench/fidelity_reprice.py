"""A plan priced again under another hardware profile, its layout unchanged: the same mesh and
every decision's same option, priced by the cost model with the other profile's rates.

``bench/fidelity.py`` calibrates again during its rounds (three times; ``median_profile``
combines them, ``fit_to_rounds`` fits its compute efficiency to calibrate's reference step as
timed in the rounds) and prices the plans it timed with that profile. Planning them again would not
do: on another profile the planner may pick another layout for a family (a cut of the
embedding, a ZeRO axis), and that layout's price says nothing about the one timed. autopar itself never needs this (a plan is priced where
it is made), so it lives with the bench.
"""

from __future__ import annotations

from statistics import median

from autopar.cost_model.evaluate import evaluate
from autopar.cost_model.hardware import Hardware
from autopar.cost_model.problem import build_problem
from autopar.passes.annotate import annotate

__all__ = ["median_profile", "fit_to_rounds", "price_again"]


def median_profile(profiles: list[dict]) -> dict:
    """One profile from several calibrations of the same machine (``Hardware.to_json`` dicts):
    every number the median of its values, each measured collective's bandwidth and latency
    (rows matched by collective and group size) too. This machine's speed moves within a minute;
    calibrations spread across the rounds describe the minutes the rounds ran in."""
    first = profiles[0]
    out: dict = {}
    for key, value in first.items():
        if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
            out[key] = value
        elif isinstance(value, dict):
            out[key] = median_profile([p[key] for p in profiles])
        else:  # a count (devices per node) stays a whole number
            out[key] = type(value)(median([p[key] for p in profiles]))
    if "per_collective" in first:
        rows = []
        for kind, n, _, _ in first["per_collective"]:
            same = [r for p in profiles for r in p["per_collective"] if r[0] == kind and r[1] == n]
            rows.append([kind, n, median([r[2] for r in same]), median([r[3] for r in same])])
        out["per_collective"] = rows
    return out


def fit_to_rounds(profile: dict, reference_s: float) -> dict:
    """``profile`` (a ``Hardware.to_json`` dict) with its compute efficiency fitted, as ``autopar
    calibrate`` fits it, to calibrate's reference step as the bench timed it in its rounds
    (``autopar.calibrate_reference.fit_efficiency``). Why: a calibration times that step over a
    few seconds; the rounds spread over minutes in which this machine's speed moves by 10-30%.
    The step is no plan of the bench's, so no plan's figure feeds its own price."""
    from autopar.calibrate_reference import fit_efficiency

    fit = fit_efficiency(Hardware.from_json(profile), reference_s)
    return dict(profile, efficiency=fit.efficiency)


def price_again(plan, hardware: Hardware) -> float | None:
    """``plan``'s step seconds under ``hardware``; ``plan`` is an in-memory plan (``autopar.plan``
    keeps its problem and choice). None where that cannot be done exactly: a pipelined plan (its
    stages are priced by the pipeline search) or a decision whose option is not offered again."""
    problem, choice = plan.problem, plan.choice
    if problem is None or plan.pipeline is not None or not problem.decisions:
        return None
    gm = next(iter(problem.decisions.values())).node.graph.owning_module
    mesh = hardware.mesh_spec(problem.mesh.axes, problem.mesh.sizes)  # the mesh's links: this profile's
    annotate(gm, mesh)  # the search may have annotated the graph for another mesh last
    # no pins and ZeRO-2 offered: every option a pinned family or the search could have chosen
    again = build_problem(gm, mesh, hardware, problem.train, None, zero2=True)
    mapped: dict[str, int] = {}
    for key, index in choice.items():
        if key not in problem.decisions:  # recompute and offload switches: 0/1 as they were
            mapped[key] = index
            continue
        if key not in again.decisions:
            return None
        was = problem.decisions[key].options[index]
        found = [i for i, option in enumerate(again.decisions[key].options) if option == was]
        if not found:
            return None
        mapped[key] = found[0]
    if set(again.decisions) - set(mapped):
        return None
    return evaluate(again, mapped).step_seconds
