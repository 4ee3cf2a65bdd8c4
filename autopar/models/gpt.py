"""Decoder-only GPT (nanoGPT-like), plus the attention/FFN blocks BERT and ViT reuse."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .mlp import build_on_device, init_transformer_weights, seeded_randint

__all__ = ["GPTConfig", "GPT_CONFIGS", "GPT", "SelfAttention", "FeedForward", "gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """GPT shape. vocab 50304 is GPT-2's 50257 padded to a multiple of 64."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50304
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True


GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=128, block_size=64),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "gpt3-6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048),  # GPT-3 paper, table 2.1
    "gpt3-13b": GPTConfig(n_layer=40, n_head=40, n_embd=5120, block_size=2048),  # the paper lists 5140; 40 x 128
    "gpt3-175b": GPTConfig(n_layer=96, n_head=96, n_embd=12288, block_size=2048),
}


class SelfAttention(nn.Module):
    """Multi-head self-attention via F.scaled_dot_product_attention.

    Q, K and V are separate Linears (not one fused 3*d Linear) so that column-
    sharding by heads is a plain split of each weight, with no interleaving.
    """

    def __init__(
        self, n_embd: int, n_head: int, *, bias: bool, dropout: float, causal: bool
    ) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        self.causal = causal
        self.attn_dropout = dropout
        self.q_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.k_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.v_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def _heads(self, x: Tensor, b: int, t: int) -> Tensor:
        """(b, t, d) -> (b, n_head, t, head_dim)."""
        return x.view(b, t, self.n_head, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q = self._heads(self.q_proj(x), b, t)
        k = self._heads(self.k_proj(x), b, t)
        v = self._heads(self.v_proj(x), b, t)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.causal,
        )
        y = y.transpose(1, 2).reshape(b, t, d)
        return self.resid_dropout(self.out_proj(y))


class FeedForward(nn.Module):
    """Linear(d, 4d) -> GELU -> Linear(4d, d) -> dropout."""

    def __init__(self, n_embd: int, *, bias: bool, dropout: float, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * n_embd
        self.fc_in = nn.Linear(n_embd, hidden, bias=bias)
        self.fc_out = nn.Linear(hidden, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class GPTBlock(nn.Module):
    """Pre-LN transformer block with causal attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.ln_1 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.attn = SelfAttention(c.n_embd, c.n_head, bias=c.bias, dropout=c.dropout, causal=True)
        self.ln_2 = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.mlp = FeedForward(c.n_embd, bias=c.bias, dropout=c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT language model; forward(idx, targets) returns the next-token loss.

    lm_head is NOT tied to the token embedding (GPT-2 ties them): a shared weight
    used at both ends of the graph complicates sharding, and untied costs only
    vocab_size * n_embd extra parameters.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(GPTBlock(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.apply(init_transformer_weights)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits (b, t, vocab), or the scalar cross-entropy loss if `targets`."""
        t = idx.size(1)
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def gpt(
    config: GPTConfig | str = "gpt-tiny",
    *,
    batch_size: int = 2,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """Build a GPT and example `(idx, targets)` token inputs of shape (batch, seq_len).

    `config` is a GPTConfig or a key of GPT_CONFIGS; `overrides` replace its fields.
    `seq_len` defaults to block_size and may not exceed it.
    """
    if isinstance(config, str):
        config = GPT_CONFIGS[config]
    config = replace(config, **overrides)
    seq_len = config.block_size if seq_len is None else seq_len
    if not 0 < seq_len <= config.block_size:
        raise ValueError(f"seq_len={seq_len} must be in [1, block_size={config.block_size}]")
    model = build_on_device(GPT, config, device, dtype)
    shape = (batch_size, seq_len)
    return model, (seeded_randint(config.vocab_size, shape, device), seeded_randint(config.vocab_size, shape, device))
