"""Hugging Face GPT-2 and BERT models built from configs (no weights are downloaded).

HF models return a ModelOutput, not a tensor, so they are wrapped in
`HFLossWrapper`, whose forward(input_ids, labels) returns `out.loss`. That way a
traced graph ends at the scalar loss, exactly like the zoo's own models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .mlp import seeded_randint

__all__ = ["HFLossWrapper", "hf_gpt2", "hf_bert", "HF_GPT2_TINY", "HF_BERT_TINY"]

# Config kwargs for the tiny presets (mirror gpt-tiny / bert-tiny).
HF_GPT2_TINY: dict[str, Any] = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64)
HF_BERT_TINY: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=256,
    vocab_size=128,
    max_position_embeddings=64,
)


class HFLossWrapper(nn.Module):
    """Wraps a HF `*ForCausalLM`/`*ForMaskedLM` so forward returns a tensor.

    forward(input_ids, labels) -> scalar `out.loss`; forward(input_ids) -> logits.
    The HF model is kept as `self.model` (its config is `self.model.config`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        out = self.model(input_ids=input_ids, labels=labels)
        return out.logits if labels is None else out.loss


def _finish(
    model: nn.Module,
    vocab_size: int,
    max_len: int,
    batch_size: int,
    seq_len: int | None,
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """Cast, wrap and attach `(input_ids, labels)` example inputs."""
    seq_len = max_len if seq_len is None else seq_len
    if not 0 < seq_len <= max_len:
        raise ValueError(f"seq_len={seq_len} must be in [1, {max_len}]")
    if dtype is not None:
        model = model.to(dtype=dtype)
    # HF constructors leave the model in train mode, like ours; keep it explicit.
    wrapped = HFLossWrapper(model).train()
    shape = (batch_size, seq_len)
    return wrapped, (seeded_randint(vocab_size, shape, device), seeded_randint(vocab_size, shape, device))


def hf_gpt2(
    *,
    batch_size: int = 2,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **config_kwargs: Any,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """HF GPT2LMHeadModel from `GPT2Config(**config_kwargs)`, wrapped in HFLossWrapper.

    Defaults differ from GPT2Config's only where tracing needs it: use_cache=False
    (no KV-cache outputs), SDPA attention, dropout 0 (deterministic, like our GPT),
    and bos/eos ids clamped into small vocabularies. HF's lm_head/wte tying is
    left at the HF default (tied). `seq_len` defaults to n_positions.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    kw: dict[str, Any] = dict(
        use_cache=False, attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    kw.update(config_kwargs)
    vocab = kw.get("vocab_size", 50257)
    kw.setdefault("bos_token_id", min(50256, vocab - 1))
    kw.setdefault("eos_token_id", min(50256, vocab - 1))
    config = GPT2Config(**kw)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    # HF infers the loss from the class name; "GPT2LMHeadModel" matches none, so it
    # warns and falls back to ForCausalLM. Set it to get the same loss, silently.
    model.loss_type = "ForCausalLM"
    return _finish(model, config.vocab_size, config.n_positions, batch_size, seq_len, device, dtype)


def hf_bert(
    *,
    batch_size: int = 2,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **config_kwargs: Any,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """HF BertForMaskedLM from `BertConfig(**config_kwargs)`, wrapped in HFLossWrapper.

    Defaults: SDPA attention and dropout 0; otherwise BertConfig's (bert-base).
    `seq_len` defaults to max_position_embeddings.
    """
    from transformers import BertConfig, BertForMaskedLM

    kw: dict[str, Any] = dict(
        attn_implementation="sdpa", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    kw.update(config_kwargs)
    config = BertConfig(**kw)
    with torch.device(device):
        model = BertForMaskedLM(config)
    return _finish(
        model, config.vocab_size, config.max_position_embeddings, batch_size, seq_len, device, dtype
    )
