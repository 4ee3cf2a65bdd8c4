"""A parallelized model's shards as DTensors: the layout torch.distributed.checkpoint reads and writes.

Each local piece ``ParallelModule.shards()`` reports is cut from the whole tensor by ``torch.chunk``
along the dims of ``dim_axes``, a dim cut by several mesh axes outer axis first: exactly a DTensor
whose placements are ``Shard(dim)`` on those axes and ``Replicate()`` on the others (DTensor's
default shard order is also left to right). So ``DTensor.from_local`` with the global shape
describes the piece without moving a byte, and DCP can save it and reshard it on load into any
other plan, mesh or world size (each rank reads only the chunks that overlap its own piece).

ZeRO-2 pieces are not a DTensor layout: the cut piece is flattened, padded and split over the zero
axes. They are unflattened with one all-gather over the zero axes (``collectives.zero2_unshard``),
so the saved tensor is the plain cut piece, replicated over the zero axes (DCP's save planner
writes each replicated chunk once). A flat 1-D DTensor view would avoid the gather, but its
checkpoint key would have another shape than the same parameter under any other plan, and
resharding between plans is the point. The gather costs one buffer of the cut piece at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import collectives as C
from .shard_info import ShardInfo

__all__ = ["ShardView", "shard_views", "piece_shape", "to_dtensor", "to_local_piece", "empty_dtensor"]


@dataclass(frozen=True)
class ShardView:
    """One parameter or buffer of a parallelized model (or of one pipeline stage) as a DTensor layout."""

    info: ShardInfo
    mesh: object                      # the DeviceMesh the piece's placements refer to
    placements: tuple                 # one Shard/Replicate per mesh axis
    zero_groups: tuple = ()           # AxisGroups of the ZeRO-2 axes, outer axis first

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def cut_shape(self) -> tuple[int, ...]:
        """Shape of this rank's cut piece (before any ZeRO-2 flattening)."""
        return piece_shape(self.info.global_shape, self.info.dim_axes, self.mesh.get_coordinate(), self.mesh.shape)


def piece_shape(global_shape: Sequence[int], dim_axes, coords: Sequence[int], sizes: Sequence[int]) -> tuple[int, ...]:
    """Shape of the piece at ``coords`` when ``dim_axes`` cut ``global_shape`` (torch.chunk, outer axis first)."""
    shape = list(global_shape)
    for axis, dim in dim_axes:
        step = math.ceil(shape[dim] / sizes[axis]) if shape[dim] else 0
        shape[dim] = max(0, min(step, shape[dim] - coords[axis] * step))
    return tuple(shape)


def _modules(model: nn.Module) -> list[nn.Module]:
    """The ParallelModules of ``model``: itself, or a pipeline's stages on this rank."""
    stages = getattr(model, "stages", None)
    return list(stages) if stages is not None else [model]


def shard_views(model: nn.Module) -> list[ShardView]:
    """Every parameter and buffer this rank holds (tied names once: the first name), with its
    DTensor placements. Works for a ParallelModule and for a pipeline's stages."""
    out = []
    for module in _modules(model):
        if not hasattr(module, "shards"):
            raise TypeError(f"{type(module).__name__} is not a parallelized model: pass the module "
                            f"autopar.runtime.parallel_module.parallelize returned")
        mesh = module.device_mesh
        for info in module.shards():
            if info.tied_to is not None:
                continue
            placements = [Replicate()] * mesh.ndim
            for axis, dim in info.dim_axes:
                placements[axis] = Shard(dim)
            zero = tuple(C.AxisGroup(str(a), g, dist.get_world_size(g), dist.get_rank(g))
                         for a, g in ((a, module.axis_group(a)) for a in info.zero2_axes))
            out.append(ShardView(info, mesh, tuple(placements), zero))
    return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def to_dtensor(view: ShardView, local: torch.Tensor) -> DTensor:
    """``local`` (the parameter's piece, or optimizer state of its shape) as a DTensor of the
    whole tensor. A ZeRO-2 flat piece is first gathered back into the cut piece."""
    if view.zero_groups:
        local = C.zero2_unshard(local.detach(), view.cut_shape, list(view.zero_groups))
    shape = view.info.global_shape
    return DTensor.from_local(local.detach(), view.mesh, view.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def empty_dtensor(view: ShardView, dtype: torch.dtype) -> DTensor:
    """A DTensor of the cut piece's shape to load into (fresh memory: the model is not touched)."""
    local = torch.empty(view.cut_shape, dtype=dtype, device=view.info.tensor.device)
    shape = view.info.global_shape
    return DTensor.from_local(local, view.mesh, view.placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous_stride(shape))


def to_local_piece(view: ShardView, dt: DTensor) -> torch.Tensor:
    """The tensor this rank keeps for ``dt``: the cut piece, or its ZeRO-2 flat piece."""
    local = dt.to_local()
    return C.zero2_shard(local, list(view.zero_groups)) if view.zero_groups else local
