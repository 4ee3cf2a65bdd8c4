"""Tests for the model zoo (autopar.models).

Parameter counts are checked against closed-form formulas written here from each
config, independently of the model code, so a wrong layer shows up as a mismatch.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from autopar.models import (
    ZOO,
    BertConfig,
    GPTConfig,
    HFLossWrapper,
    MLPConfig,
    ModelEntry,
    UnknownModelError,
    ViTConfig,
    get_model,
    hf_bert,
    hf_gpt2,
    list_models,
)

TINY = ["mlp", "gpt-tiny", "bert-tiny", "vit-tiny"]
HF_TINY = ["hf-gpt2-tiny", "hf-bert-tiny"]
REQUIRED = {
    "mlp", "gpt-tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-175b",
    "bert-tiny", "bert-base", "bert-large", "vit-tiny", "vit-base", "vit-huge",
    "hf-gpt2-tiny", "hf-gpt2", "hf-bert-tiny",
}


def n_params(model: nn.Module) -> int:
    """Unique parameter count (tied weights counted once, as .parameters() does)."""
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------- closed-form counts


def _encoder_layer(d: int, ffn: int, bias: bool = True) -> int:
    """Attention (4 d x d Linears) + FFN (d->ffn->d) + two LayerNorms."""
    b = int(bias)
    attn = 4 * d * d + b * 4 * d
    mlp = 2 * d * ffn + b * (ffn + d)
    ln = 2 * (d + b * d)
    return attn + mlp + ln


def expected_params(model: nn.Module) -> int:
    """Parameter count predicted from the model's config alone."""
    if isinstance(model, HFLossWrapper):
        c = model.model.config
        if c.model_type == "gpt2":
            d, ffn = c.n_embd, c.n_inner or 4 * c.n_embd
            # wte (shared with lm_head) + wpe + blocks + ln_f
            return c.vocab_size * d + c.n_positions * d + c.n_layer * _encoder_layer(d, ffn) + 2 * d
        assert c.model_type == "bert"
        h, i = c.hidden_size, c.intermediate_size
        emb = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h
        # MLM transform (dense + LN) + decoder bias; decoder weight is tied to word emb.
        head = h * h + h + 2 * h + c.vocab_size
        return emb + c.num_hidden_layers * _encoder_layer(h, i) + head
    c = model.config
    if isinstance(c, MLPConfig):
        b = int(c.bias)
        first = c.in_features * c.hidden + b * c.hidden
        rest = (c.depth - 1) * (c.hidden * c.hidden + b * c.hidden)
        return first + rest + c.hidden * c.out_features + b * c.out_features
    if isinstance(c, GPTConfig):
        d = c.n_embd
        emb = c.vocab_size * d + c.block_size * d
        ln_f = d + int(c.bias) * d
        lm_head = c.vocab_size * d  # untied, no bias
        return emb + c.n_layer * _encoder_layer(d, 4 * d, c.bias) + ln_f + lm_head
    if isinstance(c, BertConfig):
        h = c.hidden
        emb = (c.vocab_size + c.max_position + c.type_vocab_size) * h + 2 * h
        head = (h * h + h) + 2 * h + (h * c.vocab_size + c.vocab_size)  # untied decoder
        return emb + c.n_layer * _encoder_layer(h, 4 * h) + head
    if isinstance(c, ViTConfig):
        h = c.hidden
        patch = c.channels * c.patch_size**2 * h + h
        tokens = h + c.seq_len * h  # class token + position embedding
        head = 2 * h + h * c.num_classes + c.num_classes  # final LN + classifier
        return patch + tokens + c.n_layer * _encoder_layer(h, 4 * h) + head
    raise AssertionError(f"no formula for {type(c)}")


# ----------------------------------------------------------------------- registry


def test_registry_contents() -> None:
    assert REQUIRED <= set(ZOO)
    assert list_models() == list(ZOO.values())
    for name, entry in ZOO.items():
        assert isinstance(entry, ModelEntry) and entry.name == name
        assert entry.description and entry.batch_size > 0


def test_unknown_name_suggests_closest() -> None:
    with pytest.raises(KeyError) as info:
        get_model("gpt2-larg")
    msg = str(info.value)
    assert "'gpt2-large'" in msg and "bert-base" in msg  # closest match + known names
    with pytest.raises(ValueError):
        get_model("no-such-model")
    assert issubclass(UnknownModelError, KeyError) and issubclass(UnknownModelError, ValueError)


def test_seq_len_validation() -> None:
    with pytest.raises(ValueError):
        get_model("gpt-tiny", seq_len=65, device="meta")  # > block_size
    with pytest.raises(ValueError):
        get_model("vit-tiny", seq_len=10, device="meta")  # ViT token count is fixed
    _, (x, _) = get_model("vit-tiny", seq_len=ZOO["vit-tiny"].seq_len, device="meta")
    assert x.shape == (2, 3, 32, 32)


# ------------------------------------------------------------------- meta builds


@pytest.mark.parametrize("name", sorted(ZOO))
def test_meta_build_and_param_count(name: str) -> None:
    model, inputs = get_model(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    assert all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in inputs)
    entry = ZOO[name]
    assert inputs[0].shape[0] == entry.batch_size
    assert n_params(model) == expected_params(model)


def test_meta_dtype() -> None:
    model, (x, y) = get_model("vit-base", device="meta", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert x.dtype == torch.bfloat16 and y.dtype == torch.long


def test_known_sizes() -> None:
    """Sanity anchors: untied GPT-2 small is ~163M, HF (tied) GPT-2 is ~124M."""
    assert round(n_params(get_model("gpt2", device="meta")[0]) / 1e6) == 163
    assert round(n_params(get_model("hf-gpt2", device="meta")[0]) / 1e6) == 124


# --------------------------------------------------------------- CPU numerics


@pytest.mark.parametrize("name", TINY + HF_TINY)
def test_tiny_forward_backward(name: str) -> None:
    model, inputs = get_model(name)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # Without targets the model returns logits instead of a loss.
    assert model(inputs[0]).dim() >= 2


def test_example_inputs_are_reproducible() -> None:
    _, a = get_model("gpt-tiny")
    _, b = get_model("gpt-tiny")
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_hf_factories_accept_user_config() -> None:
    model, (ids, labels) = hf_gpt2(
        n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16, batch_size=3
    )
    assert ids.shape == (3, 16) and torch.isfinite(model(ids, labels))
    model, (ids, labels) = hf_bert(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=64, max_position_embeddings=16, seq_len=8,
    )
    assert ids.shape == (2, 8) and torch.isfinite(model(ids, labels))


# ------------------------------------------------------------------------- export


def _export(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    ep = torch.export.export(model, inputs, strict=False)
    (out,) = ep.graph.output_node().args[0]
    assert out.meta["val"].shape == ()  # the graph ends at the scalar loss
    return ep


@pytest.mark.parametrize("name", TINY + HF_TINY)
def test_export_tiny(name: str) -> None:
    model, inputs = get_model(name)
    ep = _export(model, inputs)
    torch.testing.assert_close(ep.module()(*inputs), model(*inputs))
    if name in TINY:  # our own models: no in-place ops anywhere in the graph
        ops = [str(n.target).split(".") for n in ep.graph.nodes if n.op == "call_function"]
        inplace = [".".join(op) for op in ops if len(op) > 1 and op[1].endswith("_")]
        assert not inplace, inplace


def test_export_gpt3_175b_on_meta() -> None:
    model, inputs = get_model("gpt3-175b", device="meta")
    assert abs(n_params(model) - 175e9) / 175e9 < 0.03
    start = time.perf_counter()
    ep = _export(model, inputs)
    assert time.perf_counter() - start < 45  # ~7 s on a 2-core CPU
    n_sdpa = sum("scaled_dot_product_attention" in str(n.target) for n in ep.graph.nodes)
    assert n_sdpa == model.config.n_layer
