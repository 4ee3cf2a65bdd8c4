"""Ring attention over real gloo processes (one launch of 4 ranks, cases in tests/ring_cases.py):
every rank's output block and dq/dk/dv blocks equal single-process scaled_dot_product_attention with
autograd, causal and not, over the world, both axes of a 2x2 mesh and one-rank groups; the bytes each
rank sends equal ring_attention_bytes, which ring_attention_seconds prices."""

import os
import sys

import pytest
import torch

from autopar.cost_model.comm import p2p_s
from autopar.mesh import Link
from autopar.runtime.ring_attention import ring_attention_bytes, ring_attention_seconds

sys.path.insert(0, os.path.dirname(__file__))
from ring_cases import CASES, case_key  # noqa: E402

WORLD = 4
# Expected group members per axis: init_device_mesh lays the 2x2 mesh out row-major.
GROUP_RANKS = {"world": [[0, 1, 2, 3]] * 4, "inner": [[0, 1], [0, 1], [2, 3], [2, 3]],
               "outer": [[0, 2], [1, 3], [0, 2], [1, 3]], "single": [[0], [1], [2], [3]]}
TOLERANCE = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


# One case in the session's 4-rank launch (tests/launcher.py): it makes the groups and runs them all.
LAUNCH_CASES = {WORLD: [("ring", "ring_cases:all_cases", {})]}


@pytest.fixture
def results(launched):
    got = launched(WORLD)["ring"]
    assert "error" not in got, got["error"]
    return got


def test_every_rank_ran_every_case(results, report_line):
    report_line(f"ring attention: {len(CASES)} cases on {WORLD} gloo ranks")
    for case in CASES:
        assert len(results[case_key(case)]) == WORLD


@pytest.mark.parametrize("case", CASES, ids=[case_key(c) for c in CASES])
def test_ring_attention_equals_sdpa(case, results):
    name, _, dtype = case
    per_rank = results[case_key(case)]
    assert [r["group_ranks"] for r in per_rank] == GROUP_RANKS[name]
    for rank, r in enumerate(per_rank):
        for what, ref in r["ref"].items():
            torch.testing.assert_close(r["got"][what].float(), ref, **TOLERANCE[dtype],
                                       msg=lambda m: f"rank {rank} (axis rank {r['axis_rank']}), {what}, "
                                                     f"shape {r['shape']}: {m}")


@pytest.mark.parametrize("case", CASES, ids=[case_key(c) for c in CASES])
def test_counted_bytes_equal_formula(case, results):
    for rank, r in enumerate(results[case_key(case)]):
        assert r["other_collectives"] == [], f"rank {rank} used {r['other_collectives']}"
        assert r["sent_fwd"] == r["bytes_fwd"], f"rank {rank}: forward sent {r['sent_fwd']}, formula {r['bytes_fwd']}"
        sent = r["sent_fwd"] + r["sent_bwd"]
        assert sent == r["bytes_total"], f"rank {rank}: sent {sent}, formula {r['bytes_total']}"
        if case[0] == "single":
            assert sent == 0


def test_seconds_price_the_counted_bytes():
    b, h, s, d, n = 2, 8, 1024, 64, 4
    # Without latency the time is the bytes over the bandwidth; latency adds one hop per ring step:
    # n - 1 in the forward, n in the backward (the last one takes dK/dV home).
    wire = Link("wire", 100e9, 0.0)
    sent_bytes = ring_attention_bytes(b, h, s, d, 2, n)
    assert ring_attention_seconds(b, h, s, d, 2, n, wire) == pytest.approx(sent_bytes / 100e9)
    slow = Link("slow", 100e9, 1e-3)
    extra = ring_attention_seconds(b, h, s, d, 2, n, slow) - ring_attention_seconds(b, h, s, d, 2, n, wire)
    assert extra == pytest.approx((2 * n - 1) * 1e-3)
    fwd = ring_attention_seconds(b, h, s, d, 2, n, slow, backward=False)
    assert fwd == pytest.approx((n - 1) * p2p_s(2 * b * h * s * d * 2, slow))
    assert ring_attention_seconds(b, h, s, d, 2, 1, slow) == ring_attention_bytes(b, h, s, d, 2, 1) == 0.0
