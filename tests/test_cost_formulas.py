"""Tests for the alpha-beta collective formulas and the hardware profiles.

Expected values are written from the formulas in FACTS.md (nccl-tests PERFORMANCE.md),
independently of autopar.cost_model.comm, so a wrong factor shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from autopar.cost_model.comm import (
    COLLECTIVES,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    broadcast_s,
    bytes_sent_per_rank,
    collective_s,
    p2p_s,
    reduce_scatter_s,
)
from autopar.cost_model.hardware import PROFILES, Hardware, HardwareError, get_hardware
from autopar.mesh import Link, MeshSpec

NS = (2, 4, 8, 64, 1024)
SIZES = (1, 1000, 2**20, 10**8, 2**30)  # 1 B .. 1 GiB
LINKS = (
    Link("fast", 370e9, 1.1e-6),
    Link("slow", 25e9, 3.2e-6),
    Link("gloo", 1.9e9, 200e-6),
)
COLL_FNS = (all_reduce_s, all_gather_s, reduce_scatter_s, all_to_all_s, broadcast_s)


# ---------------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("link", LINKS, ids=lambda l: l.name)
def test_all_reduce_never_dearer_than_reduce_scatter_plus_all_gather(link: Link) -> None:
    for n in NS:
        for s in SIZES:
            ar = all_reduce_s(s, n, link)
            rs_ag = reduce_scatter_s(s, n, link) + all_gather_s(s, n, link)
            assert ar <= rs_ag * (1 + 1e-12) + 1e-18, (n, s)
            # In the pure ring model the two are the same algorithm.
            assert ar == pytest.approx(rs_ag, rel=1e-12)


def test_formulas_match_facts() -> None:
    link = Link("l", 100e9, 2e-6)
    n, s = 8, 2**26
    b, a = link.bandwidth_bytes_per_s, link.latency_s
    assert all_reduce_s(s, n, link) == pytest.approx(2 * (n - 1) / n * s / b + 2 * (n - 1) * a)
    for fn in (all_gather_s, reduce_scatter_s, all_to_all_s):
        assert fn(s, n, link) == pytest.approx((n - 1) / n * s / b + (n - 1) * a)
    assert broadcast_s(s, n, link) == pytest.approx(s / b + (n - 1) * a)
    assert p2p_s(s, link) == pytest.approx(s / b + a)
    for name in COLLECTIVES:
        if name != "p2p":
            fn = {"all_reduce": all_reduce_s, "all_gather": all_gather_s, "reduce_scatter": reduce_scatter_s,
                  "all_to_all": all_to_all_s, "broadcast": broadcast_s,
                  "reduce": broadcast_s}[name]  # a pipelined ring reduce: the broadcast reversed
            assert collective_s(name, s, n, link) == fn(s, n, link)
    assert collective_s("p2p", s, 2, link) == p2p_s(s, link)


def test_one_rank_or_no_bytes_costs_nothing() -> None:
    link = LINKS[0]
    for fn in COLL_FNS:
        assert fn(2**30, 1, link) == 0.0
        assert fn(0, 8, link) == 0.0
    assert p2p_s(0, link) == 0.0
    assert collective_s("p2p", 2**20, 1, link) == 0.0
    for name in COLLECTIVES:
        assert bytes_sent_per_rank(name, 2**20, 1) == 0.0
        assert bytes_sent_per_rank(name, 0, 8) == 0.0


def test_time_grows_with_bytes_and_with_ranks() -> None:
    for link in LINKS:
        for fn in COLL_FNS:
            for n in NS:
                times = [fn(s, n, link) for s in SIZES]
                assert all(t1 < t2 for t1, t2 in zip(times, times[1:])), (fn.__name__, n)
            for s in SIZES:
                times = [fn(s, n, link) for n in NS]
                assert all(t1 < t2 for t1, t2 in zip(times, times[1:])), (fn.__name__, s)
        times = [p2p_s(s, link) for s in SIZES]
        assert all(t1 < t2 for t1, t2 in zip(times, times[1:]))


def test_latency_term_dominates_tiny_messages() -> None:
    link = Link("l", 100e9, 5e-6)
    # 1 byte on 1024 ranks: all-reduce is 2*1023 hops of latency, bandwidth is negligible.
    assert all_reduce_s(1, 1024, link) == pytest.approx(2 * 1023 * 5e-6, rel=1e-6)


def test_inter_node_axis_is_dearer_than_intra_node() -> None:
    for name, hw in PROFILES.items():
        if name == "cpu":
            assert hw.intra_node == hw.inter_node  # one box: both the same loopback
            continue
        for fn in COLL_FNS:
            for n in (2, 8, 64):
                for s in (1, 2**20, 2**30):
                    assert fn(s, n, hw.inter_node) > fn(s, n, hw.intra_node), (name, fn.__name__, n, s)
        assert p2p_s(2**20, hw.inter_node) > p2p_s(2**20, hw.intra_node)


def test_bytes_sent_per_rank() -> None:
    n, s = 8, 8000
    assert bytes_sent_per_rank("all_reduce", s, n) == pytest.approx(2 * 7 / 8 * s)
    assert bytes_sent_per_rank("all_gather", s, n) == pytest.approx(7 / 8 * s)
    assert bytes_sent_per_rank("reduce_scatter", s, n) == pytest.approx(7 / 8 * s)
    assert bytes_sent_per_rank("all_to_all", s, n) == pytest.approx(7 / 8 * s)
    assert bytes_sent_per_rank("broadcast", s, n) == s
    assert bytes_sent_per_rank("p2p", s, 2) == s
    # Bandwidth term of each time == bytes sent / B.
    link = Link("l", 1e9, 0.0)
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert collective_s(name, s, n, link) == pytest.approx(bytes_sent_per_rank(name, s, n) / 1e9)
    with pytest.raises(ValueError, match="unknown collective"):
        bytes_sent_per_rank("allreduce", s, n)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        all_reduce_s(-1, 4, LINKS[0])
    with pytest.raises(ValueError):
        all_gather_s(10, 0, LINKS[0])
    with pytest.raises(ValueError, match="unknown collective"):
        collective_s("gather", 10, 4, LINKS[0])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- hardware


def test_profiles_present_and_sane() -> None:
    assert set(PROFILES) >= {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "cpu"}
    for name, hw in PROFILES.items():
        assert hw.name == name
        assert get_hardware(name) is hw
        assert get_hardware(name.upper()) is hw
        assert hw.peak_flops > 0 and hw.peak_flops_fp32 > 0
        assert 0 < hw.efficiency <= 1
        assert name in str(hw)
    h200 = PROFILES["h200-141gb"]
    assert h200.memory_bytes == 141e9
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12
    assert h200.peak_flops == PROFILES["h100-80gb"].peak_flops == 989e12
    assert PROFILES["a100-80gb"].peak_flops == 312e12


def test_mesh_links_16x8_outer_inter_inner_intra() -> None:
    hw = PROFILES["h100-80gb"]
    assert hw.mesh_links((16, 8)) == (hw.inter_node, hw.intra_node)
    assert hw.mesh_links((2, 4)) == (hw.intra_node, hw.intra_node)
    assert hw.mesh_links((8,)) == (hw.intra_node,)
    assert hw.mesh_links((16,)) == (hw.inter_node,)
    # dp=4 x tp=4 over 16 GPUs: tp groups {0..3} stay in a node; dp groups {0,4,8,12} span two.
    assert hw.mesh_links((4, 4)) == (hw.inter_node, hw.intra_node)
    # pp=2 x dp=2 x tp=2 on 8 GPUs: one node, all intra.
    assert hw.mesh_links((2, 2, 2)) == (hw.intra_node,) * 3
    # 4 x 2 x 8: innermost axis fills a node, both outer axes cross nodes.
    assert hw.mesh_links((4, 2, 8)) == (hw.inter_node, hw.inter_node, hw.intra_node)
    # A size-1 axis never communicates; call it intra.
    assert hw.mesh_links((1, 16)) == (hw.intra_node, hw.inter_node)
    # Odd size: groups of 3 consecutive ids on 8-GPU nodes; {6,7,8} straddles two nodes.
    assert hw.mesh_links((8, 3)) == (hw.inter_node, hw.inter_node)
    # Whole mesh on one node even if the sizes do not divide it.
    assert hw.mesh_links((2, 3)) == (hw.intra_node, hw.intra_node)


def test_mesh_spec_carries_links() -> None:
    hw = PROFILES["a100-80gb"]
    mesh = hw.mesh_spec(("dp", "tp"), (16, 8))
    assert isinstance(mesh, MeshSpec)
    assert mesh.axes == ("dp", "tp") and mesh.sizes == (16, 8)
    assert mesh.links == (hw.inter_node, hw.intra_node)


def test_unknown_hardware_one_line_error() -> None:
    with pytest.raises(ValueError) as info:
        get_hardware("tpu-v5")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("unknown hardware 'tpu-v5'; pick one of a100-40gb, a100-80gb, h100-80gb, h200-141gb, cpu")
    assert "or a JSON profile path (see autopar calibrate)" in msg
    with pytest.raises(HardwareError, match=r"did you mean 'h100-80gb'\?") as info:
        get_hardware("h100")
    assert "\n" not in str(info.value)


def test_json_round_trip(tmp_path) -> None:
    for hw in PROFILES.values():
        data = hw.to_json()
        assert Hardware.from_json(json.loads(json.dumps(data))) == hw
        assert set(data["intra_node"]) == {"name", "bandwidth_bytes_per_s", "latency_s"}
    custom = dict(PROFILES["cpu"].to_json(), name="my-box", devices_per_node=4)
    path = tmp_path / "box.json"
    path.write_text(json.dumps(custom))
    hw = get_hardware(str(path))
    assert hw.name == "my-box" and hw.devices_per_node == 4
    assert hw.to_json() == custom


def test_bad_json_profiles(tmp_path) -> None:
    data = PROFILES["a100-80gb"].to_json()
    del data["peak_flops"]
    with pytest.raises(HardwareError, match="missing peak_flops"):
        Hardware.from_json(data)
    data = dict(PROFILES["a100-80gb"].to_json(), tflops=1)
    with pytest.raises(HardwareError, match="unknown tflops"):
        Hardware.from_json(data)
    data = dict(PROFILES["a100-80gb"].to_json(), efficiency=1.5)
    with pytest.raises(HardwareError, match="efficiency"):
        Hardware.from_json(data)
    with pytest.raises(HardwareError, match="does not exist"):
        get_hardware(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HardwareError, match="cannot read"):
        get_hardware(str(bad))


def test_mesh_links_match_bruteforce() -> None:
    """mesh_links against a direct check of every group of device ids."""
    hw = PROFILES["a100-40gb"]
    dpn = hw.devices_per_node
    for sizes in [(16, 8), (2, 4), (4, 4), (8, 2, 2), (3, 3), (2, 6), (5, 2), (2, 2, 2, 2), (32,), (4, 16)]:
        n = math.prod(sizes)
        expected = []
        for i, size in enumerate(sizes):
            stride = math.prod(sizes[i + 1:])
            intra = all(
                len({(base + j * stride) // dpn for j in range(size)}) == 1
                for base in range(n)
                if (base // stride) % size == 0
            )
            expected.append(hw.intra_node if intra else hw.inter_node)
        assert hw.mesh_links(sizes) == tuple(expected), sizes


def test_zero2_unit_pays_each_collective_latency_once() -> None:
    # runtime/zero2.py gathers and reduce-scatters a unit's ZeRO-2 parameters in one collective
    # each: priced per parameter, each pays its share of the unit's latency, bandwidth in full
    from autopar.cost_model.problem import zero2_seconds, zero2_steps
    from autopar.strategy import Layout

    link = Link("gloo", 1e9, 1e-3)
    mesh = MeshSpec(("dp",), (4,), (link,))
    sizes = (1000, 3000, 6001)
    steps = [zero2_steps(s, Layout.replicated(1), (0,), mesh, 4) for s in sizes]
    assert [st.collective for st in steps[0]] == ["reduce_scatter", "all_gather"]
    alone = sum(zero2_seconds(st, mesh, 1.0) for st in steps)
    shared = sum(zero2_seconds(st, mesh, s / sum(sizes)) for st, s in zip(steps, sizes))
    assert alone == pytest.approx(sum(collective_s(x.collective, x.nbytes, 4, link) for st in steps for x in st))
    # two collectives of 3 ring steps each: once for the unit instead of once per parameter
    assert alone - shared == pytest.approx(2 * 3 * link.latency_s * (len(sizes) - 1))


def test_a_link_prices_each_collective_at_its_measured_rates_and_keeps_them_through_json():
    rows = (("reduce_scatter", 4, 0.2e9, 3e-3), ("all_gather", 2, 0.8e9, 4e-3))
    link = Link("gloo", 1.5e9, 1e-3, rows)
    plain = Link("gloo", 1.5e9, 1e-3)
    size = 8 << 20
    # a measured row replaces the pair for that collective and group size only
    assert reduce_scatter_s(size, 4, link) == pytest.approx(3 / 4 * size / 0.2e9 + 3 * 3e-3)
    assert reduce_scatter_s(size, 2, link) == reduce_scatter_s(size, 2, plain)
    assert all_gather_s(size, 2, link) == pytest.approx(1 / 2 * size / 0.8e9 + 4e-3)
    assert all_reduce_s(size, 4, link) == all_reduce_s(size, 4, plain)
    assert Link.from_json(link.to_json()) == link and Link.from_json(plain.to_json()) == plain
    hw = dataclasses.replace(get_hardware("cpu"), intra_node=link, inter_node=link)
    assert Hardware.from_json(json.loads(json.dumps(hw.to_json()))) == hw


def test_the_parameters_a_bucket_of_their_own_holds_are_those_the_runtime_leaves_without_a_flat_buffer():
    from autopar.cost_model.buckets import alone_in_bucket

    mib = 2**20
    # reverse parameter order, as backward makes the gradients: the head fills the small first bucket
    order = [("head", 8 * mib, (0,)), ("a", 0.5 * mib, (0,)), ("b", 0.7 * mib, (0,)), ("c", 30 * mib, (0,)),
             ("d", 0.1 * mib, (1,)), ("e", 0.2 * mib, (0,))]
    assert alone_in_bucket(order) == {"head", "d", "e"}  # d: the only one synced over axis 1; e: after c closed
    assert alone_in_bucket([("a", 0.5 * mib, (0,)), ("head", 8 * mib, (0,))]) == set()  # shares the first bucket
