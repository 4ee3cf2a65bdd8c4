"""Rules for ops that move data without arithmetic: views, reshapes, permutes, expand,
slicing and indexing, cat and split. All are linear, so ``Partial`` passes through."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ._samples import call, rand, randint
from .registry import register_rule
from .spec import REPLICATED, OpSpec

aten = torch.ops.aten

_X = frozenset({0})
_L = "abcdefghijklmnopqrstuvwxyz"


def _letters(n: int) -> str:
    return _L[:n]


def _except(dims: str, *positions: int) -> str:
    """``dims`` with the given positions marked ``_`` (never sharded)."""
    skip = {p % len(dims) for p in positions} if dims else set()
    return "".join("_" if k in skip else c for k, c in enumerate(dims))


def reshape_spec(in_shape: Sequence[int], out_shape: Sequence[int]) -> str:
    """Einsum of a reshape. Dims are grouped into runs of equal product (a merge or a split);
    within a group only the first dim on each side may be sharded, and the two share a letter:
    cutting the outermost dim of a group cuts the flattened memory into contiguous pieces, so
    shard k of the input is exactly shard k of the output. Size-1 dims never shard."""
    in_idx = [k for k, s in enumerate(in_shape) if s != 1]
    out_idx = [k for k, s in enumerate(out_shape) if s != 1]
    in_dims, out_dims = ["_"] * len(in_shape), ["_"] * len(out_shape)
    i = j = 0
    letters = iter(_L)
    while i < len(in_idx) and j < len(out_idx):
        first_in, first_out = in_idx[i], out_idx[j]
        p_in, p_out = in_shape[first_in], out_shape[first_out]
        i, j = i + 1, j + 1
        while p_in != p_out:
            if p_in < p_out:
                p_in *= in_shape[in_idx[i]]
                i += 1
            else:
                p_out *= out_shape[out_idx[j]]
                j += 1
        letter = next(letters)
        in_dims[first_in] = out_dims[first_out] = letter
    return "".join(in_dims) + "->" + "".join(out_dims)


def _resolve(shape: Sequence[int], numel: int) -> list[int]:
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


_VIEW_SAMPLES = lambda: [  # noqa: E731
    call(rand(8, 16, 8), [8, 16, 2, 4]), call(rand(8, 16, 2, 4), [8, 16, 8]),
    call(rand(8, 16, 8), [-1, 8]), call(rand(8, 1, 8), [8, 8]), call(rand(8, 8), [8, 1, 8]),
    call(rand(16, 8), [8, 16]),
]


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, samples=_VIEW_SAMPLES)
def view(x, size) -> OpSpec:
    return OpSpec(reshape_spec(x.shape, _resolve(size, x.numel())), linear=(_X,), shape_arg=1)


@register_rule(aten.flatten.using_ints, samples=lambda: [call(rand(8, 8, 8), 1), call(rand(8, 8, 8), 0, 1)])
def flatten(x, start_dim=0, end_dim=-1) -> OpSpec:
    shape = list(x.shape)
    if not shape:
        return OpSpec("->_", linear=(_X,))
    s, e = start_dim % len(shape), end_dim % len(shape)
    out = shape[:s] + [math.prod(shape[s:e + 1])] + shape[e + 1:]
    return OpSpec(reshape_spec(x.shape, out), linear=(_X,))


@register_rule(aten.permute.default, samples=lambda: [call(rand(8, 16, 8), [2, 0, 1])])
def permute(x, dims) -> OpSpec:
    src = _letters(x.dim())
    return OpSpec(f"{src}->{''.join(src[d % x.dim()] for d in dims)}", linear=(_X,))


@register_rule(aten.transpose.int, samples=lambda: [call(rand(8, 16, 8), 1, 2), call(rand(8, 16), 0, -1)])
def transpose(x, dim0, dim1) -> OpSpec:
    src = list(_letters(x.dim()))
    d0, d1 = dim0 % x.dim(), dim1 % x.dim()
    out = src.copy()
    out[d0], out[d1] = src[d1], src[d0]
    return OpSpec(f"{''.join(src)}->{''.join(out)}", linear=(_X,))


@register_rule(aten.t.default, samples=lambda: [call(rand(8, 16))])
def t(x) -> OpSpec:
    return OpSpec("ab->ba" if x.dim() == 2 else "a->a", linear=(_X,))


@register_rule(aten.unsqueeze.default, samples=lambda: [call(rand(8, 16), 0), call(rand(8, 16), -1), call(rand(8, 16), 1)])
def unsqueeze(x, dim) -> OpSpec:
    src = _letters(x.dim())
    d = dim % (x.dim() + 1)
    return OpSpec(f"{src}->{src[:d]}_{src[d:]}", linear=(_X,))


@register_rule(aten.squeeze.dims, samples=lambda: [call(rand(8, 1, 16), [1]), call(rand(8, 1, 16, 1), [1, 3])])
def squeeze_dims(x, dim) -> OpSpec:
    return squeeze(x, dim)


@register_rule(aten.squeeze.dim, samples=lambda: [call(rand(8, 1, 16), 1), call(rand(8, 16), 1)])
def squeeze(x, dim) -> OpSpec:
    dims = {d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim]) if x.shape[d] == 1}
    src = _letters(x.dim())
    return OpSpec(f"{_except(src, *dims)}->{''.join(c for k, c in enumerate(src) if k not in dims)}", linear=(_X,))


@register_rule(aten.expand.default, samples=lambda: [
    call(rand(8, 1, 16), [8, 8, 16]), call(rand(16), [8, 8, 16]), call(rand(8, 1, 16), [-1, 8, -1]),
])
def expand(x, size) -> OpSpec:
    out = _letters(len(size))
    offset = len(size) - x.dim()
    # A broadcast dim (size 1, or new) is whole on the input; its output dim may still shard:
    # each rank expands to its own slice.
    src = "".join(
        out[offset + k] if (size[offset + k] in (-1, s)) else "_" for k, s in enumerate(x.shape)
    )
    return OpSpec(f"{src}->{out}", linear=(_X,), shape_arg=1)


@register_rule(aten.slice.Tensor, samples=lambda: [
    call(rand(8, 16, 8), 1, 0, 8), call(rand(8, 16), -1, 2, 14, 2), call(rand(8, 16), 0, 0, 9223372036854775807),
])
def slice_(x, dim=0, start=None, end=None, step=1) -> OpSpec:
    src = _letters(x.dim())
    d = dim % x.dim()
    if (start in (None, 0)) and (end is None or end >= x.shape[d]) and step == 1:
        return OpSpec(f"{src}->{src}", linear=(_X,))  # a full slice is an alias
    return OpSpec(f"{_except(src, d)}->{_except(src, d)}", linear=(_X,))


@register_rule(aten.select.int, samples=lambda: [call(rand(8, 16, 8), 1, 3), call(rand(8, 16), 0, -1)])
def select(x, dim, index) -> OpSpec:
    src = _letters(x.dim())
    d = dim % x.dim()
    return OpSpec(f"{_except(src, d)}->{src[:d] + src[d + 1:]}", linear=(_X,))


@register_rule(aten.cat.default, samples=lambda: [
    call([rand(8, 8, 8), rand(8, 16, 8)], 1), call([rand(8, 8), rand(8, 8), rand(8, 8)], -1),
])
def cat(tensors, dim=0) -> OpSpec:
    nd = tensors[0].dim()
    dims = _except(_letters(nd), dim % nd)
    return OpSpec(",".join([dims] * len(tensors)) + "->" + dims, linear=(frozenset(range(len(tensors))),))


@register_rule(aten.stack.default, samples=lambda: [call([rand(8, 8), rand(8, 8)], 1)])
def stack(tensors, dim=0) -> OpSpec:
    nd = tensors[0].dim()
    src = _letters(nd)
    d = dim % (nd + 1)
    return OpSpec(",".join([src] * len(tensors)) + f"->{src[:d]}_{src[d:]}", linear=(frozenset(range(len(tensors))),))


def _split_spec(x, n_out: int, dim: int) -> OpSpec:
    dims = _except(_letters(x.dim()), dim)
    return OpSpec(f"{dims}->" + ",".join([dims] * n_out), linear=(_X,))


@register_rule(aten.split.Tensor, samples=lambda: [call(rand(8, 24, 8), 8, 1), call(rand(8, 20), 8, -1)])
def split(x, split_size, dim=0) -> OpSpec:
    return _split_spec(x, math.ceil(x.shape[dim] / split_size), dim)


@register_rule(aten.split_with_sizes.default, samples=lambda: [call(rand(8, 24, 8), [8, 16], 1)])
def split_with_sizes(x, split_sizes, dim=0) -> OpSpec:
    return _split_spec(x, len(split_sizes), dim)


@register_rule(aten.chunk.default, samples=lambda: [call(rand(8, 24, 8), 3, 1)])
def chunk(x, chunks, dim=0) -> OpSpec:
    size = x.shape[dim]
    return _split_spec(x, math.ceil(size / math.ceil(size / chunks)), dim)


@register_rule(aten.unbind.int, samples=lambda: [call(rand(8, 3, 8), 1)])
def unbind(x, dim=0) -> OpSpec:
    src = _letters(x.dim())
    d = dim % x.dim()
    out = src[:d] + src[d + 1:]
    return OpSpec(f"{_except(src, d)}->" + ",".join([out] * x.shape[d]), linear=(_X,))


@register_rule(aten.index.Tensor, samples=lambda: [
    call(rand(8, 16), [randint(8, 8, 4)]), call(rand(8, 16, 8), [None, randint(16, 8)]),
])
def index(x, indices) -> OpSpec:
    # Advanced indexing moves dims around in ways a letter per dim cannot follow; the input
    # and the index tensors stay whole (it appears on small mask-building tensors).
    return REPLICATED


@register_rule(aten.gather.default, samples=lambda: [call(rand(8, 16), 1, randint(16, 8, 8)), call(rand(8, 8, 8), -1, randint(8, 8, 8, 8))])
def gather(x, dim, index) -> OpSpec:
    d = dim % x.dim()
    src = _letters(x.dim())
    # Dims other than `dim` shard when input and index agree in size there.
    shared = "".join(c if (k != d and x.shape[k] == index.shape[k]) else "_" for k, c in enumerate(src))
    return OpSpec(f"{shared},{shared}->{shared}", linear=(_X,))


@register_rule(aten.pad.default, samples=lambda: [
    call(rand(8, 8, 8), [1, 2]), call(rand(8, 8, 8), [0, 0, 2, 0], "constant", 0.0),
    call(rand(8, 8, 8), [1, 1], "constant", 2.0),
])
def pad(x, pad, mode="constant", value=None) -> OpSpec:
    padded = [x.dim() - 1 - k // 2 for k in range(len(pad)) if pad[k] != 0]
    dims = _except(_letters(x.dim()), *padded)
    linear = (_X,) if mode == "constant" and not value else ()
    return OpSpec(f"{dims}->{dims}", linear=linear)


@register_rule(aten.constant_pad_nd.default, samples=lambda: [call(rand(8, 8, 8), [1, 2]), call(rand(8, 8, 8), [0, 0, 2, 0], 1.0)])
def constant_pad_nd(x, pad_, value=0) -> OpSpec:
    return pad(x, pad_, "constant", value)


@register_rule(aten.tril.default, aten.triu.default, samples=lambda: [call(rand(8, 8, 8)), call(rand(8, 8, 8), 1)])
def tril(x, diagonal=0) -> OpSpec:
    dims = _except(_letters(x.dim()), -1, -2)
    return OpSpec(f"{dims}->{dims}", linear=(_X,))
