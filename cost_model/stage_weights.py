"""What the strategy ILP of a pipeline stage weighs: a step of ``m`` micro-batches, not one.

A stage plan is priced for one micro-batch (its Problem, ``evaluate`` and the Plan keep those
figures: ``autopar.pipeline_stages`` composes them with the schedule). Its ILP must choose the
layouts that make the *pipeline* fast and fit, and a pipeline runs the stage's program m times
per step (``runtime.pipeline``):

* time: per micro-batch run the compute, the activation collectives, the reshards of parameters
  (ZeRO-3 gathers, their reduce-scatters) and ZeRO-2's gather / reduce-scatter (the lowering
  runs them at every use); once per step, after the schedule, the optimizer step and the
  gradient all-reduces of parameters (``runtime.pipeline`` defers them). Weighed 1:1, as a plan
  without stages weighs them, a stage ILP pays m x the per-step terms a pipeline pays: it shards
  parameters (ZeRO-3) to save optimizer time and gradient syncs that run once, and gathers them
  at every micro-batch. The ILP here minimizes the stage's time per micro-batch over the step,
  ``t + s / m`` (m times that is what the stage adds to the step at the slowest stage);
* memory: the schedule holds the activations of ``in_flight`` micro-batches at once
  (``cost_model.pipeline.activations_in_flight``: 1F1B ``p - k`` at stage k, GPipe ``m``); the
  parameter state once. The memory row is ``params + in_flight * activations``. A recomputed
  block keeps its input per micro-batch in flight and its other activations once, during its
  backward: recomputing saves ``in_flight`` times what it saves for one, plus ``in_flight - 1``
  copies of what it still holds once.

The split stage graph carries its weights (``GraphModule.meta[STAGE_KEY]``, set by
``autopar.pipeline_stages``); ``build_problem`` keeps them on the Problem (``Problem.stage``)
and ``cost_model.ilp.solve`` solves ``ilp_problem(problem)``, this re-weighted copy. Its
objective and LP bound are in the units above (seconds per micro-batch over the step). The
planner asks whether memory is tight (and ZeRO-2 worth searching) by ``held_peak_bytes``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .decisions import Problem
from .recompute import recompute_transient_bytes

__all__ = ["STAGE_KEY", "StageWeights", "ilp_problem", "held_peak_bytes"]

STAGE_KEY = "autopar_pipeline_stage"  # GraphModule.meta key of a stage graph's StageWeights


@dataclass(frozen=True)
class StageWeights:
    """A pipeline stage's ILP weights (module doc)."""

    n_microbatches: int  # per step: the per-step terms weigh 1 / n_microbatches
    in_flight: float  # micro-batches whose activations the stage holds at its peak

    def __post_init__(self) -> None:
        if self.n_microbatches < 1 or self.in_flight < 1:
            raise ValueError(f"a pipeline stage runs >= 1 micro-batch and holds >= 1 in flight, got {self}")


def ilp_problem(problem: Problem) -> Problem:
    """``problem`` as its ILP should weigh it: itself, or for a pipeline stage (``problem.stage``)
    a copy with per-step seconds over m and activation bytes times the micro-batches in flight
    (module doc). The copy shares everything the ILP does not read."""
    w = getattr(problem, "stage", None)
    if w is None or (w.n_microbatches == 1 and w.in_flight == 1):
        return problem
    once, held = 1.0 / w.n_microbatches, w.in_flight
    decisions = {}
    for key, d in problem.decisions.items():
        if d.is_param:  # the optimizer step once per step; ZeRO-2's collectives (comm_seconds) at every use
            seconds = [(s - c) * once + c for s, c in zip(d.seconds, d.comm_seconds)]
            decisions[key] = dataclasses.replace(d, seconds=seconds)
        else:
            decisions[key] = dataclasses.replace(d, memory_bytes=[b * held for b in d.memory_bytes])
    edges = [dataclasses.replace(e, memory={ab: b * held for ab, b in e.memory.items()}) if e.memory else e
             for e in problem.edges]
    # a parameter's gradient all-reduce runs once per step; an activation's with its micro-batch
    syncs = [dataclasses.replace(g, seconds=g.seconds * once) if g.param else g for g in problem.syncs]
    recompute = []
    for term in problem.recompute:
        per_decision = {}
        for key, per_option in term.decisions.items():
            d = problem.decisions[key]
            once_held = [0.0 if key in term.boundary else b / d.count for b in d.memory_bytes]
            per_decision[key] = [(extra, saved * held + (held - 1) * one, steps)
                                 for (extra, saved, steps), one in zip(per_option, once_held)]
        per_edge = {}
        for idx, pairs in term.edges.items():
            e, c = problem.edges[idx], problem.decisions[problem.edges[idx].consumer].count
            per_edge[idx] = {ab: (extra, saved * held + (held - 1) * e.memory.get(ab, 0.0) / c, steps)
                             for ab, (extra, saved, steps) in pairs.items()}
        recompute.append(dataclasses.replace(term, decisions=per_decision, edges=per_edge))
    return dataclasses.replace(problem, decisions=decisions, edges=edges, syncs=syncs, recompute=recompute)


def held_peak_bytes(problem: Problem, choice: dict, peak_bytes: float, activation_bytes: float) -> float:
    """A plan's walked peak (``peak_bytes``, one micro-batch; ``activation_bytes`` its activations)
    with, for a pipeline stage, the activations of the other micro-batches in flight (less its
    recomputed blocks', held once): what tells the planner memory is tight, and ZeRO-2 options
    worth a second pass (``autopar.mesh_search``). GPT-3 175B on 1024, pp=8 x (dp=16,tp=8): the
    stages' one-micro-batch peaks sat under 90% of the budget, their peaks with 8 in flight did not."""
    w = getattr(problem, "stage", None)
    if w is None or w.in_flight == 1:
        return peak_bytes
    return peak_bytes + (w.in_flight - 1) * (activation_bytes - recompute_transient_bytes(problem, choice))
