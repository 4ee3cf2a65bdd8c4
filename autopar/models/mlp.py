"""A plain multi-layer perceptron, plus the small helpers every zoo factory shares.

The helpers live here (rather than in a private module) because the zoo keeps one
file per model family and the MLP is the base of the family tree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MLPConfig", "MLP", "mlp"]

# Seed for example inputs on real devices, so two calls give identical tensors.
_INPUT_SEED = 0


# --------------------------------------------------------------------------- helpers


def _generator() -> torch.Generator:
    """A fresh CPU generator with the fixed example-input seed."""
    return torch.Generator(device="cpu").manual_seed(_INPUT_SEED)


def seeded_randint(high: int, shape: tuple[int, ...], device: torch.device | str) -> Tensor:
    """Random int64 tensor in [0, high) on `device`.

    On meta no data exists, so we skip the generator (randint works on meta and
    allocates nothing). On real devices we draw on CPU with a seeded generator and
    copy, so inputs are reproducible regardless of device RNG state.
    """
    if torch.device(device).type == "meta":
        return torch.randint(0, high, shape, device="meta")
    return torch.randint(0, high, shape, generator=_generator()).to(device)


def seeded_randn(
    shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype | None = None
) -> Tensor:
    """Random standard-normal float tensor on `device` (see `seeded_randint` for why)."""
    dtype = dtype or torch.float32
    if torch.device(device).type == "meta":
        return torch.randn(shape, device="meta", dtype=dtype)
    return torch.randn(shape, generator=_generator()).to(device=device, dtype=dtype)


def build_on_device(
    cls: type[nn.Module], config: Any, device: torch.device | str, dtype: torch.dtype | None
) -> nn.Module:
    """Instantiate `cls(config)` directly on `device` (meta allocates no storage)."""
    with torch.device(device):
        model = cls(config)
    if dtype is not None:
        # Cast after construction: default-dtype tricks are global state and only
        # accept some float types. On meta the cast is free.
        model = model.to(dtype=dtype)
    return model


def init_transformer_weights(module: nn.Module) -> None:
    """GPT-2/BERT style init: N(0, 0.02) weights, zero biases. Skipped on meta, where there
    are no values to set (and torch's meta normal_ costs ~20 ms a call, 1.8 s for GPT-2)."""
    weight = getattr(module, "weight", None)
    if weight is not None and weight.is_meta:
        return
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


# ------------------------------------------------------------------------------ MLP


@dataclass(frozen=True)
class MLPConfig:
    """MLP shape: `depth` hidden Linear+GELU layers, then one output Linear."""

    in_features: int = 64
    hidden: int = 256
    out_features: int = 10
    depth: int = 3
    bias: bool = True


class MLP(nn.Module):
    """Classifier MLP; forward(x, target) returns the cross-entropy loss."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        if config.depth < 1:
            raise ValueError(f"MLP depth must be >= 1, got {config.depth}")
        self.config = config
        widths = [config.in_features] + [config.hidden] * config.depth
        self.hidden = nn.ModuleList(
            nn.Linear(a, b, bias=config.bias) for a, b in zip(widths[:-1], widths[1:])
        )
        self.out = nn.Linear(config.hidden, config.out_features, bias=config.bias)

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor:
        """Logits of shape (*x.shape[:-1], out_features), or the scalar loss if `target`."""
        for layer in self.hidden:
            x = F.gelu(layer(x))
        logits = self.out(x)
        if target is None:
            return logits
        # Flatten leading dims so (B, C) and (B, S, C) inputs share one code path.
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def mlp(
    config: MLPConfig | None = None,
    *,
    batch_size: int = 32,
    seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """Build an MLP and example `(x, target)` inputs.

    `seq_len=None` gives x of shape (batch, in_features); an int gives
    (batch, seq_len, in_features), i.e. a token-wise MLP. `overrides` replace
    MLPConfig fields.
    """
    config = replace(config or MLPConfig(), **overrides)
    model = build_on_device(MLP, config, device, dtype)
    lead = (batch_size,) if seq_len is None else (batch_size, seq_len)
    x = seeded_randn((*lead, config.in_features), device, dtype)
    target = seeded_randint(config.out_features, lead, device)
    return model, (x, target)
