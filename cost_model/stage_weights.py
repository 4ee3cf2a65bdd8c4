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
* overlap: none. A stage's parameter syncs run after the schedule and its gathers with each
  micro-batch, and the composition prices them in full, so its ILP does too;
* memory: the schedule holds the activations of ``in_flight`` micro-batches at once
  (``cost_model.pipeline.activations_in_flight``: 1F1B ``p - k`` at stage k, GPipe ``m``); the
  parameter state once, without the gradient bucket a plan without stages keeps (a stage's
  syncs run once per step on ``.grad``). The memory row is ``params + in_flight * activations``.
  A recomputed block keeps its input per micro-batch in flight and its other activations once,
  during its backward: recomputing saves ``in_flight`` times what it saves for one, plus
  ``in_flight - 1`` copies of what it still holds once.

The split stage graph carries its weights (``GraphModule.meta[STAGE_KEY]``, set by
``autopar.pipeline_stages``); ``build_problem`` keeps them on the Problem (``Problem.stage``)
and ``cost_model.ilp.solve`` solves ``ilp_problem(problem)``, this re-weighted copy. Its
objective and LP bound are in the units above (seconds per micro-batch over the step). The
planner asks whether memory is tight (and ZeRO-2 worth searching) by ``held_peak_bytes``.
"""

from __future__ import annotations

import dataclasses

from .decisions import Problem
from .stage_key import STAGE_KEY, StageWeights
from .liveness import backward_transient_peaks
from .offload import device_parts
from .recompute import recompute_transient_bytes

__all__ = ["STAGE_KEY", "StageWeights", "ilp_problem", "held_peak_bytes"]

def ilp_problem(problem: Problem) -> Problem:
    """``problem`` as its ILP should weigh it: itself, or for a pipeline stage (``problem.stage``)
    a copy with per-step seconds over m and activation bytes times the micro-batches in flight
    (module doc). The copy shares everything the ILP does not read."""
    w = getattr(problem, "stage", None)
    if w is None:
        return problem
    if w.n_microbatches == 1 and w.in_flight == 1:
        # the composed pipeline hides nothing (``autopar.pipeline_parts``): neither does its ILP
        return dataclasses.replace(problem, comm_overlap=0.0) if problem.comm_overlap else problem
    once, held = 1.0 / w.n_microbatches, w.in_flight
    decisions = {}
    for key, d in problem.decisions.items():
        if d.is_param:  # the optimizer step once per step; ZeRO-2's collectives (comm_seconds) at every use
            seconds = [(s - c) * once + c for s, c in zip(d.seconds, d.comm_seconds)]
            # no gradient bucket in a stage: its syncs run once per step on .grad (runtime.pipeline)
            numel, target = d.node.meta["val"].numel(), str(d.node.target)
            memory = [b - device_parts(numel, st.output, problem.mesh, problem.train, zero, target).bucket * d.count
                      for b, (st, zero) in zip(d.memory_bytes, d.options)]
            decisions[key] = dataclasses.replace(d, seconds=seconds, memory_bytes=memory)
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
    return dataclasses.replace(problem, decisions=decisions, edges=edges, syncs=syncs, recompute=recompute,
                               comm_overlap=0.0)


def held_peak_bytes(problem: Problem, choice: dict, pred) -> float:
    """The peak of a plan (``pred``, its ``evaluate`` Prediction) that tells the planner memory is
    tight, and ZeRO-2 options worth a second pass (``autopar.mesh_search``): its walked peak, or
    for a pipeline stage what the schedule holds as ``autopar.pipeline_stages`` composes it (its
    parameter state without the gradient bucket, its activations per micro-batch in flight less
    its recomputed blocks', held once, and the gradients in flight at its busiest backward).
    GPT-3 175B on 1024, pp=8 x (dp=16,tp=8): the stages' one-micro-batch peaks sat under 90% of
    the budget, their peaks with 8 in flight did not."""
    w = getattr(problem, "stage", None)
    if w is None:
        return pred.peak_memory_bytes
    rc = recompute_transient_bytes(problem, choice)
    ops, grads = backward_transient_peaks(problem, choice)
    return (pred.param_state_bytes - pred.bucket_bytes + w.in_flight * (pred.activation_bytes - rc) + rc
            + max(ops, grads if w.n_microbatches > 1 else 0.0))
