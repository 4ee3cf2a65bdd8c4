"""The technique registry (autopar.techniques): the built-in techniques and families are
registered, descriptions are frozen, and a technique registered from outside reaches annotate,
the cost problem and the search without any of them naming it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.hardware import get_hardware
from autopar.cost_model.problem import build_problem
from autopar.cost_model.reshard import CommStep
from autopar.errors import AutoparError
from autopar.models import MLPConfig, mlp
from autopar.planner import STRATEGY_FAMILIES
from autopar.techniques import base
from autopar.techniques.pins import ClassicPin, GridPin, SequencePin

aten = torch.ops.aten
BUILT_IN = {"data_parallel": {"dp", "zero2", "zero3"}, "megatron": {"megatron", "megatron-sp", "megatron-dp"},
            "summa": {"2d"}, "tesseract": {"2.5d"}, "tensor_3d": {"3d"}, "ulysses": {"sp", "ulysses"},
            "ring_attention": {"ring"}, "optimus_norm": set()}


def test_built_in_techniques_and_families_are_registered_and_frozen():
    names = {t.name: {f.name for f in t.families} for t in base.techniques()}
    for name, fams in BUILT_IN.items():
        assert names.get(name) == fams, name
    assert STRATEGY_FAMILIES[0] == "auto" and STRATEGY_FAMILIES[-1] == "pp"
    assert set(STRATEGY_FAMILIES[1:-1]) == {f.name for f in base.families()}
    # the runtime algorithms price and lower themselves; families-only techniques do neither
    for name in ("summa", "ring_attention", "optimus_norm"):
        t = base.technique(name)
        assert t.runs and t.price and t.lower
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.technique("summa").title = "x"
    f = base.family("zero2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.name = "y"
    hw = get_hardware("a100-80gb")
    (mesh, pin), = f.meshes(8, hw)
    assert mesh.sizes == (8,) and isinstance(pin, ClassicPin) and pin.zero2 and pin.strict
    with pytest.raises(dataclasses.FrozenInstanceError):
        pin.zero2 = False
    # pins are values: equal by their parameters, picklable (the planner's helper process)
    assert pickle.loads(pickle.dumps(pin)) == pin
    assert base.family("2d").meshes(4, hw)[0][1] == GridPin((0,), (0,), (1,), (1,))
    assert base.family("ring").meshes(4, hw)[0][1] == SequencePin(0, (), "ring_attention")


def test_register_refuses_a_taken_family_and_changes_nothing():
    before = [t.name for t in base.techniques()], base.families()
    clash = base.Technique("other", "other", families=(base.Family("zero2", "x", lambda n, hw: []),))
    with pytest.raises(AutoparError, match="zero2.*already offered by technique 'data_parallel'"):
        base.register(clash)
    assert ([t.name for t in base.techniques()], base.families()) == before


def _toy(calls: list) -> base.Technique:
    """A technique on GELU: a GELU whose hidden dim is split runs it, priced as one broadcast of
    its local output per step on its axis, plus an extra strategy hook that only records calls."""

    def runs(node, st):
        return any(c == node.meta["val"].dim() - 1 for c in st.outputs[0].codes)

    def strategies(node, sts, mesh):
        calls.append(node.name)
        return []

    def price(ctx, node, st, backward):
        axis = next(a for a, c in enumerate(st.outputs[0].codes) if c >= 0)
        nbytes = ctx.tensor_bytes(node.meta["val"]) * st.outputs[0].local_fraction(ctx.mesh)
        return [CommStep("broadcast", axis, nbytes)]

    return base.Technique("toy", "toy technique", ops=frozenset({aten.gelu.default}), runs=runs,
                          strategies=strategies, price=price)


def test_a_registered_technique_reaches_annotate_and_the_cost_problem():
    model, inputs = mlp(MLPConfig(in_features=16, hidden=32, out_features=4, depth=2), batch_size=8, device="meta")
    gm = autopar.trace(model, inputs)
    hw = get_hardware("a100-80gb")
    mesh = hw.mesh_spec(("tp",), (2,))
    gelus = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.gelu.default]
    assert gelus
    calls: list = []
    with base.registered(_toy(calls)):
        autopar.annotate(gm, mesh)
        problem = build_problem(gm, mesh, hw, TrainingSpec())
        assert set(calls) >= {gelus[0].name}  # (repeated layers share the cached expansion)
        for g in gelus:
            sts = g.meta[autopar.STRATEGIES_KEY]
            tagged = [s for s in sts if s.technique == "toy"]
            assert tagged and all(any(c == 1 for c in s.outputs[0].codes) for s in tagged)
            assert all(s.technique is None for s in sts if s not in tagged)
        priced = 0
        for d in problem.decisions.values():
            if d.node.target is not aten.gelu.default:
                continue
            for (st, _), steps in zip(d.options, d.comm_steps):
                kinds = [s.collective for s, _ in steps]
                assert ("broadcast" in kinds) == (st.technique == "toy")
                priced += st.technique == "toy"
        assert priced
    # out of the block the registry is as it was: annotating again tags nothing as "toy"
    autopar.annotate(gm, mesh)
    assert "toy" not in {t.name for t in base.techniques()}
    assert all(s.technique is None for g in gelus for s in g.meta[autopar.STRATEGIES_KEY])
