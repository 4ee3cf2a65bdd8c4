"""The ILP minimises the step with communication overlapped, as ``evaluate`` prices it
(``cost_model.ilp_model._add_overlap``): on hardware that hides asynchronous collectives, every
plan of a small problem is evaluated (brute force) and the ILP's plan must be the best of them
and its lower bound must not exceed that best. Before, the ILP priced every collective in full:
on the second case it picked a plan 1% slower than the best, with a raw bound above the best."""

import dataclasses
import itertools

import pytest

import autopar
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.evaluate import evaluate
from autopar.cost_model.hardware import get_hardware
from autopar.cost_model.ilp import solve
from autopar.cost_model.problem import build_problem
from autopar.models import MLPConfig, mlp


def _problem(batch: int, overlap: float):
    model, inputs = mlp(MLPConfig(in_features=64, hidden=1024, out_features=8, depth=1), batch_size=batch,
                        device="meta")
    hw = dataclasses.replace(get_hardware("a100-80gb"), comm_overlap=overlap)
    gm = autopar.trace(model, inputs)
    spec = autopar.MeshSpec.parse("dp=2")
    spec = hw.mesh_spec(spec.axes, spec.sizes)
    autopar.annotate(gm, spec)
    return build_problem(gm, spec, hw, TrainingSpec(recompute="none"), None)


# batch 64: a weight sharded and gathered for a replicated consumer is no ZeRO-3 gather (it runs
# on the critical path); counting it as hidden picked a plan 1.5% slower than the best.
# batch 512: the data-parallel plans' all-reduces hide; pricing them in full missed the best.
@pytest.mark.parametrize("batch", [64, 512])
def test_the_ilp_plan_is_the_best_overlapped_step_of_every_plan(batch):
    problem = _problem(batch, 0.9)
    keys = list(problem.decisions)
    best = min(evaluate(problem, dict(zip(keys, c))).step_seconds
               for c in itertools.product(*(range(len(problem.decisions[k].seconds)) for k in keys)))
    r = solve(problem)
    got = evaluate(problem, r.choice)
    assert got.hidden_comm_seconds >= 0.0
    assert r.lower_bound_s <= best * (1 + 1e-6), (r.lower_bound_s, best)
    assert got.step_seconds <= best * (1 + 1e-4), (got.step_seconds, best)
    # at the plan, the ILP's objective is the step evaluate prices, up to what the linear model
    # leaves out (ZeRO-3's per-unit latency and re-gathers: 0.1% at batch 512), never above it
    assert got.step_seconds * 0.99 <= r.objective_s <= got.step_seconds * (1 + 1e-6)


def test_a_pipeline_stage_ilp_hides_nothing():
    # a stage's parameter syncs run after the schedule and its gathers with every micro-batch,
    # priced in full when the stages are composed (autopar.pipeline_parts): its ILP must not
    # buy layouts for an overlap the pipeline never gets
    from autopar.cost_model.stage_weights import ilp_problem
    from autopar.models import GPTConfig, gpt
    from autopar.pipeline_stages import hand_pipeline_plan
    from autopar.planner import plan

    hw = dataclasses.replace(get_hardware("a100-80gb"), comm_overlap=0.9)
    model, inputs = gpt(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=32), batch_size=8)
    for m in (1, 4):
        p = hand_pipeline_plan(model, inputs, 4, pp=2, n_microbatches=m, schedule="1f1b", stage_mesh=None,
                               stage_blocks=None, virtual_stages=1, plan_fn=plan, hardware=hw, mixed_precision=False)
        for stage in p.stage_plans:
            assert stage.problem.comm_overlap == 0.9 and ilp_problem(stage.problem).comm_overlap == 0.0
