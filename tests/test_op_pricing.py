"""Softmax-like ops (softmax, log-softmax, the cross-entropy loss) are priced at the calibrated
``Hardware.softmax_bytes_per_s``; every other op, and every profile without the rate, at the
streaming bandwidth. Exact formulas on a traced graph, no timing."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autopar.cost_model.costs import TrainingSpec, compute_seconds
from autopar.cost_model.hardware import HardwareError, get_hardware
from autopar.mesh import Link, MeshSpec
from autopar.strategy import Layout, Strategy
from autopar.trace import trace

aten = torch.ops.aten
ROWS, VOCAB = 64, 512


class Loss(torch.nn.Module):
    def forward(self, logits, targets):
        return F.cross_entropy(F.gelu(logits), targets)


def _priced(hw):
    gm = trace(Loss(), (torch.randn(ROWS, VOCAB), torch.randint(0, VOCAB, (ROWS,))))
    mesh = MeshSpec(("dp",), (1,), (Link("l", 1e9, 1e-6),))
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            rep = Layout.replicated(1)
            st = Strategy(tuple(rep for _ in n.args if isinstance(_, torch.fx.Node)), (rep,))
            out[n.target] = compute_seconds(n, st, mesh, hw, TrainingSpec(mixed_precision=False), True)
    return out


def test_cross_entropy_moves_its_logits_twice_at_the_softmax_rate():
    base = dataclasses.replace(get_hardware("cpu"), kernel_overhead_s=0.0, efficiency=1.0,
                               memory_bandwidth_bytes_per_s=8e9, peak_flops_fp32=1e15, peak_flops=1e15)
    slow = dataclasses.replace(base, softmax_bytes_per_s=1e9)
    plain, priced = _priced(base), _priced(slow)
    # the cost model counts elements at the training precision (4 bytes), integer targets too
    logits_bytes, target_bytes, loss_bytes = ROWS * VOCAB * 4, ROWS * 4, 4
    fwd, bwd = priced[aten.cross_entropy_loss.default]
    assert fwd == pytest.approx((2 * logits_bytes + target_bytes + loss_bytes) / 1e9)
    assert bwd == pytest.approx(fwd)
    # without the rate: its bytes (input, targets, loss) at the streaming bandwidth, as before
    assert plain[aten.cross_entropy_loss.default][0] == pytest.approx((logits_bytes + target_bytes + loss_bytes) / 8e9)
    # an elementwise op is priced the same with or without the rate
    assert priced[aten.gelu.default] == plain[aten.gelu.default]
    assert plain[aten.gelu.default][0] == pytest.approx(2 * logits_bytes / 8e9)


def test_gpu_profiles_price_softmax_at_hbm_bandwidth():
    for name in ("a100-80gb", "h100-80gb", "h200-141gb"):
        assert get_hardware(name).softmax_bytes_per_s == 0.0  # 0: memory_bandwidth_bytes_per_s


@pytest.mark.parametrize("bad", [-1.0, float("inf"), "fast"])
def test_bad_softmax_rate_is_refused(bad):
    with pytest.raises(HardwareError, match="softmax_bytes_per_s must be >= 0"):
        dataclasses.replace(get_hardware("cpu"), softmax_bytes_per_s=bad)


def test_a_matmul_backward_costs_the_calibrated_ratio_of_its_forward():
    class Lin(torch.nn.Module):
        def forward(self, x, w):
            return F.gelu(x @ w)

    gm = trace(Lin(), (torch.randn(ROWS, VOCAB), torch.randn(VOCAB, VOCAB)))
    mesh = MeshSpec(("dp",), (1,), (Link("l", 1e9, 1e-6),))
    rep = Layout.replicated(1)
    for ratio in (2.0, 2.6):
        hw = dataclasses.replace(get_hardware("cpu"), backward_ratio=ratio)
        for n in gm.graph.nodes:
            if n.op == "call_function":
                st = Strategy(tuple(rep for _ in n.args if isinstance(_, torch.fx.Node)), (rep,))
                fwd, bwd = compute_seconds(n, st, mesh, hw, TrainingSpec(mixed_precision=False), True)
                assert bwd == pytest.approx(ratio * fwd if n.target in (aten.mm.default, aten.matmul.default) else fwd), n.target
    with pytest.raises(HardwareError, match="backward_ratio"):
        dataclasses.replace(get_hardware("cpu"), backward_ratio=0.0)


def test_saved_facts_shared_by_signature_equal_each_nodes_own_meta_run():
    # repeated blocks share one meta run per op (saved_inputs._signature); the facts must be what
    # each node's own run gives, for every op of a GPT, with and without gradients wanted
    from autopar.cost_model import saved_inputs
    from autopar.models import get_model

    model, inputs = get_model("gpt2", device="meta")
    gm = trace(model, inputs, stack_traces=False, repeat_blocks=True)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    for needs in ({n.name: True for n in gm.graph.nodes},
                  {n.name: not n.name.startswith("p_") for n in gm.graph.nodes}):  # weights frozen
        saved_inputs._BY_SIGNATURE.clear()
        got = [saved_inputs.saved_facts(n, needs) for n in ops]
        assert len(saved_inputs._BY_SIGNATURE) < len(ops) / 5  # shared across the 12 blocks
        for n in ops:
            saved_inputs._SAVED.pop(n, None)  # the next pass asks anew
        assert got == [saved_inputs._saved_facts(n, needs) for n in ops]

    class TwoMatmuls(torch.nn.Module):  # the same op and shapes, one input wanting a gradient
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = torch.nn.Parameter(torch.ones(8, 8)), torch.nn.Parameter(torch.ones(8, 8))

        def forward(self, x):
            return torch.mm(torch.mm(x, self.w1), self.w2)  # x wants none, the inner product does

    gm = trace(TwoMatmuls(), (torch.ones(4, 8),), stack_traces=False)
    needs = {n.name: n.op != "placeholder" or n.name.startswith("p_") for n in gm.graph.nodes}
    first, second = [saved_inputs.saved_facts(n, needs) for n in gm.graph.nodes if n.op == "call_function"]
    assert first.inputs == {0} and second.inputs == {0, 1}  # mm keeps x for w1's grad; both for the second
