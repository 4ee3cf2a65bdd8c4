"""ZeRO-3 / FSDP-style parameters: gather for use, free after use, gather again for backward,
reduce-scatter the gradient.

``fsdp_gather`` all-gathers a parameter stored sharded on one mesh axis; its backward
reduce-scatters the (whole) gradient onto this rank's shard: the sum over the axis followed
by the slice, in one collective of half an all-reduce's bytes (ZeRO paper, 3 Psi (N-1)/N per
step with the all-gathers; FACTS.md).

An op that uses the gathered weight would normally save it for its backward, keeping every
layer's whole weights alive from forward to backward. ``regather_saved_weights()`` (a
``torch.autograd.graph.saved_tensors_hooks`` context that ``ParallelModule.forward`` enters)
saves such a tensor as a reference to the shard plus its view geometry, and all-gathers it
again when backward unpacks it; the gathered copy is freed when the forward has used it.
The cost model prices the same: an all-gather in forward, one more in backward for each
op that saves the weight (``cost_model.saved_inputs``), and a reduce-scatter.

Written by hand: FSDP2 does this per module over one data mesh; here a parameter may also be
cut by other mesh axes, and the unit is the single parameter the plan put in ZeRO-3 layout.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

import torch.distributed as dist

from .collectives import COUNTER, AxisGroup, _g

__all__ = ["fsdp_gather", "regather_saved_weights"]

# storage address of a live gathered weight -> (weak ref to it, shard, dim, group)
_GATHERED: dict[int, tuple] = {}


# torch 2.13 renamed these; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(shard: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    """All-gather along ``dim`` into one buffer laid out with ``dim`` outermost: a linear
    weight's transposed shard gathers with no copy, and the result is a view of the buffer."""
    front = shard.movedim(dim, 0).contiguous()  # a view when the shard is a transposed contiguous tensor
    out = front.new_empty((front.shape[0] * g.size, *front.shape[1:]))
    _all_gather_single(out, front, group=g.group)
    COUNTER.add("all_gather", out.numel() * out.element_size(), g.size)
    return out.movedim(0, dim)


def _reduce_scatter(grad: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    """Sum over the axis, keep this rank's piece along ``dim`` (one buffer, ``dim`` outermost)."""
    COUNTER.add("reduce_scatter", grad.numel() * grad.element_size(), g.size)
    front = grad.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // g.size, *front.shape[1:]))
    _reduce_scatter_single(out, front, group=g.group)
    return out.movedim(0, dim)


class _FsdpGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, dim, g):
        ctx.dim, ctx.g = dim, g
        return _gather(shard, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.g), None, None


def fsdp_gather(shard, dim: int, g: AxisGroup | str):
    """The whole weights on the axis of ``g`` from this rank's ``shard`` (cut on ``dim``);
    backward reduce-scatters the gradient (summed over the axis) onto the shard."""
    group = _g(g)
    full = _FsdpGather.apply(shard, dim, group)
    if torch.is_grad_enabled() and full.requires_grad:
        _GATHERED[full.untyped_storage().data_ptr()] = (weakref.ref(full), shard, dim, group)
    return full


class _Regather:
    """A saved view of a gathered weight, held as its shard: gathered again on unpack."""

    __slots__ = ("shard", "dim", "group", "size", "stride", "offset")

    def __init__(self, shard, dim, group, t: torch.Tensor):
        self.shard, self.dim, self.group = shard, dim, group
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _pack(t: torch.Tensor):
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return t
    entry = _GATHERED.get(ptr)
    if entry is None:
        return t
    ref, shard, dim, group = entry
    full = ref()
    if full is None or full.untyped_storage().data_ptr() != ptr:
        del _GATHERED[ptr]  # freed; the address now belongs to another tensor
        return t
    return _Regather(shard, dim, group, t)


def _unpack(x):
    if not isinstance(x, _Regather):
        return x
    with torch.no_grad():
        full = _gather(x.shard.detach(), x.dim, x.group)
    return full.as_strided(x.size, x.stride, x.offset)


@contextlib.contextmanager
def regather_saved_weights() -> Iterator[None]:
    """Inside: ops save gathered ZeRO-3 weights as their shards (see module doc)."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        try:
            yield
        finally:
            for ptr in [p for p, (ref, *_) in _GATHERED.items() if ref() is None]:
                del _GATHERED[ptr]
