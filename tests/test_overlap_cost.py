"""Overlap in the cost model (cost_model/overlap.py): the collectives the runtime runs beside
compute (bucketed gradient all-reduces, ZeRO-3's prefetched gathers and reduce-scatters) hide
behind it by the profile's ``comm_overlap``; tensor-parallel all-reduces stay on the critical
path; recompute adds compute they can hide behind. Single process, planning only."""

import dataclasses

import pytest

import autopar
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.evaluate import evaluate
from autopar.cost_model.hardware import HardwareError, get_hardware
from autopar.cost_model.ilp import solve
from autopar.cost_model.overlap import hidden_comm_seconds
from autopar.cost_model.problem import build_problem
from autopar.models import GPTConfig, gpt


def _solved(mesh_text, overlap, strategy_pins=None, recompute="none", batch=256):
    model, inputs = gpt(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64),
                        batch_size=batch, seq_len=64, device="meta")
    hw = dataclasses.replace(get_hardware("a100-80gb"), comm_overlap=overlap)
    gm = autopar.trace(model, inputs)
    spec = autopar.MeshSpec.parse(mesh_text)
    spec = hw.mesh_spec(spec.axes, spec.sizes)
    autopar.annotate(gm, spec)
    problem = build_problem(gm, spec, hw, TrainingSpec(recompute=recompute), strategy_pins)
    return problem, solve(problem).choice


def test_hidden_is_the_overlap_times_what_fits_in_the_window():
    assert hidden_comm_seconds(2.0, 5.0, 0.5) == 1.0
    assert hidden_comm_seconds(8.0, 5.0, 1.0) == 5.0  # never more than the compute beside it
    assert hidden_comm_seconds(0.0, 5.0, 1.0) == hidden_comm_seconds(2.0, 0.0, 1.0) == 0.0


def test_data_parallel_gradient_syncs_hide_and_the_step_says_so():
    problem, choice = _solved("dp=8", 0.0)
    none = evaluate(problem, choice)
    assert none.async_comm_seconds > 0 and none.hidden_comm_seconds == 0.0
    assert none.step_seconds == pytest.approx(none.compute_seconds + none.comm_seconds)
    # every parameter's gradient all-reduce is bucketed; the position embedding's output gradient
    # (an activation, replicated over dp) is all-reduced inside the program: on the critical path
    param_syncs = sum(g.seconds * g.active_count(choice) / g.count for g in problem.syncs if g.param)
    assert none.async_comm_seconds == pytest.approx(param_syncs) and none.async_comm_seconds < none.comm_seconds
    assert none.async_comm_seconds < 0.5 * none.compute_seconds
    problem.comm_overlap = 0.8
    some = evaluate(problem, choice)
    assert some.hidden_comm_seconds == pytest.approx(0.8 * none.async_comm_seconds)  # all of it fits the window
    assert some.step_seconds == pytest.approx(none.step_seconds - some.hidden_comm_seconds)
    assert some.comm_seconds == none.comm_seconds and some.comm_bytes == none.comm_bytes


def _family(strategy, overlap, batch=64):
    model, inputs = gpt(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64),
                        batch_size=batch, seq_len=64, device="meta")
    hw = dataclasses.replace(get_hardware("a100-80gb"), comm_overlap=overlap)
    return autopar.plan(model, 4, inputs, hardware=hw, strategy=strategy, baselines=False, pipeline=False)


def test_tensor_parallel_all_reduces_stay_on_the_critical_path():
    p0, p1 = _family("megatron", 0.0), _family("megatron", 1.0)
    # the ILP minimises the overlapped step, so elsewhere it may pick other layouts (the loss's
    # gathers); the tensor-parallel all-reduces are the same
    assert p0.comm_bytes.get("all_reduce", 0) > 0 and p1.comm_bytes["all_reduce"] == p0.comm_bytes["all_reduce"]
    assert p0.step_seconds == pytest.approx(p0.compute_seconds + p0.comm_seconds)
    # only the replicated norms' and biases' gradient syncs may hide; the activations' all-reduces cannot
    assert p0.step_seconds - p1.step_seconds < 0.1 * p0.comm_seconds, (p0.step_seconds, p1.step_seconds)


def test_zero3_gathers_and_reduce_scatters_are_asynchronous():
    p0, p1 = _family("zero3", 0.0), _family("zero3", 1.0)
    assert p0.comm_bytes.get("reduce_scatter", 0) > 0 and p0.comm_bytes.get("all_gather", 0) > 0
    assert p1.comm_bytes == p0.comm_bytes and p1.comm_seconds == pytest.approx(p0.comm_seconds)
    assert p0.step_seconds == pytest.approx(p0.compute_seconds + p0.comm_seconds)
    # ZeRO-3's gathers and reduce-scatters run beside compute: they hide when the compute is longer;
    # what stays is the position embedding's activation-gradient all-reduce (inside the program),
    # a third of the comm now that ZeRO-3's collectives pay one latency per unit (cost_model/fsdp_pricing.py)
    assert p0.comm_seconds < p0.compute_seconds
    assert p1.step_seconds - p0.compute_seconds < 0.4 * p0.comm_seconds, (p1.step_seconds, p0.compute_seconds)


def test_recompute_composes_with_overlap():
    """Recomputed blocks add compute and give the asynchronous collectives a longer window."""
    kept_problem, kept = _solved("dp=8", 0.5, recompute="none")
    rc_problem, rc = _solved("dp=8", 0.5, recompute="full")
    a, b = evaluate(kept_problem, kept), evaluate(rc_problem, rc)
    assert b.compute_seconds > a.compute_seconds
    assert b.comm_seconds == pytest.approx(a.comm_seconds) and b.async_comm_seconds == pytest.approx(a.async_comm_seconds)
    assert b.hidden_comm_seconds >= a.hidden_comm_seconds
    assert b.step_seconds == pytest.approx(b.compute_seconds + b.comm_seconds - b.hidden_comm_seconds)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half"])
def test_comm_overlap_outside_zero_one_is_refused(bad):
    with pytest.raises(HardwareError, match="comm_overlap must be in"):
        dataclasses.replace(get_hardware("cpu"), comm_overlap=bad)


def test_oversubscribed_cpu_ranks_reclaim_the_pipeline_bubble():
    """4 one-thread ranks on 2 cores: a rank idle in the bubble hands its share of a core to the
    busy ones, so a pipeline step is at least the machine's work shared by all ranks and at least
    the schedule run twice as fast; GPUs (no shared cores) keep the plain schedule."""
    from autopar.cost_model.pipeline import StageCost, pipeline_cost
    from autopar.mesh import Link

    cpu, gpu = get_hardware("cpu"), get_hardware("a100-80gb")
    assert (cpu.idle_speedup(4), cpu.idle_speedup(2), cpu.idle_speedup(1), gpu.idle_speedup(8)) == (2.0, 1.0, 1.0, 1.0)
    stages, link = [StageCost(1.0, 0.0, 0.0)] * 4, Link("x", 1e9, 0.0)
    assert pipeline_cost(stages, "1f1b", 4, link).step_seconds == pytest.approx(7.0)  # (m + p - 1) t
    assert pipeline_cost(stages, "1f1b", 4, link, idle_speedup=2.0).step_seconds == pytest.approx(4.0)  # m t: the work
    assert pipeline_cost(stages, "1f1b", 1, link, idle_speedup=2.0).step_seconds == pytest.approx(2.0)  # 4 t / 2
    uneven = [StageCost(1.0, 0.0, 0.0)] * 3 + [StageCost(3.0, 0.0, 0.0)]  # a heavy last stage (the head)
    assert pipeline_cost(uneven, "1f1b", 4, link).step_seconds == pytest.approx(3 * 3.0 + 6.0)
    # the light stages' idle time goes to the heavy one: (9 + 6) / 2, more than the mean work 4 * 1.5
    assert pipeline_cost(uneven, "1f1b", 4, link, idle_speedup=2.0).step_seconds == pytest.approx(7.5)


def test_pinned_ranks_share_only_their_own_core():
    """4 ranks pinned round robin to 2 cores (as calibrate pins them): pp=4 puts stages 0 and 2
    on one core and 1 and 3 on the other, so the heavy last stage's core carries 1 + 3 of work
    per micro-batch, not the mean over all four; pp=2 x dp=2 has both stages on both cores."""
    from autopar.cost_model.pipeline import StageCost, pipeline_cost
    from autopar.mesh import Link

    cpu = dataclasses.replace(get_hardware("cpu"), devices_per_node=4, shared_cores=2.0)
    assert cpu.pipeline_core_shares(4, 1) == ((0.5, 0.0, 0.5, 0.0), (0.0, 0.5, 0.0, 0.5))
    assert cpu.pipeline_core_shares(2, 2) == ((0.5, 0.5), (0.5, 0.5))
    assert cpu.pipeline_core_shares(2, 1) == () and get_hardware("a100-80gb").pipeline_core_shares(4, 2) == ()
    uneven, link = [StageCost(1.0, 0.0, 0.0)] * 3 + [StageCost(3.0, 0.0, 0.0)], Link("x", 1e9, 0.0)
    shared = pipeline_cost(uneven, "1f1b", 4, link, idle_speedup=2.0, core_shares=cpu.pipeline_core_shares(4, 1))
    assert shared.step_seconds == pytest.approx(4 * (1.0 + 3.0) / 2)  # 8, above the schedule's 15 / 2
    even = [StageCost(1.0, 0.0, 0.0), StageCost(3.0, 0.0, 0.0)]
    assert pipeline_cost(even, "1f1b", 4, link, idle_speedup=2.0, core_shares=cpu.pipeline_core_shares(2, 2)
                         ).step_seconds == pytest.approx(pipeline_cost(even, "1f1b", 4, link, idle_speedup=2.0).step_seconds)
