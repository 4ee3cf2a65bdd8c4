"""Autograd-aware collectives over one mesh axis, and the byte counter.

Each function moves a local shard in the forward and does the transposed step in the
backward, as ``cost_model.reshard`` prices them (its table is the specification). Written by
hand because the backward rules differ from torch's functional collectives in two places the
cost model relies on: an all-gather's backward is a local slice (the gradient arriving is
whole on the axis), and gradient synchronization of a replicated input is its own step
(``grad_sync``), once per tensor and axis.

Every call adds the bytes this rank sends, by the ring algorithm
(``cost_model.comm.bytes_sent_per_rank``), to :data:`COUNTER`, per collective type.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from autopar.cost_model.comm import bytes_sent_per_rank

__all__ = ["AxisGroup", "ByteCounter", "COUNTER", "count_bytes", "all_gather", "local_slice", "all_reduce",
           "reduce_scatter", "all_to_all", "to_partial", "grad_sync", "zero2_gather", "grad_scale", "zero2_shard",
           "zero2_unshard", "gather_tensor", "sum_tensor", "sum_in_place"]


@dataclass(frozen=True)
class AxisGroup:
    """The process group of one mesh axis as seen from this rank."""

    name: str
    group: object
    size: int
    rank: int  # this rank's coordinate on the axis

    def __repr__(self) -> str:
        return f"AxisGroup({self.name!r}, size={self.size}, rank={self.rank})"


# A lowered program reads its AxisGroups from attributes of its own module (``get_attr``,
# ``passes/lower.py``): each parallelized model holds its own groups, no table is process-wide.


class ByteCounter:
    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.enabled = True

    def add(self, collective: str, nbytes: float, n: int) -> None:
        if self.enabled:
            self.bytes[collective] += bytes_sent_per_rank(collective, nbytes, n)

    def reset(self) -> None:
        self.bytes = defaultdict(float)


# The one process-wide object here, on purpose: a measuring instrument (like a profiler), not
# model state. ``count_bytes`` reports what this rank sent inside a block whichever models ran.
COUNTER = ByteCounter()


@contextlib.contextmanager
def count_bytes() -> Iterator[dict[str, float]]:
    """``with count_bytes() as sent:`` - bytes this rank sent per collective inside the block."""
    before = dict(COUNTER.bytes)
    result: dict[str, float] = {}
    try:
        yield result
    finally:
        for k, v in COUNTER.bytes.items():
            delta = v - before.get(k, 0.0)
            if delta:
                result[k] = delta


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gather_tensor(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    """All-gather ``x`` over the axis, concatenated on ``dim`` (plain: no autograd).

    The pieces land in one buffer, back to back (a piece per rank along a new leading
    dimension), which is the result itself when ``dim`` is 0 and is laid out once otherwise.
    The list form (a buffer per piece, then a concatenation) held the gathered bytes twice:
    16 MiB more than this at the peak of the GPT head's backward under Megatron x dp and
    SUMMA 2D (bench/memwhere.py: ``empty_like`` and ``cat``, both the full logits' gradient)."""
    x = x.contiguous()
    dim = dim % x.dim()
    buf = x.new_empty((g.size, *x.shape))
    dist.all_gather(list(buf.unbind(0)), x, group=g.group)
    out = buf.movedim(0, dim).flatten(dim, dim + 1)  # a view when dim is 0
    if dim:
        out = out.contiguous()
    COUNTER.add("all_gather", _nbytes(out), g.size)
    return out


def _chunk(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def sum_tensor(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """The sum of ``x`` over the axis, in a new tensor (plain: no autograd)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=g.group)
    COUNTER.add("all_reduce", _nbytes(out), g.size)
    return out


def sum_in_place(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``x`` (contiguous) replaced by its sum over the axis (plain: no autograd); returns ``x``."""
    dist.all_reduce(x, group=g.group)
    COUNTER.add("all_reduce", _nbytes(x), g.size)
    return x


def _reduce_scatter(x: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    x = x.contiguous()
    COUNTER.add("reduce_scatter", _nbytes(x), g.size)
    parts = [p.contiguous() for p in x.chunk(g.size, dim=dim)]
    out = torch.empty_like(parts[g.rank])
    dist.reduce_scatter(out, parts, group=g.group)
    return out


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return gather_tensor(x, dim, g)

    @staticmethod
    def backward(ctx, grad):
        # a copy, not a view: as a parameter's .grad a view would keep the whole gathered
        # gradient alive (bench/memtrack.py measured 4x a position table's gradient on 4 ranks)
        return _chunk(grad, ctx.dim, ctx.g).clone(), None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _chunk(x, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return gather_tensor(grad, ctx.dim, ctx.g), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, average, g):
        ctx.average, ctx.g = average, g
        out = sum_tensor(x, g)
        return out / g.size if average else out

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.g.size if ctx.average else grad), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, average, g):
        ctx.dim, ctx.average, ctx.g = dim, average, g
        out = _reduce_scatter(x, dim, g)
        return out / g.size if average else out

    @staticmethod
    def backward(ctx, grad):
        full = gather_tensor(grad, ctx.dim, ctx.g)
        return (full / ctx.g.size if ctx.average else full), None, None, None


def _a2a(x: torch.Tensor, split_dim: int, cat_dim: int, g: AxisGroup) -> torch.Tensor:
    """Cut ``split_dim`` into n pieces, send piece j to rank j, concatenate received on ``cat_dim``.

    One send and one receive buffer (gloo implements only ``all_to_all_single``): the pieces
    laid back to back (a view when ``split_dim`` is 0), and the received ones read in place
    (a view when ``cat_dim`` is 0). The list form (a copy per piece each way, then a
    concatenation) held four buffers of the tensor's size at once besides the input: 16 MiB
    more than this at the peak of the GPT head's backward under Megatron (bench/memwhere.py)."""
    x = x.contiguous()
    COUNTER.add("all_to_all", _nbytes(x), g.size)
    n = g.size
    send = x.unflatten(split_dim, (n, x.shape[split_dim] // n)).movedim(split_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=g.group)
    del send  # freed before the result is laid out
    out = recv.movedim(0, cat_dim).flatten(cat_dim, cat_dim + 1)
    return out.contiguous()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, g):
        # Cut on src_dim -> cut on dst_dim: split dst_dim, gather along src_dim.
        ctx.src_dim, ctx.dst_dim, ctx.g = src_dim, dst_dim, g
        return _a2a(x, dst_dim, src_dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _a2a(grad, ctx.src_dim, ctx.dst_dim, ctx.g), None, None, None


class _ToPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, average, g):
        if average or g.rank == 0:
            return x.clone()
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GradSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return sum_tensor(grad, ctx.g), None


def all_gather(x, dim: int, g: AxisGroup):
    return _AllGather.apply(x, dim, g)


def local_slice(x, dim: int, g: AxisGroup):
    return _Slice.apply(x, dim, g)


def all_reduce(x, average: bool, g: AxisGroup):
    return _AllReduce.apply(x, average, g)


def reduce_scatter(x, dim: int, average: bool, g: AxisGroup):
    return _ReduceScatter.apply(x, dim, average, g)


def all_to_all(x, src_dim: int, dst_dim: int, g: AxisGroup):
    return _AllToAll.apply(x, src_dim, dst_dim, g)


def to_partial(x, average: bool, g: AxisGroup):
    return _ToPartial.apply(x, average, g)


def grad_sync(x, g: AxisGroup):
    """Identity forward; all-reduce of the gradient backward (a replicated input of sharded work)."""
    return _GradSync.apply(x, g)


# --- ZeRO-2 -----------------------------------------------------------------------------------
# A ZeRO-2 parameter is kept as this rank's piece of its flattened, padded local tensor, so the
# optimizer (any torch optimizer) holds state for that piece only. Each step gathers the
# weights for use and reduce-scatters their gradient back onto the piece, over the zero axes;
# ``cost_model.problem.zero2_steps`` prices exactly these steps. (Written by hand: FSDP2 shards
# whole modules over one data mesh; here a parameter may also be cut by tensor-parallel axes.)


def _padded(numel: int, k: int) -> int:
    return -(-numel // k) * k


def _flat_padded(t: torch.Tensor, groups: "list[AxisGroup]") -> torch.Tensor:
    """``t`` flattened and zero-padded to a multiple of the groups' product."""
    k = math.prod(g.size for g in groups)
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(_padded(flat.numel(), k) - flat.numel())])


def zero2_shard(local: torch.Tensor, groups: "list[AxisGroup]") -> torch.Tensor:
    """This rank's piece of ``local`` flattened and padded (pieces ordered outer axis first)."""
    index = 0
    for g in groups:
        index = index * g.size + g.rank
    # this rank's chunk of the flat padded tensor, copied out without padding the whole (a
    # whole padded copy was one more tensor of its size alive while a model loads)
    flat = local.reshape(-1)
    per = _padded(flat.numel(), math.prod(g.size for g in groups)) // math.prod(g.size for g in groups)
    piece = flat.new_zeros(per)
    start, end = min(index * per, flat.numel()), min((index + 1) * per, flat.numel())
    piece[:end - start] = flat[start:end]
    return piece


def zero2_unshard(piece: torch.Tensor, shape, groups: "list[AxisGroup]") -> torch.Tensor:
    """Inverse of ``zero2_shard``: all-gather the pieces (innermost axis first), cut the padding."""
    full = piece.contiguous()
    for g in reversed(groups):
        full = gather_tensor(full, 0, g)
    return full[: torch.Size(shape).numel()].view(shape)


class _Zero2Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece, shape, groups):
        ctx.groups = groups
        return zero2_unshard(piece, shape, groups)

    @staticmethod
    def backward(ctx, grad):
        flat = _flat_padded(grad, ctx.groups)
        for g in ctx.groups:  # outermost axis first, as zero2_shard orders the pieces
            flat = _reduce_scatter(flat, 0, g)
        return flat, None, None


def zero2_gather(piece, shape, axes: "list[AxisGroup]"):
    """The weights of a ZeRO-2 parameter from this rank's piece; backward reduce-scatters the
    gradient (summed over the zero axes) onto the piece."""
    return _Zero2Gather.apply(piece, tuple(shape), list(axes))


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def grad_scale(x, factor: float):
    """Identity forward; scales the gradient backward. A ZeRO-2 reduce-scatter sums over its
    axis: a gradient that is already whole there (replicated work) enters it divided by n."""
    return _GradScale.apply(x, factor)
