"""ZeRO-3's collectives are priced once per unit, as ``runtime.fsdp`` runs them (one flat
all-gather, re-gather and reduce-scatter per repeated block or module), not once per parameter."""

import dataclasses
import logging

import pytest

import autopar
from autopar.cost_model.blocks import unit_key
from autopar.cost_model.comm import collective_s, unit_collective_s
from autopar.cost_model.hardware import get_hardware
from autopar.mesh import Link
from autopar.models import GPTConfig, gpt


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_unit_shares_sum_to_one_collective(kind):
    link = Link("l", 2e9, 3e-4)
    sizes = [1e5, 3e5, 6e5]
    total = sum(sizes)
    shared = sum(unit_collective_s(kind, s, 4, link, s / total) for s in sizes)
    assert shared == pytest.approx(collective_s(kind, total, 4, link))
    assert unit_collective_s(kind, 1e5, 4, link, 1.0) == collective_s(kind, 1e5, 4, link)
    assert unit_collective_s(kind, 0.0, 4, link, 0.5) == 0.0 and unit_collective_s(kind, 1e5, 1, link, 0.5) == 0.0


def test_zero3_pays_latency_per_unit_not_per_parameter():
    """On a latency-only link, ZeRO-3's comm counts collectives: one gather and one reduce-scatter
    per unit at least, three per unit (a re-gather for backward) plus the position embedding's
    activation all-reduce (2 hops' worth) at most; per parameter it was more than twice the
    parameter count."""
    logging.disable(logging.WARNING)
    model, inputs = gpt(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64),
                        batch_size=8, seq_len=64, device="meta")
    link = Link("latency-only", 1e30, 1e-3)
    hw = dataclasses.replace(get_hardware("cpu"), intra_node=link, inter_node=link, comm_overlap=0.0)
    plan = autopar.plan(model, 4, inputs, hardware=hw, strategy="zero3", baselines=False, pipeline=False)
    hop_s = (4 - 1) * link.latency_s  # one ring all-gather or reduce-scatter on 4 ranks
    units = {unit_key(n) for n, _ in model.named_parameters()}
    n_params = sum(1 for _ in model.parameters())
    collectives = plan.comm_seconds / hop_s
    assert 2 * len(units) <= collectives <= 3 * len(units) + 2, (collectives, len(units))
    assert collectives < n_params  # well under one per parameter


def _plan_on_latency_link(strategy):
    logging.disable(logging.WARNING)
    model, inputs = gpt(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=512, block_size=64),
                        batch_size=8, seq_len=64, device="meta")
    link = Link("latency-only", 1e30, 1e-3)
    hw = dataclasses.replace(get_hardware("cpu"), intra_node=link, inter_node=link, comm_overlap=0.0)
    return autopar.plan(model, 4, inputs, hardware=hw, strategy=strategy, baselines=False, pipeline=False)


def test_units_group_only_weights_cut_on_their_gather_axis_alone():
    """runtime.fsdp groups a unit's gathers only when every weight is stored cut on its gather
    axis alone (ZeRO-3 over dp); 2D layouts cut each weight on both axes and gather one at a time,
    so without unit shares the 2D plan prices the same and the dp plan more."""
    from autopar.cost_model.evaluate import evaluate

    for strategy, grouped in (("zero3", True), ("2d", False)):
        plan = _plan_on_latency_link(strategy)
        problem, choice = plan.problem, plan.choice
        with_units = evaluate(problem, choice).comm_seconds
        problem.unit_shares = {}
        alone = evaluate(problem, choice).comm_seconds
        assert plan.comm_bytes.get("all_gather", 0) > 0, strategy  # it does gather weights
        if grouped:
            assert alone > 2 * with_units, strategy
        else:
            assert alone == pytest.approx(with_units), strategy
