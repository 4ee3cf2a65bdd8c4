"""Encoder-only BERT with a masked-language-model head (no pooler, no NSP head)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gpt import FeedForward, SelfAttention
from .mlp import build_on_device, init_transformer_weights, seeded_randint

__all__ = ["BertConfig", "BERT_CONFIGS", "Bert", "bert"]


@dataclass(frozen=True)
class BertConfig:
    """BERT shape; the FFN width is 4 * hidden as in the original models."""

    n_layer: int = 12
    hidden: int = 768
    n_head: int = 12
    vocab_size: int = 30522
    max_position: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12


BERT_CONFIGS: dict[str, BertConfig] = {
    "bert-tiny": BertConfig(n_layer=2, hidden=64, n_head=4, vocab_size=128, max_position=64),
    "bert-base": BertConfig(n_layer=12, hidden=768, n_head=12),
    "bert-large": BertConfig(n_layer=24, hidden=1024, n_head=16),
}


class BertLayer(nn.Module):
    """Post-LN encoder block: x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = config
        self.attn = SelfAttention(c.hidden, c.n_head, bias=True, dropout=c.dropout, causal=False)
        self.ln_attn = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.ffn = FeedForward(c.hidden, bias=True, dropout=c.dropout)
        self.ln_ffn = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln_attn(x + self.attn(x))
        return self.ln_ffn(x + self.ffn(x))


class Bert(nn.Module):
    """BERT for MLM; forward(input_ids, labels) returns the MLM loss.

    No padding mask: inputs are fixed-length, so attention is unmasked. Labels
    equal to -100 are ignored (F.cross_entropy's default ignore_index). The MLM
    decoder is NOT tied to the word embedding, for the same sharding reason as GPT.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden)
        self.position_embeddings = nn.Embedding(c.max_position, c.hidden)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden)
        self.ln_emb = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.n_layer))
        # MLM head: transform (dense + GELU + LN), then project to the vocabulary.
        self.mlm_dense = nn.Linear(c.hidden, c.hidden)
        self.mlm_ln = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.mlm_decoder = nn.Linear(c.hidden, c.vocab_size)
        self.apply(init_transformer_weights)

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """MLM logits (b, t, vocab), or the scalar loss if `labels`.

        token_type_ids defaults to all zeros (single-segment input).
        """
        t = input_ids.size(1)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        pos = torch.arange(t, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.drop(self.ln_emb(x))
        for layer in self.layers:
            x = layer(x)
        logits = self.mlm_decoder(self.mlm_ln(F.gelu(self.mlm_dense(x))))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def bert(
    config: BertConfig | str = "bert-tiny",
    *,
    batch_size: int = 2,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """Build a BERT and example `(input_ids, labels)` of shape (batch, seq_len).

    Every position carries a label (a dense MLM stand-in; the cost is the same).
    `seq_len` defaults to max_position and may not exceed it.
    """
    if isinstance(config, str):
        config = BERT_CONFIGS[config]
    config = replace(config, **overrides)
    seq_len = config.max_position if seq_len is None else seq_len
    if not 0 < seq_len <= config.max_position:
        raise ValueError(f"seq_len={seq_len} must be in [1, max_position={config.max_position}]")
    model = build_on_device(Bert, config, device, dtype)
    shape = (batch_size, seq_len)
    return model, (seeded_randint(config.vocab_size, shape, device), seeded_randint(config.vocab_size, shape, device))
