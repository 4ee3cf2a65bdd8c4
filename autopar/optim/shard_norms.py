"""Whole-tensor norms of sharded parameters: the reduction LAMB and LARS need.

A trust ratio (LARS, LAMB) divides the norm of a whole parameter by the norm of its whole
update. A parallelized model's rank holds only a piece of each parameter (``ShardInfo`` on
each local Parameter, ``runtime/shard_info.py``): a block cut by tensor-parallel or ZeRO-3
axes, possibly flattened and padded with zeros under ZeRO-2. The squared norm of the whole is
the sum of the pieces' squared norms over exactly the mesh axes the piece is split on (the
ZeRO-2 padding is zeros, so it adds nothing). One all-reduce per mesh axis carries every
parameter split on that axis: a parameter split on axes a and b is summed over its line on a,
then those sums over the line on b, which together cover the whole a x b sub-grid.

A tensor with no ShardInfo (an unparallelized model) is whole: its local norm is the answer,
so a single-process run of the same optimizer is the reference.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from autopar.runtime.collectives import COUNTER
from autopar.runtime.shard_info import shard_info_of

__all__ = ["reduce_squared_norms"]


def reduce_squared_norms(params: Sequence[torch.Tensor], local_sq: torch.Tensor) -> torch.Tensor:
    """Sum each row of ``local_sq`` (this rank's pieces of ``params[i]``) over the mesh axes
    ``params[i]`` is split on; in place, and returned. One all-reduce per distinct axis, batched
    over the parameters split on it; rows of unsplit parameters are left as they are.

    Every rank of an axis's group must call this with the same parameters in the same order
    (the case for one plan's ``model.parameters()``): the batched vectors line up by position.
    """
    by_axis: dict[int, tuple[object, list[int]]] = {}
    for i, p in enumerate(params):
        info = shard_info_of(p)
        if info is None:
            continue
        for axis, group in zip(info.split_axes, info.groups):
            by_axis.setdefault(axis, (group, []))[1].append(i)
    for axis in sorted(by_axis):  # the same order on every rank: a fixed collective sequence
        group, rows = by_axis[axis]
        index = torch.tensor(rows)
        vec = local_sq.index_select(0, index).contiguous()
        dist.all_reduce(vec, group=group)
        COUNTER.add("all_reduce", vec.numel() * vec.element_size(), dist.get_world_size(group))
        local_sq.index_copy_(0, index, vec)
    return local_sq
