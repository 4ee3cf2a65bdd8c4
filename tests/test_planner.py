"""The planner rediscovers known answers, matches brute force on small graphs, and says
clearly what is wrong with bad input."""

import itertools
import json
import math
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.evaluate import evaluate
from autopar.cost_model.hardware import get_hardware
from autopar.cost_model.ilp import InfeasibleBudgetError, solve
from autopar.cost_model.problem import build_problem
from autopar.cost_model.reshard import reshard_steps
from autopar.mesh import MeshError
from autopar.models import MLPConfig, mlp
from autopar.plan import Plan, PlanFormatError
from autopar.planner import plan
from autopar.strategy import Layout

LINEAR = "aten.linear.default"


def _linears(p: Plan):
    return [n for n in p.nodes if n.op == LINEAR]


def test_large_batch_small_model_is_data_parallel():
    model, inputs = mlp(MLPConfig(in_features=1024, hidden=1024, out_features=16, depth=4),
                        batch_size=65536, device="meta")
    p = plan(model, 8, inputs, mesh="dp=8", baselines=False)
    for n in _linears(p):
        x, w = n.input_layouts[:2]
        assert x == "S(0)" and w == "R", n  # batch split, weights whole: data parallel
    assert p.node("x").output_layout == "S(0)"


def test_small_batch_wide_mlp_is_megatron_column_then_row():
    model, inputs = mlp(MLPConfig(in_features=8192, hidden=32768, out_features=8192, depth=1),
                        batch_size=8, device="meta")
    p = plan(model, 8, inputs, mesh="tp=8", baselines=False)
    first, second = _linears(p)
    assert first.input_layouts[:2] == ("R", "S(0)") and first.output_layout == "S(1)"  # column parallel
    assert second.input_layouts[:2] == ("S(1)", "S(1)") and second.output_layout == "P"  # row parallel
    assert p.node("hidden_0_weight").output_layout == "S(0)" and p.node("out_weight").output_layout == "S(1)"


def test_zero3_when_replicated_parameters_do_not_fit():
    model, inputs = mlp(MLPConfig(in_features=4096, hidden=4096, out_features=16, depth=4),
                        batch_size=8192, device="meta")
    n_params = sum(p.numel() for p in model.parameters())
    # plenty of memory: weights stay whole (SGD: no optimizer state whose update ZeRO could split)
    roomy = plan(model, 8, inputs, mesh="dp=8", baselines=False, optimizer="sgd")
    big = [n for n in roomy.nodes if n.op == "get_attr" and n.name.endswith("weight") and n.name != "out_weight"]
    assert all(n.output_layout == "R" and not n.zero_axes for n in big)
    # Replicated bf16 weights with ZeRO-2 need 2 + 14/8 B/param plus activations (the ILP's row,
    # everything at once: 4.9 B/param): no longer fit; ZeRO-3 needs 16/8 (row 3.1), and its walked
    # peak adds the layers it holds whole at once (a gather landing, the next one prefetched,
    # gradients in flight: cost_model/fsdp_memory.py): 4.2.
    tight = plan(model, 8, inputs, mesh="dp=8", baselines=False, memory_budget_bytes=4.75 * n_params)
    assert tight.peak_memory_bytes_per_device <= 4.75 * n_params
    for n in tight.nodes:
        if n.name in {b.name for b in big}:
            assert n.output_layout.startswith("S("), n  # stored sharded, gathered for use: ZeRO-3
    assert all(n.input_layouts[0] == "S(0)" for n in _linears(tight))  # still data parallel


def _problem(model, inputs, mesh_text, hw="a100-80gb"):
    hardware = get_hardware(hw)
    gm = autopar.trace(model, inputs)
    spec = MeshSpec_parse(mesh_text, hardware)
    autopar.annotate(gm, spec)
    return build_problem(gm, spec, hardware, TrainingSpec())


def MeshSpec_parse(text, hardware):
    spec = autopar.MeshSpec.parse(text)
    return hardware.mesh_spec(spec.axes, spec.sizes)


@pytest.mark.parametrize("budget_fraction", [None, 0.7])
def test_ilp_equals_brute_force_on_a_small_graph(budget_fraction):
    model, inputs = mlp(MLPConfig(in_features=64, hidden=64, out_features=8, depth=1, bias=False),
                        batch_size=64, device="meta")
    problem = _problem(model, inputs, "dp=2")
    keys = list(problem.decisions)
    sizes = [len(problem.decisions[k].options) for k in keys]
    assert math.prod(sizes) <= 200_000, sizes
    best_s, best_mem = math.inf, None
    budget = None
    if budget_fraction is not None:
        # A budget between the smallest and the fastest plan's memory, so it binds.
        fastest = solve(problem)
        budget = budget_fraction * evaluate(problem, fastest.choice).peak_memory_bytes
    for combo in itertools.product(*(range(s) for s in sizes)):
        pred = evaluate(problem, dict(zip(keys, combo)))
        if budget is not None and pred.peak_memory_bytes > budget:
            continue
        best_s = min(best_s, pred.step_seconds)
    result = solve(problem, budget)
    assert evaluate(problem, result.choice).step_seconds == pytest.approx(best_s, rel=1e-6)
    assert result.objective_s == pytest.approx(best_s, rel=1e-6)
    assert result.lower_bound_s <= result.objective_s * (1 + 1e-9)


def test_reshard_costs_relations():
    hw = get_hardware("a100-80gb")
    mesh = hw.mesh_spec(("dp", "tp"), (2, 4))
    R, S0, P = Replicate(), Shard(0), Partial()
    # A free local slice moves nothing forward.
    fwd, _ = reshard_steps(Layout((R, R)), Layout((S0, R)), 1e6, mesh)
    assert fwd == ()
    # Settling partial sums to replicated is one all-reduce; to sharded, one reduce-scatter.
    fwd, bwd = reshard_steps(Layout((R, P)), Layout((R, R)), 1e6, mesh)
    assert [s.collective for s in fwd] == ["all_reduce"] and bwd == ()
    fwd, bwd = reshard_steps(Layout((R, P)), Layout((R, S0)), 1e6, mesh)
    assert [s.collective for s in fwd] == ["reduce_scatter"] and [s.collective for s in bwd] == ["all_gather"]


def test_plan_never_slower_than_a_feasible_baseline_and_round_trips():
    model, inputs = mlp(MLPConfig(in_features=1024, hidden=4096, out_features=16, depth=2),
                        batch_size=512, device="meta")
    p = plan(model, 8, inputs, model_name="mlp-test")
    assert {b.name for b in p.baselines} == {"dp", "zero2", "zero3", "megatron", "megatron-sp", "megatron-dp"}
    for b in p.baselines:
        if b.feasible:
            assert p.step_seconds <= b.step_seconds * (1 + 1e-9), b
    d = json.loads(p.to_json())
    assert d["mesh"]["axes"] and d["hardware"] == "a100-80gb"
    assert set(d["predicted"]) >= {"step_seconds", "peak_memory_bytes_per_device", "comm_bytes_per_device"}
    assert set(d["solver"]) >= {"name", "status", "seconds", "objective", "lower_bound"}
    assert {"name", "step_seconds", "peak_memory_bytes_per_device", "feasible"} <= set(d["baselines"][0])
    assert {"name", "op", "strategy", "output_layout"} <= set(d["nodes"][0])
    again = Plan.from_json(p.to_json())
    assert again.nodes == p.nodes and again.mesh == p.mesh and again.step_seconds == p.step_seconds
    assert again.diff(p) == "plans are identical"
    text = p.explain("linear")
    assert "alternative" in text and "linear" in text


def test_diff_names_changed_nodes():
    model, inputs = mlp(MLPConfig(in_features=8192, hidden=32768, out_features=8192, depth=1),
                        batch_size=8, device="meta")
    tp = plan(model, 8, inputs, mesh="tp=8", baselines=False)
    dp = plan(model, 8, inputs, strategy="dp", baselines=False)
    text = tp.diff(dp)
    assert "mesh: tp=8 -> dp=8" in text and "linear:" in text


def test_infeasible_budget_states_the_smallest_memory_any_plan_needs():
    model, inputs = mlp(MLPConfig(in_features=4096, hidden=4096, out_features=16, depth=4),
                        batch_size=64, device="meta")
    with pytest.raises(InfeasibleBudgetError, match=r"smallest any plan needs is [0-9.]+ [GMK]iB.*raise"):
        plan(model, 8, inputs, mesh="dp=8", baselines=False, memory_budget_bytes=1e6)


def test_mesh_that_does_not_multiply_to_n_is_refused():
    model, inputs = mlp(MLPConfig(), batch_size=64, device="meta")
    with pytest.raises(MeshError, match=r"dp\(2\) \* tp\(3\) = 6 != 8 devices"):
        plan(model, 8, inputs, mesh="dp=2,tp=3")


def test_malformed_plan_file_is_refused(tmp_path):
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        Plan.from_json("{not json")
    path = tmp_path / "plan.json"
    path.write_text('{"format_version": 1, "model": "x"}')
    with pytest.raises(PlanFormatError, match="missing or bad field"):
        Plan.from_json(str(path))


@pytest.mark.parametrize("args, message", [
    (["plan", "no-such-model", "--gpus", "8"], "Unknown model 'no-such-model'"),
    (["plan", "mlp", "--gpus", "8", "--hardware", "a100"], "unknown hardware 'a100'"),
    (["plan", "mlp", "--gpus", "8", "--mesh", "dp=3,tp=2"], "= 6 != 8 devices"),
    (["plan", "mlp", "--gpus", "8", "--memory-budget", "1KB", "--mesh", "dp=8"], "smallest any plan needs"),
])
def test_cli_errors_are_one_line(args, message):
    out = subprocess.run([sys.executable, "-m", "autopar", *args, "--quiet"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2
    err = [l for l in out.stderr.splitlines() if l.startswith("autopar: error:")]
    assert len(err) == 1 and message in err[0], out.stderr[-2000:]


@pytest.mark.parametrize("name", ["gpt-tiny", "bert-tiny", "vit-tiny", "hf-gpt2-tiny", "hf-bert-tiny"])
def test_every_tiny_zoo_model_plans_and_beats_or_ties_its_baselines(name):
    from autopar.models import get_model

    model, inputs = get_model(name, device="meta")
    p = plan(model, 4, inputs, model_name=name)
    assert p.solver.status == "Optimal" and p.solver.gap < 1e-3
    assert all(p.step_seconds <= b.step_seconds * (1 + 1e-9) for b in p.baselines if b.feasible)
    assert all(n.strategy for n in p.nodes)


def test_zero2_splits_gradient_and_optimizer_state_for_the_bytes_of_an_all_reduce():
    model, inputs = mlp(MLPConfig(in_features=1024, hidden=4096, out_features=16, depth=2),
                        batch_size=512, device="meta")
    dp = plan(model, 8, inputs, strategy="dp", baselines=False)
    z2 = plan(model, 8, inputs, strategy="zero2", baselines=False)
    assert all(n.zero_axes == (0,) for n in z2.nodes if n.op == "get_attr")
    # weights stay whole, gradients and Adam state are split 8 ways (bf16 mixed precision:
    # 2 + 2 + 12 bytes per parameter -> 2 + 14 / 8)
    # (DP also keeps its gradient buckets, 2 bytes per parameter: cost_model/offload.device_parts)
    assert z2.param_state_bytes == pytest.approx((dp.param_state_bytes - dp.bucket_bytes) * (2 + 14 / 8) / 16,
                                                 rel=1e-3)
    assert dp.bucket_bytes == pytest.approx((dp.param_state_bytes - dp.bucket_bytes) * 2 / 16, rel=1e-3)
    assert z2.bucket_bytes == 0
    # reduce-scatter + all-gather send what the all-reduce sent (ring model), no more
    assert set(z2.comm_bytes) >= {"reduce_scatter", "all_gather"}
    assert z2.comm_bytes["reduce_scatter"] + z2.comm_bytes["all_gather"] + z2.comm_bytes.get("all_reduce", 0) == \
        pytest.approx(dp.comm_bytes["all_reduce"], rel=1e-3)
    # a budget below DP's memory makes the planner's own choice split the state
    auto = plan(model, 8, inputs, baselines=False, memory_budget_bytes=dp.peak_memory_bytes_per_device * 0.6)
    assert auto.peak_memory_bytes_per_device <= dp.peak_memory_bytes_per_device * 0.6


def test_graph_fingerprint_tells_models_and_shapes_apart():
    from autopar.trace import graph_fingerprint

    def fp(batch, hidden=64):
        model, inputs = mlp(MLPConfig(in_features=32, hidden=hidden, out_features=8, depth=2), batch_size=batch)
        return graph_fingerprint(autopar.trace(model, inputs))

    assert fp(16) == fp(16)
    assert len({fp(16), fp(8), fp(16, hidden=128)}) == 3
    model, inputs = mlp(MLPConfig(in_features=32, hidden=64, out_features=8, depth=2), batch_size=16)
    p = plan(model, 2, inputs, baselines=False)
    assert Plan.from_json(p.to_json()).graph_fingerprint == p.graph_fingerprint == fp(16)
