"""Per-model run-time state (issue 15 item 5): two models parallelized in one process on 4 gloo
ranks train alternately; each equals its own single-process run (losses, first-step gradients,
parameters after 3 AdamW steps), is sharded as its plan says, sends what its plan predicts,
and shares no process group, AxisGroup, ZeRO-3 gather state or gradient bucket with the other
(by identity). Its case rides in the session's 4-rank launch (tests/launcher.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from state_cases import MODELS  # noqa: E402
from test_runtime import assert_matches_single_process  # noqa: E402

LAUNCH_CASES = {4: [("two-models", "state_cases:two_models", {})]}


@pytest.fixture
def result(launched):
    return launched(4)["two-models"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [m[0] for m in MODELS])
def test_each_of_two_models_equals_its_single_process_run(result, name, report_line):
    assert "error" not in result, result.get("error")
    r = result[name]
    assert_matches_single_process(r, name)
    # the plan shards (every local tensor is the piece its layout names, some are cut) and
    # every rank sends exactly the bytes the plan predicts, for this model's steps alone
    assert not r["shard_mismatches"], r["shard_mismatches"][:5]
    assert sum(r["predicted"].values()) > 0
    if dict((m[0], m[1]) for m in MODELS)[name] == "zero3":
        assert r["cut_params"] > 0, r["cut_params"]
    for rank, steps in enumerate(r["sent_by_rank"]):
        for step, sent in enumerate(steps):
            assert sent == pytest.approx(r["predicted"]), (name, rank, step, sent, r["predicted"])
    report_line(f"two models in one process, {name}: mesh {r['mesh']}, bytes/step "
                f"{sum(r['predicted'].values()):,.0f} (measured = predicted), loss {r['losses'][-1]:.6f}")


@pytest.mark.slow
def test_two_models_share_no_runtime_state(result):
    assert "error" not in result, result.get("error")
    for name, family, _ in MODELS:
        r = {k: v for k, v in result[name].items() if k not in ("grads", "params")}
        # each model's state is its own and in use: its program reads its own groups and
        # ZeRO-3 state; the ZeRO-3 model's prefetch schedule and the data parallel model's
        # buckets hold that model's parameters
        assert r["n_axis_groups"] == 1 and r["n_process_groups"] == 1, r
        assert r["program_groups_are_own"] and r["program_fsdp_is_own"], r
        assert r["bucket_params_are_own"] and r["scheduled_params_are_own"], r
        if family == "zero3":
            assert r["n_scheduled_params"] > 0, r
        if family == "dp":
            assert r["n_bucket_params"] > 0, r
        assert r["grads_in_flight"] == 0, r  # every reduce-scatter landed at the end of backward
    for rank, shared in enumerate(result["shared_by_rank"]):
        assert shared == {k: 0 for k in shared}, (rank, shared)
