"""Activation recompute: planned by the ILP (cost_model/recompute.py) and run by checkpointing
each block's lowered region (passes/recompute_regions.py).

Planner checks run in this process. The runtime checks run 4 gloo ranks in one launch
(tests/mem_cases.py): the tiny GPT and a tiny Hugging Face Llama with recompute pinned full,
and the planner's own choice under budgets that force it (whole blocks; attention only); each equals the single-process run
(losses, gradients, parameters after 3 AdamW steps), sends exactly the bytes its plan predicts
(the recomputed forward's collectives included) and checkpoints every block it planned to.
The same launch runs ZeRO-Offload (runtime/offload.py): Megatron, a Llama with full recompute
and ZeRO-3 (the `--strategy zero3 --offload` baseline) with the optimizer state on the host;
each equals the single-process run, and the host and device bytes measured equal the plan's.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from dist_cases import train_single  # noqa: E402
from mem_cases import build, case_key  # noqa: E402
from test_runtime import assert_equal_runs  # noqa: E402

import autopar  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402

MEGATRON = {"strategy": "megatron-dp"}
# gpt-longseq (one 1024-token sequence) on dp=4: under 2.8 MB per device no plan fits without
# recompute, and the planner recomputes whole blocks
LONGSEQ_AUTO = {"mesh": "dp=4", "memory_budget_bytes": 2.8e6, "pipeline": False}
# at 3.5 MB the planner's cheapest way to fit is recomputing each block's attention only: the
# walked peak of such plans is 3.4-3.5 MB (the recomputed attention's gradients in flight during its
# backward, cost_model/grad_transients.py), no recompute needs 3.54 MB
LONGSEQ_SELECTIVE = dict(LONGSEQ_AUTO, memory_budget_bytes=3.5e6)
CASES = [("gpt-tiny", dict(MEGATRON, recompute="full")), ("gpt-tiny", dict(MEGATRON, recompute="none")),
         ("hf-llama-tiny", {"strategy": "dp", "recompute": "full"}),
         ("hf-llama-tiny", {"strategy": "dp", "recompute": "none"}),
         ("gpt-tiny", {"strategy": "zero3", "recompute": "full"}),
         ("gpt-tiny", {"strategy": "zero3", "recompute": "none"}), ("gpt-longseq", LONGSEQ_AUTO),
         ("gpt-longseq", LONGSEQ_SELECTIVE)]
OFFLOAD = [("gpt-tiny", dict(MEGATRON, recompute="none", offload=True)),
           ("hf-llama-tiny", {"strategy": "dp", "recompute": "full", "offload": True}),
           ("gpt-tiny", {"strategy": "zero3", "recompute": "none", "offload": True})]
# per-group offload: under 1.35 MB gpt-tiny's Megatron-DP plan needs 1.43 MB without offload and
# 0.94 MB with every parameter offloaded; the planner offloads the two largest groups (both MLP
# weights of every block; autopar/offload_search.py)
PARTIAL_OFFLOAD = ("gpt-tiny", dict(MEGATRON, recompute="none", offload="auto", memory_budget_bytes=1.35e6))
OFFLOAD.append(PARTIAL_OFFLOAD)
SELECTIVE = [("gpt-tiny", dict(MEGATRON, recompute="selective")),
             ("hf-llama-tiny", {"strategy": "dp", "recompute": "selective"}),
             ("gpt-tiny", {"strategy": "zero3", "recompute": "selective"})]
CASES += OFFLOAD + SELECTIVE
WORLD = 4
N_BLOCKS = {"gpt-tiny": 2, "hf-llama-tiny": 3, "gpt-longseq": 2}
# In the session's 4-rank launch (tests/launcher.py).
LAUNCH_CASES = {WORLD: [(case_key(c), "mem_cases:case", {"name": c[0], "options": c[1]}) for c in CASES]}


def _plan(name, **options):
    model, inputs = build(name)
    return autopar.plan(model, WORLD, inputs, hardware="a100-80gb", mixed_precision=False, baselines=False, **options)


def test_full_recompute_trades_forward_time_for_activation_memory():
    keep = _plan("gpt-tiny", **MEGATRON, recompute="none")
    full = _plan("gpt-tiny", **MEGATRON, recompute="full")
    assert keep.recompute == () and full.recompute == ("blocks",)
    assert full.activation_bytes < 0.8 * keep.activation_bytes
    assert full.step_seconds > keep.step_seconds
    assert autopar.Plan.from_json(full.to_json()).recompute == ("blocks",)
    from autopar.report import format_report

    assert "activation recompute  blocks" in format_report(full)


def test_auto_recomputes_only_where_memory_needs_it_and_never_costs_time():
    free = _plan("gpt-longseq", **dict(LONGSEQ_AUTO, memory_budget_bytes=None))
    assert free.recompute == ()  # nothing to gain: recompute costs time
    with pytest.raises(AutoparError, match="no plan fits"):
        _plan("gpt-longseq", **LONGSEQ_AUTO, recompute="none")
    tight = _plan("gpt-longseq", **LONGSEQ_AUTO)
    assert tight.recompute == ("blocks",) and tight.peak_memory_bytes_per_device <= 2.8e6
    assert tight.step_seconds >= free.step_seconds


def test_auto_chooses_selective_recompute_where_it_is_enough():
    auto = _plan("gpt-longseq", **LONGSEQ_SELECTIVE)
    assert auto.recompute == ("blocks:attn",) and auto.peak_memory_bytes_per_device <= 3.5e6
    full = _plan("gpt-longseq", **LONGSEQ_SELECTIVE, recompute="full")
    assert auto.step_seconds < full.step_seconds  # recomputing the whole block would fit, slower
    try:
        none = _plan("gpt-longseq", **LONGSEQ_SELECTIVE, recompute="none")
        assert none.step_seconds >= auto.step_seconds
    except AutoparError as exc:
        assert "no plan fits" in str(exc)
    # tighter, only whole blocks fit
    assert _plan("gpt-longseq", **LONGSEQ_AUTO).recompute == ("blocks",)


@pytest.fixture(scope="module")
def auto_under_3_1mb():
    return _plan("gpt-longseq", **dict(LONGSEQ_AUTO, memory_budget_bytes=3.1e6))


def test_a_plan_whose_walk_exceeds_the_budget_is_never_returned(auto_under_3_1mb):
    # attention-only recompute fits 3.1 MB in the ILP's row (3.10 MB) but walks to 3.46 MB with
    # the gradients in flight; no tighter row fits with it, so the pinned mode has no plan (the
    # re-solve once kept the 3.46 MB plan), and the free choice re-solves to one that walks under
    with pytest.raises(AutoparError, match="no plan fits"):
        _plan("gpt-longseq", **dict(LONGSEQ_AUTO, memory_budget_bytes=3.1e6), recompute="selective")
    auto = auto_under_3_1mb
    assert auto.recompute == ("blocks",) and auto.peak_memory_bytes_per_device <= 3.1e6


def test_a_re_solve_stopped_by_the_clock_is_not_a_plan(monkeypatch, auto_under_3_1mb):
    # the re-solve's answer counts only if it reached its optimum: one stopped by the wall clock
    # depends on the machine's load (the ranks and the test process planned apart)
    import dataclasses

    from autopar import mesh_search
    from autopar.cost_model.ilp import InfeasibleBudgetError, solve

    problem = auto_under_3_1mb.problem  # with the recompute options
    budget = 3.1e6
    first = solve(problem, budget)
    assert mesh_search.evaluate(problem, first.choice).peak_memory_bytes > budget  # the walk is over the row's plan
    fit = mesh_search.solve_mesh(problem, budget, 60.0, first=first)
    assert fit.prediction.peak_memory_bytes <= budget
    monkeypatch.setattr(mesh_search, "solve", lambda *a, **k: dataclasses.replace(solve(*a, **k),
                                                                                   status="Time limit reached"))
    with pytest.raises(InfeasibleBudgetError, match="gradients in flight"):
        mesh_search.solve_mesh(problem, budget, 60.0, first=first)


def test_the_solver_branches_on_the_recompute_choices():
    # Under 2.8 MB no plan keeps every activation (3.11 MB at the least). The LP with r free
    # mixes such a plan with one that recomputes (r = 0.35) and bounds 0.808 ms, under every plan;
    # solved per recompute choice with r fixed, the bound is the ILP's optimum (0.9155 ms). The
    # ILP over the choices must equal the ILP with r free solved exactly.
    from autopar.cost_model import ilp, ilp_model
    from autopar.cost_model.stage_weights import ilp_problem

    budget = LONGSEQ_AUTO["memory_budget_bytes"]
    problem = ilp_problem(_plan("gpt-longseq", **LONGSEQ_AUTO).problem)
    branches = ilp.recompute_branches(problem)
    assert sorted(map(sorted, branches)) == [[], ["recompute[blocks:attn]"], ["recompute[blocks]"]]
    assert ilp.min_memory_bytes(problem, frozenset()) > budget  # keeping everything cannot fit
    built = ilp_model.build_model(problem, budget)
    free_lp = ilp_model.solve_highs(built.model, 60, relax=True)[2] / ilp_model.TIME_SCALE
    free_ilp = ilp_model.solve_highs(built.model, 60)[2] / ilp_model.TIME_SCALE
    bound = ilp.solve(problem, budget, relax=True).objective_s
    assert free_lp < 0.95 * bound and bound <= free_ilp * (1 + 1e-6), (free_lp, bound, free_ilp)
    got = ilp.solve(problem, budget)
    assert got.objective_s == pytest.approx(free_ilp, rel=2e-4) and got.lower_bound_s <= free_ilp * (1 + 1e-6)
    assert got.choice["recompute[blocks]"] == 1
    # where even the largest options fit, recompute only adds time: the choice without it is
    # solved alone, and it is the ILP with r free
    roomy = ilp.max_memory_bytes(problem)
    free_roomy = ilp_model.solve_highs(ilp_model.build_model(problem, roomy).model, 60)[2] / ilp_model.TIME_SCALE
    got = ilp.solve(problem, roomy)
    assert got.objective_s == pytest.approx(free_roomy, rel=2e-4) and not any(
        v for k, v in got.choice.items() if k.startswith("recompute["))


def test_auto_offloads_only_the_groups_the_budget_needs():
    budget = PARTIAL_OFFLOAD[1]["memory_budget_bytes"]
    opts = {k: v for k, v in PARTIAL_OFFLOAD[1].items() if k not in ("offload", "memory_budget_bytes")}
    none, whole = _plan("gpt-tiny", **opts), _plan("gpt-tiny", **opts, offload=True)
    assert none.peak_memory_bytes_per_device > budget >= whole.peak_memory_bytes_per_device  # the premise
    auto = _plan("gpt-tiny", **PARTIAL_OFFLOAD[1])
    n_params = len(dict(build("gpt-tiny")[0].named_parameters()))
    assert 0 < len(auto.offload_params) < n_params
    assert auto.peak_memory_bytes_per_device <= budget
    assert 0 < auto.host_bytes < whole.host_bytes and auto.step_seconds < whole.step_seconds
    assert autopar.Plan.from_json(auto.to_json()).offload_params == auto.offload_params
    # no memory pressure: nothing offloaded
    assert _plan("gpt-tiny", **opts, offload="auto").host_bytes == 0
    # groups pinned by name: every copy of the role; a name the model lacks is refused with its groups
    pinned = _plan("gpt-tiny", **opts, offload=["blocks.*.attn.q_proj.weight"])
    assert pinned.offload_params == ("blocks.0.attn.q_proj.weight", "blocks.1.attn.q_proj.weight")
    with pytest.raises(AutoparError, match="neither parameters nor parameter groups.*blocks"):
        _plan("gpt-tiny", **opts, offload=["blocks.*.nothing"])


@pytest.mark.slow
def test_partial_offload_run_keeps_only_those_groups_on_the_host(results):
    r, whole = results[case_key(PARTIAL_OFFLOAD)], results[case_key(OFFLOAD[0])]
    assert "error" not in r, r["error"]
    # equal to one process, bytes = predicted (test_recomputed_run_...), host bytes = predicted
    # (test_offloaded_state_...); here: only part of the state went to the host
    assert 0 < len(r["offload_params"]) and 0 < r["host_bytes"] < whole["host_bytes"]


@pytest.mark.slow
def test_auto_selective_run_recomputes_the_attention(results):
    r = results[case_key(("gpt-longseq", LONGSEQ_SELECTIVE))]
    assert "error" not in r, r["error"]
    # the planner's choice, run: equal to one process and bytes = predicted are checked with
    # every case (test_recomputed_run_equals_single_process_and_bytes_match_plan)
    assert r["recompute"] == ["blocks:attn"] and len(r["checkpointed"]) == N_BLOCKS["gpt-longseq"]


def test_selective_recomputes_the_attention_of_each_block_only():
    none, sel, full = (_plan("gpt-tiny", **MEGATRON, recompute=rc) for rc in ("none", "selective", "full"))
    assert sel.recompute == ("blocks:attn",)
    assert full.activation_bytes < sel.activation_bytes < none.activation_bytes
    assert none.step_seconds < sel.step_seconds < full.step_seconds
    llama = _plan("hf-llama-tiny", strategy="dp", recompute="selective")
    assert llama.recompute == ("model.model.layers:self_attn",)  # not post_attention_layernorm
    with pytest.raises(AutoparError, match="selective.*pipeline"):
        _plan("gpt-tiny", mesh="pp=2,dp=2", recompute="selective")


def test_bad_recompute_mode_is_refused_with_the_choices():
    with pytest.raises(AutoparError, match="recompute='some'.*none, full, auto"):
        _plan("gpt-tiny", recompute="some")


@pytest.fixture
def results(launched):
    return launched(WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case_key(c) for c in CASES])
def test_recomputed_run_equals_single_process_and_bytes_match_plan(results, case, report_line):
    name, options = case
    r = results[case_key(case)]
    assert "error" not in r, r["error"]
    assert_equal_runs(r, train_single(*build(name)), loss_rtol=1e-4)
    # the plan shards (Megatron cuts weights on tp; the long sequence's plan cuts activations)
    assert any("S(" in s for s in r["strategies"].values())
    # the recomputed forward's collectives are in the prediction, and the run sends exactly that:
    # a program that skipped the checkpoints would send less than predicted
    for step, sent in enumerate(r["sent"]):
        assert sent == pytest.approx(r["predicted"]), (step, sent, r["predicted"])
    recomputed = options.get("recompute") != "none"
    assert bool(r["recompute"]) == recomputed
    assert len(r["checkpointed"]) == (N_BLOCKS[name] if recomputed else 0), r["checkpointed"]
    report_line(f"recompute {WORLD} ranks {case_key(case)}: mesh {r['mesh']}, blocks checkpointed "
                f"{len(r['checkpointed'])}, bytes/step {sum(r['predicted'].values()):,.0f} (measured = predicted), "
                f"activations kept by forward {r['kept_bytes']:,.0f} (predicted "
                f"{r['predicted_activation_bytes']:,.0f}), step peak above weights {r['peak_bytes']:,.0f}")


@pytest.mark.slow
@pytest.mark.parametrize("case", OFFLOAD, ids=[case_key(c) for c in OFFLOAD])
def test_offloaded_state_lives_on_the_host_as_planned(results, case, report_line):
    r = results[case_key(case)]
    assert "error" not in r, r["error"]
    assert r["offloaded"] and r["predicted_host_bytes"] > 0
    # master, moments and gradient buffer on the host: exactly the plan's host bytes
    assert r["host_bytes"] == pytest.approx(r["predicted_host_bytes"], rel=1e-6)
    # the device keeps weights and gradients only (a device-side optimizer would add 8 bytes per
    # element, an fp32 step counter per parameter)
    assert r["device_state_bytes"] == pytest.approx(r["predicted_device_state_bytes"], rel=1e-6)
    report_line(f"offload {WORLD} ranks {case_key(case)}: host bytes {r['host_bytes']:,.0f} (predicted "
                f"{r['predicted_host_bytes']:,.0f}), device params+grads {r['device_state_bytes']:,.0f} "
                f"(predicted {r['predicted_device_state_bytes']:,.0f})")


@pytest.mark.slow
@pytest.mark.parametrize("name,family", [("gpt-tiny", "megatron-dp"), ("hf-llama-tiny", "dp")])
def test_selective_keeps_less_than_none_and_more_than_full(results, name, family):
    kept = {rc: results[case_key((name, {"strategy": family, "recompute": rc}))]["kept_bytes"]
            for rc in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < kept["none"], kept


@pytest.mark.slow
@pytest.mark.parametrize("name,family", [("gpt-tiny", "megatron-dp"), ("hf-llama-tiny", "dp")])
def test_recompute_lowers_the_activations_kept_as_predicted(results, name, family):
    full = results[case_key((name, {"strategy": family, "recompute": "full"}))]
    keep = results[case_key((name, {"strategy": family, "recompute": "none"}))]
    # what the forward leaves alive for backward falls; the measured drop is compared with the
    # predicted one in bench/recompute_memory.py (a table), here only its direction and size
    measured = keep["kept_bytes"] - full["kept_bytes"]
    predicted = keep["predicted_activation_bytes"] - full["predicted_activation_bytes"]
    assert measured > 0.5 * predicted, (measured, predicted)


def test_pipeline_stages_recompute_hold_only_block_inputs_in_flight():
    from autopar.models.gpt import GPTConfig, gpt

    model, inputs = gpt(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=128, block_size=64), batch_size=8,
                        seq_len=64)
    kw = dict(mesh="pp=2,dp=2", hardware="a100-80gb", mixed_precision=False, baselines=False)
    keep = autopar.plan(model, 4, inputs, recompute="none", **kw)
    full = autopar.plan(model, 4, inputs, recompute="full", **kw)
    assert keep.recompute == () and not keep.pipeline.recompute
    assert full.recompute == ("blocks",) and full.pipeline.recompute
    assert full.activation_bytes < 0.5 * keep.activation_bytes
    # same layouts, recomputed (per stage chunk: the plan's own figure is its fullest stage's, and
    # which stage is fullest moves when its activations shrink)
    assert [p.param_state_bytes for p in full.stage_plans] == pytest.approx([p.param_state_bytes
                                                                            for p in keep.stage_plans])
    assert autopar.Plan.from_json(full.to_json()).pipeline.recompute


# The memory model against the run (bench/memtrack.py on rank 0, second step), ZeRO-3 included:
# its gathered units (the one landing and the one prefetched), re-gathers and whole gradients in
# flight to their reduce-scatters are in the walk (cost_model/fsdp_memory.py); without them the
# walk was 48% under on the zero3 case (659 KB predicted, 1,243 KB measured). Under attention-only
# recompute the attention's weights come from its recompute, not the unit's re-gather (was 0.895).
PEAK_CASES = [c for c in CASES if c[1].get("strategy") in ("megatron-dp", "dp", "zero3")]


@pytest.mark.slow
@pytest.mark.parametrize("case", PEAK_CASES, ids=[case_key(c) for c in PEAK_CASES])
def test_step_peak_matches_the_plan_within_10_percent(results, case, report_line):
    r = results[case_key(case)]
    assert "error" not in r, r["error"]
    # cost_model/liveness.py: persistent state + buckets, then activations freed and gradients
    # made block by block; the sum of everything (the ILP's row) is 15% over on gpt-tiny
    ratio = r["step_peak_bytes"] / r["predicted_peak_bytes"]
    assert abs(ratio - 1) <= 0.10, (r["step_peak_bytes"], r["predicted_peak_bytes"])
    report_line(f"step peak {case_key(case)}: measured {r['step_peak_bytes']:,.0f} B, predicted "
                f"{r['predicted_peak_bytes']:,.0f} B ({ratio:.2f})")


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c[1].get("recompute") == "none"],
                         ids=[case_key(c) for c in CASES if c[1].get("recompute") == "none"])
def test_activations_kept_by_forward_match_the_plan_within_10_percent(results, case):
    r = results[case_key(case)]
    assert "error" not in r, r["error"]
    # costs.activation_bytes counts what autograd saves (saved_inputs.kept_output); counting
    # every op's output, as before, was 31% over on gpt-tiny and 91% over on the Llama
    assert r["kept_bytes"] == pytest.approx(r["predicted_activation_bytes"], rel=0.10)
