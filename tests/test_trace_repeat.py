"""autopar.trace_repeat: a model with alike blocks traced with three of them and rebuilt at full
depth gives the graph the full trace gives, node for node; anything else traces in full."""

import pytest
import torch
import torch.fx as fx
import transformers
from torch import nn

from autopar.models import get_model
from autopar.trace import graph_fingerprint, trace
from autopar.trace_repeat import alike_blocks, trace_repeated


def _nodes(gm: fx.GraphModule) -> list[tuple]:
    """Each node whole: op, name, target, arguments (nodes by name), module stack, shape."""
    def named(a):
        return ("node", a.name) if isinstance(a, fx.Node) else a
    out = []
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack")
        val = n.meta.get("val")
        out.append((n.op, n.name, str(n.target), str(fx.node.map_aggregate(n.args, named)),
                    str(fx.node.map_aggregate(n.kwargs, named)),
                    tuple(path for path, _ in stack.values()) if stack else None,
                    (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None))
    return out


def _same_graph(model, args, kwargs=None, *, repeated: bool):
    full = trace(model, args, kwargs, stack_traces=False)
    fast = trace(model, args, kwargs, stack_traces=False, repeat_blocks=True)
    assert (alike_blocks(model) is not None) == repeated
    assert _nodes(fast) == _nodes(full)
    assert graph_fingerprint(fast) == graph_fingerprint(full)
    full_params, fast_params = dict(full.named_parameters()), dict(fast.named_parameters())
    assert full_params.keys() == fast_params.keys()
    for name, p in fast_params.items():  # the model's own weights, every block's
        assert p.shape == full_params[name].shape
    return fast


@pytest.mark.parametrize("name", ["gpt2", "bert-base", "vit-base", "hf-gpt2"])
def test_a_zoo_model_traced_with_three_blocks_is_the_full_trace(name):
    model, inputs = get_model(name, device="meta")
    blocks = alike_blocks(model)[3]
    fast = _same_graph(model, inputs, repeated=True)
    assert alike_blocks(model)[3] is blocks and len(blocks) >= 12  # the model's list is put back
    # the weights of blocks past the third are the model's own
    last = len(blocks) - 1
    ours = dict(fast.named_parameters())
    for name_, p in blocks[last].named_parameters():
        key = next(k for k in ours if k.endswith(f".{last}.{name_}"))
        assert ours[key] is p


def _llama(layers: int, **extra):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False, **extra)
    return transformers.LlamaForCausalLM(cfg)


def test_hugging_face_llama_and_mixtral_built_from_configs_rebuild_exactly():
    ids = torch.randint(0, 96, (2, 16))
    _same_graph(_llama(6), (), dict(input_ids=ids, labels=ids), repeated=True)
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     use_cache=False)
    _same_graph(transformers.MixtralForCausalLM(cfg), (), dict(input_ids=ids, labels=ids), repeated=True)


def test_blocks_that_differ_by_layer_trace_in_full():
    # Qwen2 with sliding-window attention from layer 3 on: the layers' attention types differ
    ids = torch.randint(0, 96, (2, 16))
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=3, use_cache=False)
    _same_graph(transformers.Qwen2ForCausalLM(cfg), (), dict(input_ids=ids, labels=ids), repeated=False)


class _Stack(nn.Module):
    """Six alike blocks; ``between`` runs an op outside the blocks after each one, ``penultimate``
    makes the head read the next-to-last block too: neither graph repeats by blocks."""

    def __init__(self, between=False, penultimate=False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(6))
        self.head = nn.Linear(8, 2)
        self.between, self.penultimate = between, penultimate

    def forward(self, x):
        outs = []
        for b in self.blocks:
            x = b(x)
            outs.append(x)
            if self.between:
                x = x * 0.5
        if self.penultimate:
            x = x + outs[-2]
        return self.head(x).sum()


@pytest.mark.parametrize("kind", ["plain", "between", "penultimate"])
def test_graphs_that_do_not_repeat_by_block_trace_in_full(kind):
    model = _Stack(between=kind == "between", penultimate=kind == "penultimate")
    x = torch.randn(4, 8)
    calls = []
    got = trace_repeated(model, lambda m: calls.append(1) or trace(m, (x,), stack_traces=False))
    assert calls == [1] and (got is not None) == (kind == "plain")  # three blocks traced each time
    fast = _same_graph(model, (x,), repeated=True)
    assert len(model.blocks) == 6 and torch.allclose(fast(x), model(x))


def test_a_forward_that_fails_with_three_blocks_traces_in_full():
    class Counted(_Stack):
        def forward(self, x):
            assert len(self.blocks) == 6, "six blocks expected"
            return super().forward(x)

    model = Counted()
    x = torch.randn(4, 8)
    assert trace_repeated(model, lambda m: trace(m, (x,), stack_traces=False)) is None
    assert len(model.blocks) == 6
    _same_graph(model, (x,), repeated=True)


def test_blocks_that_read_their_own_entry_of_a_per_block_table_trace_in_full():
    # alike blocks (their index aside) that look up a per-block setting at run time: the copies
    # of block 1 would carry block 1's entry, so a list of unequal per-block entries on the
    # model, a block or its config sends the model to the full trace
    class Scaled(nn.Module):
        def __init__(self, table, layer_idx):
            super().__init__()
            self.lin, self.table, self.layer_idx = nn.Linear(8, 8), table, layer_idx

        def forward(self, x):
            return self.lin(x) * self.table[self.layer_idx]

    class Model(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.table = table
            self.blocks = nn.ModuleList(Scaled(table, i) for i in range(6))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    x = torch.randn(2, 8)
    fast = _same_graph(Model([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), (x,), repeated=False)
    assert fast is not None
    _same_graph(Model([2.0] * 6), (x,), repeated=True)  # one setting for all: repeated, and exact


def test_blocks_whose_own_settings_differ_trace_in_full():
    # each block keeps its own scale (no shared table): the copies of block 1 would carry its
    # scale, so blocks whose settings differ (their index aside) are not alike
    class Scaled(nn.Module):
        def __init__(self, scale, layer_idx):
            super().__init__()
            self.lin, self.scale, self.layer_idx = nn.Linear(8, 8), scale, layer_idx

        def forward(self, x):
            return self.lin(x) * self.scale

    class Model(nn.Module):
        def __init__(self, scales):
            super().__init__()
            self.blocks = nn.ModuleList(Scaled(s, i) for i, s in enumerate(scales))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    x = torch.randn(2, 8)
    _same_graph(Model([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), (x,), repeated=False)
    _same_graph(Model([2.0] * 6), (x,), repeated=True)  # their index aside, alike: repeated, and exact
