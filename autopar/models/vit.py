"""Vision Transformer (ViT) classifier: patch conv, class token, pre-LN blocks."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .gpt import FeedForward, SelfAttention
from .mlp import build_on_device, init_transformer_weights, seeded_randint, seeded_randn

__all__ = ["ViTConfig", "VIT_CONFIGS", "ViT", "vit"]


@dataclass(frozen=True)
class ViTConfig:
    """ViT shape; the FFN width is 4 * hidden (3072 for base, 5120 for huge)."""

    image_size: int = 224
    patch_size: int = 16
    n_layer: int = 12
    hidden: int = 768
    n_head: int = 12
    num_classes: int = 1000
    channels: int = 3
    dropout: float = 0.0
    layer_norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: one per patch plus the class token."""
        return self.num_patches + 1


VIT_CONFIGS: dict[str, ViTConfig] = {
    "vit-tiny": ViTConfig(image_size=32, patch_size=8, n_layer=2, hidden=64, n_head=4, num_classes=10),
    "vit-base": ViTConfig(image_size=224, patch_size=16, n_layer=12, hidden=768, n_head=12),
    "vit-huge": ViTConfig(image_size=224, patch_size=14, n_layer=32, hidden=1280, n_head=16),
}


class ViTBlock(nn.Module):
    """Pre-LN encoder block with non-causal attention."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = config
        self.ln_1 = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.attn = SelfAttention(c.hidden, c.n_head, bias=True, dropout=c.dropout, causal=False)
        self.ln_2 = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.mlp = FeedForward(c.hidden, bias=True, dropout=c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """ViT classifier; forward(pixel_values, labels) returns the classification loss."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        if config.image_size % config.patch_size != 0:
            raise ValueError(
                f"image_size={config.image_size} is not divisible by patch_size={config.patch_size}"
            )
        self.config = config
        c = config
        self.patch_embed = nn.Conv2d(c.channels, c.hidden, kernel_size=c.patch_size, stride=c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden))
        self.pos_embed = nn.Parameter(torch.zeros(1, c.seq_len, c.hidden))
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(ViTBlock(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.head = nn.Linear(c.hidden, c.num_classes)
        self.apply(init_transformer_weights)
        if not self.pos_embed.is_meta:  # nothing to set on meta
            nn.init.normal_(self.pos_embed, std=0.02)
            nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, pixel_values: Tensor, labels: Tensor | None = None) -> Tensor:
        """Class logits (b, num_classes), or the scalar loss if `labels`."""
        b = pixel_values.size(0)
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (b, patches, d)
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1)
        x = self.drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)[:, 0])
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


def vit(
    config: ViTConfig | str = "vit-tiny",
    *,
    batch_size: int = 2,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> tuple[nn.Module, tuple[Tensor, Tensor]]:
    """Build a ViT and example `(pixel_values, labels)` inputs.

    The token count is fixed by image_size and patch_size, so `seq_len` is only
    checked: None or config.seq_len (patches + 1) is accepted, anything else raises
    ValueError (change image_size/patch_size via `overrides` instead). pixel_values
    has shape (batch, channels, image_size, image_size) and the model's dtype.
    """
    if isinstance(config, str):
        config = VIT_CONFIGS[config]
    config = replace(config, **overrides)
    if seq_len is not None and seq_len != config.seq_len:
        raise ValueError(
            f"ViT seq_len is fixed at {config.seq_len} (= (image_size/patch_size)^2 + 1); "
            f"got seq_len={seq_len}; pass image_size/patch_size overrides instead"
        )
    model = build_on_device(ViT, config, device, dtype)
    pixels = seeded_randn((batch_size, config.channels, config.image_size, config.image_size), device, dtype)
    return model, (pixels, seeded_randint(config.num_classes, (batch_size,), device))
