"""Small real inputs for the ground-truth validation of rules.

Dims that a rule may shard are multiples of 8, so every strategy on a 2x2x2 mesh divides.
float64 keeps the comparison with the unsharded op tight.
"""

from __future__ import annotations

import torch

_GEN = torch.Generator().manual_seed(0)


def rand(*shape: int, dtype: torch.dtype = torch.float64, positive: bool = False) -> torch.Tensor:
    t = torch.randn(*shape, generator=_GEN, dtype=dtype)
    return t.abs() + 0.5 if positive else t


def randint(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_GEN)


def call(*args, **kwargs):
    """One sample: the op's positional and keyword arguments."""
    return (args, kwargs)
