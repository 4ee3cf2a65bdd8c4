"""The technique registry (autopar.techniques): the built-in techniques and families are
registered, descriptions are frozen, and a technique registered from outside reaches annotate,
the cost problem and the search without any of them naming it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import autopar
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.hardware import get_hardware
from autopar.cost_model.problem import build_problem
from autopar.cost_model.reshard import CommStep
from autopar.errors import AutoparError
from autopar.models import MLPConfig, mlp
from autopar.planner import STRATEGY_FAMILIES
from autopar import technique as base
from autopar.techniques import catalog  # noqa: F401 (every technique file registers)
from autopar.techniques.pins import ClassicPin, GridPin, SequencePin
from autopar.strategy import Layout, Shard, Strategy

aten = torch.ops.aten
BUILT_IN = {"data_parallel": {"dp", "zero2", "zero3"}, "megatron": {"megatron", "megatron-sp", "megatron-dp"},
            "summa": {"2d"}, "tesseract": {"2.5d"}, "tensor_3d": {"3d"}, "ulysses": {"sp", "ulysses"},
            "ring_attention": {"ring"}, "optimus_norm": set(), "vocab_parallel_ce": set()}


def test_built_in_techniques_and_families_are_registered_and_frozen():
    names = {t.name: {f.name for f in t.families} for t in base.techniques()}
    for name, fams in BUILT_IN.items():
        assert names.get(name) == fams, name
    assert STRATEGY_FAMILIES[0] == "auto" and STRATEGY_FAMILIES[-1] == "pp"
    assert set(STRATEGY_FAMILIES[1:-1]) == {f.name for f in base.families()}
    assert [f.name for f in base.families() if f.baseline] == ["dp", "zero2", "zero3", "megatron", "megatron-sp",
                                                               "megatron-dp"]
    # the runtime algorithms price and lower themselves; families-only techniques do neither
    for name in ("summa", "ring_attention", "optimus_norm", "vocab_parallel_ce"):
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


class _ReluScale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(torch.relu(self.fc(x)) * 3.0)


def _toy_kernel(h, group):
    return torch.relu(h) * 3.0


def _toy_region_technique() -> base.Technique:
    """A region technique: relu then scale run as one call; its token-split strategy is priced
    with one broadcast and lowered to ``_toy_kernel``."""
    def regions(gm):
        out = []
        for n in gm.graph.nodes:
            if n.target is aten.relu.default and len(n.users) == 1:
                (mul,) = n.users
                if mul.target is aten.mul.Tensor:
                    out.append(base.RegionMatch((n, mul), (n.args[0],)))
        return out

    def strategies(node, _, mesh):
        rep, row = Layout.replicated(1), Layout.interned((Shard(0),))
        return [Strategy((rep,), (rep,)), Strategy((row,), (row,))]

    return base.Technique(
        name="toy_region", title="toy region", regions=regions, strategies=strategies,
        runs=lambda node, s: s.output.codes == (0,),
        price=lambda ctx, node, s, backward: [CommStep("broadcast", 0, 1000.0)],
        lower=lambda ctx, node, s, args, kwargs: ctx.graph.call_function(_toy_kernel, (*args, ctx.groups[0])))


def test_a_region_technique_collapses_a_sub_graph_prices_it_once_and_lowers_one_call():
    from autopar.passes.lower import lower
    from autopar.runtime.collectives import AxisGroup

    model, x = _ReluScale(), torch.randn(4, 8)
    with base.registered(_toy_region_technique()):
        gm = autopar.trace(model, (x,))
        regions = [n for n in gm.graph.nodes if isinstance(n.target, base.Region)]
        assert len(regions) == 1 and regions[0].target.technique == "toy_region"
        assert not any(n.target in (aten.relu.default, aten.mul.Tensor) for n in gm.graph.nodes)
        torch.testing.assert_close(gm(x), model(x))  # the region node runs the original ops
        hw = get_hardware("a100-80gb")
        mesh = hw.mesh_spec(("dp",), (2,))
        autopar.annotate(gm, mesh)
        region = regions[0]
        sts = region.meta[autopar.STRATEGIES_KEY]
        assert [s.technique for s in sts] == [None, "toy_region"]  # the technique's strategies only
        problem = build_problem(gm, mesh, hw, TrainingSpec())
        d = next(d for d in problem.decisions.values() if d.node is region)
        for (st, _), steps, sec in zip(d.options, d.comm_steps, d.seconds):
            assert [s.collective for s, _ in steps if s.collective == "broadcast"] == \
                (["broadcast"] if st.technique else [])
            assert sec > 0  # its ops' compute
        groups = [AxisGroup("dp", None, 2, 0)]
        for chosen in sts:
            picks = {n.name: chosen if n is region else next(
                s for s in n.meta[autopar.STRATEGIES_KEY] if all(l.is_replicated for l in s.inputs + s.outputs))
                for n in gm.graph.nodes if autopar.STRATEGIES_KEY in n.meta}
            program = lower(gm, picks, mesh, groups, model)
            targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
            assert (_toy_kernel in targets) == (chosen.technique == "toy_region")
            assert any(isinstance(t, base.Region) for t in targets) == (chosen.technique is None)
    assert "toy_region" not in {t.name for t in base.techniques()}


def test_an_axis_of_size_one_offers_only_replicated_placements():
    # On an axis of size 1 a shard or a partial sum is the whole tensor: such strategies copy a
    # replicated one at equal modelled cost, and a 1-device pipeline stage once picked ring
    # attention and all-to-alls among them, which the runtime then ran on 1-rank groups. The
    # candidates on (dp=2, tp=1) must be exactly those on (dp=2) with tp replicated.
    from autopar.mesh import MeshSpec
    from autopar.models import GPTConfig, gpt
    from autopar.passes.annotate import STRATEGIES_KEY, annotate
    from autopar.trace import trace
    from torch.distributed.tensor import Replicate

    model, inputs = gpt(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16), batch_size=2)
    gm = trace(model, inputs, stack_traces=False)

    def candidates(mesh):
        annotate(gm, mesh)
        return {n.name: n.meta[STRATEGIES_KEY] for n in gm.graph.nodes if STRATEGIES_KEY in n.meta}

    flat = candidates(MeshSpec.parse("dp=2", 2))
    padded = candidates(MeshSpec.parse("dp=2,tp=1", 2))
    assert flat.keys() == padded.keys()
    for name, strategies in padded.items():
        assert all(isinstance(l.placements[1], Replicate) for s in strategies for l in s.inputs + s.outputs), name
        assert [[l.placements[:1] for l in s.inputs + s.outputs] for s in strategies] \
            == [[l.placements for l in s.inputs + s.outputs] for s in flat[name]], name
    single = candidates(MeshSpec.parse("dp=1", 1))
    assert all(len(s) == 1 for s in single.values()), [k for k, s in single.items() if len(s) > 1]


@pytest.mark.parametrize("family", ["dp", "zero2", "zero3", "megatron", "sp"])
def test_a_family_pinned_on_one_device_plans(family):
    # its axes have size 1 and offer only replicated layouts: the pin asks nothing of them
    # (Pin.on_mesh); a 1-rank job of the scheduler plans strategy="dp" on one device
    from autopar.models import GPTConfig, gpt

    model, inputs = gpt(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=32), batch_size=8)
    p = autopar.plan(model, 1, inputs, strategy=family, baselines=False)
    assert p.mesh.n_devices == 1 and p.step_seconds > 0
