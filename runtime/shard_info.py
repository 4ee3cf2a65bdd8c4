"""What one rank holds of each parameter and buffer: the interface optimizers and checkpoints read.

A parallelized model keeps, per parameter, a local piece cut from the whole tensor by the
plan's layout (a dim cut by several mesh axes is cut outer axis first, ``torch.chunk``
semantics, as DTensor's ``Shard``), and under ZeRO-2 that piece is further flattened, padded and
split over the zero axes. ``ShardInfo`` states exactly that, so code that needs whole-tensor
quantities (a LAMB/LARS trust ratio, a checkpoint writer) reduces or reshards over exactly the
axes a tensor is split on, never guessing from shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ShardInfo", "SHARD_ATTR", "tag_parameters", "shard_info_of"]

# The attribute a parallelized model sets on each local Parameter: its ShardInfo. Optimizers
# built from ``model.parameters()`` alone (LAMB, LARS: whole-tensor norms) read it from there.
SHARD_ATTR = "autopar_shard"


@dataclass(frozen=True)
class ShardInfo:
    """One parameter or buffer as this rank holds it."""

    name: str                               # its name in the model (``model.named_parameters()``)
    tensor: torch.Tensor                    # this rank's local piece: the Parameter the optimizer sees
    is_param: bool
    global_shape: tuple[int, ...]           # the whole tensor's shape
    dim_axes: tuple[tuple[int, int], ...]   # (mesh axis, tensor dim) pairs that cut it, outer axis first
    zero2_axes: tuple[int, ...] = ()        # mesh axes splitting the cut piece as flat padded ZeRO-2 pieces
    tied_to: str | None = None              # another name holding the same tensor (tied weights), if any
    groups: tuple = ()                      # the process group of each of ``split_axes``, same order

    @property
    def split_axes(self) -> tuple[int, ...]:
        """Every mesh axis this rank's piece is split over (sum a per-piece quantity over these)."""
        return tuple(sorted({a for a, _ in self.dim_axes} | set(self.zero2_axes)))


def tag_parameters(infos: list[ShardInfo]) -> None:
    """Set ``SHARD_ATTR`` on each local Parameter (the first name of tied weights)."""
    for info in infos:
        if info.is_param and info.tied_to is None:
            setattr(info.tensor, SHARD_ATTR, info)


def shard_info_of(param: torch.Tensor) -> ShardInfo | None:
    """The ShardInfo a parallelized model set on ``param``; None for a tensor no plan cut."""
    return getattr(param, SHARD_ATTR, None)
