"""SUMMA matmul on real gloo ranks (the first 6 of an 8-rank launch): on 2x2, 1x4, 4x1, 2x3 and 3x2 grids the
output and gradient blocks equal a single-process ``A @ B`` and its autograd gradients, the
bytes sent equal ``summa_bytes``, and a forward holds one panel of A and one of B where the
all-gather approach holds whole panels. The closed forms are checked against the plain
approach without processes."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from summa_cases import CASES, MEMORY_CASE, global_tensors  # noqa: E402

from autopar.cost_model.comm import bytes_sent_per_rank  # noqa: E402
from autopar.mesh import Link  # noqa: E402
from autopar.runtime.collectives import AxisGroup  # noqa: E402
from autopar.runtime.summa import summa_bytes, summa_matmul, summa_peak_extra_bytes, summa_seconds  # noqa: E402

WORLD = 8  # the 8-rank launch; 2x3 and 3x2 grids (neither axis divides the other) and smaller ones use the first ranks


# One case in the session's 8-rank launch (tests/launcher.py); the grids use the first ranks.
LAUNCH_CASES = {WORLD: [("summa", "summa_cases:all_cases", {})]}


@pytest.fixture
def results(launched):
    got = launched(WORLD)["summa"]
    assert "error" not in got, got["error"]
    return got


def _assemble(blocks: dict, q_r: int, q_c: int) -> torch.Tensor:
    """The global tensor from its blocks keyed by (r, c): r along dim 0, c along the last dim."""
    return torch.cat([torch.cat([blocks[r, c] for c in range(q_c)], dim=-1) for r in range(q_r)], dim=0)


def _mkn(case) -> tuple[int, int, int]:
    return math.prod(case.a_shape[:-1]), case.a_shape[-1], case.n


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_blocks_equal_one_process_matmul_and_bytes_equal_formula(results, case):
    records = results[case.name]
    for rec in records:
        assert "error" not in rec, rec["error"]
    q_r, q_c = case.grid
    assert sorted(rec["coord"] for rec in records) == [(r, c) for r in range(q_r) for c in range(q_c)]

    a, b, dc = global_tensors(case)
    a.requires_grad_()
    b.requires_grad_()
    c = a @ b
    c.backward(dc)

    tol = dict(rtol=1e-5, atol=1e-5) if case.dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for key, want in (("c", c.detach()), ("da", a.grad), ("db", b.grad)):
        got = _assemble({rec["coord"]: rec[key] for rec in records}, q_r, q_c)
        assert got.dtype == case.dtype
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{case.name} {key}: {m}")

    M, K, N = _mkn(case)
    expected = summa_bytes(M, K, N, q_r, q_c, a.element_size())
    for rec in records:
        assert rec["sent"] == pytest.approx(expected), (rec["coord"], rec["sent"], expected)


@pytest.mark.slow
def test_forward_holds_one_panel_of_a_and_b(results, report_line):
    """Measured peak live bytes beyond the A, B, C blocks: SUMMA's are exactly its two panel
    buffers; the all-gather approach holds at least its whole gathered panels."""
    q_r, q_c = MEMORY_CASE.grid
    M, K, N = _mkn(MEMORY_CASE)
    predicted = summa_peak_extra_bytes(M, K, N, q_r, q_c, 4)
    for rec in results["memory"]:
        assert "error" not in rec, rec["error"]
        assert rec["summa"] == predicted["summa"]
        assert rec["all_gather"] >= predicted["all_gather"] > predicted["summa"]
    rec = results["memory"][0]
    report_line(f"summa {M}x{K}x{N} on 2x2: forward buffers {rec['summa'] / 1024:.0f} KiB vs "
                f"{rec['all_gather'] / 1024:.0f} KiB gathering whole panels")


# --- closed forms, no processes -------------------------------------------------------------------


def _plain_bytes(M, K, N, q_r, q_c, e) -> dict[str, float]:
    """The all-gather approach, booked by the ring model: gather A's row panel over ``col`` and
    B's column panel over ``row``; backward gathers them again and reduce-scatters the
    gradients (the same re-gather SUMMA does with its second round of broadcasts)."""
    a_row, b_col = M / q_r * K * e, K * N / q_c * e
    gather = bytes_sent_per_rank("all_gather", a_row, q_c) + bytes_sent_per_rank("all_gather", b_col, q_r)
    scatter = bytes_sent_per_rank("reduce_scatter", a_row, q_c) + bytes_sent_per_rank("reduce_scatter", b_col, q_r)
    return {"all_gather": 2 * gather, "reduce_scatter": scatter}


@pytest.mark.parametrize("q", [2, 3, 4])
@pytest.mark.parametrize("grid", ["square", "rows only", "cols only"])
def test_summa_bytes_against_all_gather_approach(q, grid):
    # Relation: the ring model books a broadcast (and a reduce) of S as S for each of the n
    # ranks, an all-gather (reduce-scatter) of S as (n-1)/n S. The group moves the same total
    # either way (n-1 senders of S against n senders of (n-1)/n S), so per axis of size n:
    #     summa broadcast * (n-1)/n == plain all_gather,   summa reduce * (n-1)/n == plain reduce_scatter
    # i.e. SUMMA's booked bytes are twice the plain approach's at n = 2.
    q_r, q_c = {"square": (q, q), "rows only": (q, 1), "cols only": (1, q)}[grid]
    M, K, N, e = 6 * q, 12 * q, 10 * q, 4
    summa, plain = summa_bytes(M, K, N, q_r, q_c, e), _plain_bytes(M, K, N, q_r, q_c, e)
    assert summa["broadcast"] * (q - 1) / q == pytest.approx(plain["all_gather"])
    assert summa["reduce"] * (q - 1) / q == pytest.approx(plain["reduce_scatter"])
    assert summa_bytes(M, K, N, q_r, q_c, e, backward=False) == {"broadcast": summa["broadcast"] / 2}
    assert summa_bytes(M, K, N, 1, 1, e) == {}


@pytest.mark.parametrize("q_r,q_c", [(2, 2), (4, 4), (2, 3), (1, 8), (8, 1)])
def test_peak_extra_is_one_panel_pair(q_r, q_c):
    M, K, N, e = 48, 96, 24, 2
    mem = summa_peak_extra_bytes(M, K, N, q_r, q_c, e)
    assert mem["summa"] < mem["all_gather"]
    # the default panel is K / lcm(q_r, q_c) wide: that fraction of the gathered panels
    assert mem["summa"] * math.lcm(q_r, q_c) == mem["all_gather"]
    assert summa_peak_extra_bytes(M, K, N, q_r, q_c, e, panel_size=1)["summa"] < mem["summa"]
    assert summa_peak_extra_bytes(M, K, N, 1, 1, e) == {"summa": 0.0, "all_gather": 0.0}


def test_seconds_bandwidth_term_is_bytes_and_latency_grows_with_panels():
    M, K, N, e, q_r, q_c = 64, 96, 32, 4, 2, 3
    sent = sum(summa_bytes(M, K, N, q_r, q_c, e).values())
    no_latency = Link("x", 1e9, 0.0)
    assert summa_seconds(M, K, N, q_r, q_c, e, no_latency, no_latency) == pytest.approx(sent / 1e9)
    assert summa_seconds(M, K, N, q_r, q_c, e, no_latency, no_latency, backward=False) == pytest.approx(sent / 3e9)
    # latency only: per panel, fwd 1 broadcast per axis, bwd 1 broadcast + 1 reduce per axis
    alpha = 1e-6
    slow_hop = Link("y", 1e30, alpha)
    per_panel = 3 * ((q_r - 1) + (q_c - 1)) * alpha
    for panel_size, n_panels in ((None, math.lcm(q_r, q_c)), (4, K // 4)):
        got = summa_seconds(M, K, N, q_r, q_c, e, slow_hop, slow_hop, panel_size=panel_size)
        assert got == pytest.approx(n_panels * per_panel)
    assert summa_seconds(M, K, N, 1, 1, e, slow_hop, slow_hop) == 0.0


def test_mismatched_blocks_and_panels_raise():
    row, col = AxisGroup("row", None, 2, 0), AxisGroup("col", None, 2, 0)
    with pytest.raises(ValueError, match="disagree on K"):
        summa_matmul(torch.ones(3, 4), torch.ones(6, 2), row, col)
    with pytest.raises(ValueError, match="positive divisor"):
        summa_matmul(torch.ones(3, 4), torch.ones(4, 2), row, col, panel_size=3)
    with pytest.raises(ValueError, match="at least 2 dims"):
        summa_matmul(torch.ones(4), torch.ones(4, 2), row, col)
