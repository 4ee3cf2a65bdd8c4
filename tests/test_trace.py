"""autopar.trace and autopar.annotate on the zoo and Hugging Face models, and their errors."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar import FALLBACK_KEY, STRATEGIES_KEY, MeshSpec, TraceError, UnknownOpWarning
from autopar.models import ZOO, get_model

MESH = MeshSpec.parse("dp=2,tp=2,cp=2")


def _check_annotated(gm):
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "call_function"):
            val = node.meta.get("val")
            assert val is not None, f"{node.name} has no shape"
            if isinstance(val, torch.Tensor):
                assert node.meta[STRATEGIES_KEY], f"{node.name} has no strategy"
        assert not node.meta.get(FALLBACK_KEY), f"{node.name} ({node.target}) fell back to replicated"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_traces_and_annotates_without_fallback(name):
    model, inputs = get_model(name, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOpWarning)
        gm = autopar.annotate(autopar.trace(model, inputs), MESH)
    _check_annotated(gm)
    assert gm.graph.find_nodes(op="output")


def test_traced_graph_computes_what_the_model_computes():
    model, inputs = get_model("gpt-tiny", batch_size=2, seq_len=16)
    gm = autopar.trace(model, inputs)
    torch.testing.assert_close(gm(*inputs), model(*inputs))


def test_hf_models_from_configs_trace_and_annotate():
    from transformers import BertConfig, GPT2Config

    from autopar.models import hf_bert, hf_gpt2

    for factory, cfg in ((hf_gpt2, GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)),
                         (hf_bert, BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                              intermediate_size=128, vocab_size=128, max_position_embeddings=32))):
        model, inputs = factory(config=cfg, batch_size=2, seq_len=16)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnknownOpWarning)
            gm = autopar.annotate(autopar.trace(model, inputs), MESH)
        _check_annotated(gm)
        torch.testing.assert_close(gm(*inputs), model(*inputs))


@pytest.mark.slow
def test_gpt3_175b_traces_on_meta_fast_and_small():
    # A fresh process, so the peak RSS is this trace's alone.
    code = textwrap.dedent("""
        import json, resource, time
        import autopar
        from autopar.models import get_model
        t = time.perf_counter()
        model, inputs = get_model("gpt3-175b", device="meta")
        gm = autopar.annotate(autopar.trace(model, inputs), autopar.MeshSpec.parse("dp=8,tp=8"))
        seconds = time.perf_counter() - t
        params = sum(p.numel() for p in model.parameters())
        fallback = sum(1 for n in gm.graph.nodes if n.meta.get(autopar.FALLBACK_KEY))
        print(json.dumps(dict(seconds=seconds, rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                              params=params, nodes=len(gm.graph.nodes), fallback=fallback)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["seconds"] < 60, result
    assert result["rss_kib"] * 1024 < 4 * 2**30, result
    assert abs(result["params"] - 175e9) / 175e9 < 0.03 and result["fallback"] == 0


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:  # the failing line the error must name
            return y * 2
        return y


@pytest.mark.parametrize("stack_traces", [True, False])  # False: the planner's fast path
def test_data_dependent_control_flow_names_the_line_and_the_fix(stack_traces):
    with pytest.raises(TraceError) as info:
        autopar.trace(DataDependent(), (torch.randn(2, 4),), stack_traces=stack_traces)
    message = str(info.value)
    assert "DataDependent" in message and "depends on tensor values" in message
    assert "test_trace.py" in message and "if y.sum() > 0:" in message
    assert "torch.where" in message and "torch.cond" in message


torch.library.define("autopar_test::no_fake", "(Tensor x) -> Tensor")
torch.library.impl("autopar_test::no_fake", "cpu")(lambda x: x * 2)
torch.library.define("autopar_test::no_rule", "(Tensor x) -> Tensor")
torch.library.impl("autopar_test::no_rule", "cpu")(lambda x: x * 3)
torch.library.register_fake("autopar_test::no_rule")(lambda x: torch.empty_like(x))


class UsesCustomOp(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.op(self.op(self.proj(x))).sum()


def test_custom_op_without_fake_kernel_names_op_and_fix():
    with pytest.raises(TraceError) as info:
        autopar.trace(UsesCustomOp(torch.ops.autopar_test.no_fake), (torch.randn(4, 8),))
    message = str(info.value)
    assert "autopar_test::no_fake" in message and "register_fake" in message


def test_op_without_rule_runs_replicated_with_one_warning_naming_it():
    gm = autopar.trace(UsesCustomOp(torch.ops.autopar_test.no_rule), (torch.randn(4, 8),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autopar.annotate(gm, MESH)
    ours = [w for w in caught if issubclass(w.category, UnknownOpWarning)]
    assert len(ours) == 1 and "autopar_test.no_rule.default (2 nodes)" in str(ours[0].message)
    fallback = [n for n in gm.graph.nodes if n.meta.get(FALLBACK_KEY)]
    assert len(fallback) == 2
    for node in fallback:
        (strategy,) = node.meta[STRATEGIES_KEY]
        assert all(layout.is_replicated for layout in strategy.inputs + strategy.outputs)
    # The ops around it keep their sharding options.
    linear = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    assert len(linear.meta[STRATEGIES_KEY]) > 1


def test_trace_rejects_non_modules():
    with pytest.raises(TraceError, match="expects an nn.Module"):
        autopar.trace(lambda x: x, (torch.randn(2),))
