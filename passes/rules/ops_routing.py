"""Rules for the routing ops of mixture-of-experts layers: top-k, sort, histc, the index and
scatter ops that dispatch and combine tokens, and Hugging Face's grouped matmul.

The token dims of top-k and sort shard (the selected dim stays whole); a histogram of a
token shard is a ``Partial(sum)`` of the whole one; scatter-adds and index-adds of a shard of
the rows they add are ``Partial`` sums on top of a ``Partial`` destination (the destination is
added once, like a bias after a contraction). The grouped matmul reads its rows by global
offsets, so rows and experts stay whole here; splitting experts needs tokens moved to their
experts first, which is the expert-parallel technique's runtime kernel, not a layout of this op.
"""

from __future__ import annotations

import torch

from ._samples import call, rand, randint
from .registry import register_rule
from .spec import REPLICATED, OpSpec, elementwise_spec

aten = torch.ops.aten

_X = frozenset({0})
_L = "abcdefghijklmnopqrstuvwxyz"


def _keep_except(nd: int, dim: int) -> str:
    return "".join("_" if k == dim % nd else c for k, c in enumerate(_L[:nd]))


@register_rule(aten.topk.default, samples=lambda: [
    call(rand(16, 8), 2), call(rand(8, 8, 8), 3, 1), call(rand(8, 16), 2, -1, False, True),
])
def topk(x, k, dim=-1, largest=True, sorted=True) -> OpSpec:
    # Values and indices: every dim but the selected one shards with the input.
    dims = _keep_except(x.dim(), dim)
    return OpSpec(f"{dims}->{dims},{dims}")


@register_rule(aten.sort.default, samples=lambda: [
    call(rand(16, 8)), call(randint(4, 8, 16), 0), call(rand(8, 8), -1, True),
])
def sort(x, dim=-1, descending=False) -> OpSpec:
    dims = _keep_except(x.dim(), dim)
    return OpSpec(f"{dims}->{dims},{dims}")


@register_rule(aten.histc.default, samples=lambda: [
    call(randint(4, 16).double(), 4, 0, 3), call(rand(8, 8), 8, -2.0, 2.0), call(rand(16), 4),
])
def histc(x, bins=100, min=0, max=0) -> OpSpec:
    src = _L[: x.dim()]
    if min == max:
        # The range comes from the data's own min and max: a shard's range is not the whole's.
        return OpSpec(f"{'_' * x.dim()}->_", contract=None)
    # Counts of a shard of the elements add up to the counts of the whole.
    return OpSpec(f"{src}->_", contract="sum")


def _binary_samples():
    return [call(rand(8, 8, 4, positive=True) * 8, rand(8, 8, 4, positive=True)),
            call(randint(64, 8, 8), 2), call(rand(8, 1, 4, positive=True) * 4, rand(8, 8, 1, positive=True))]


@register_rule(aten.floor_divide.default, samples=_binary_samples)
def floor_divide(a, b) -> OpSpec:
    # Elementwise, not linear (floor of a sum is not the sum of floors).
    shapes = [t.shape for t in (a, b) if isinstance(t, torch.Tensor)]
    return OpSpec(elementwise_spec(shapes, torch.broadcast_shapes(*shapes)))


@register_rule(aten.div_.Tensor, samples=lambda: [
    call(rand(8, 8, 4), rand(8, 8, 4, positive=True)), call(rand(8, 8, 2), rand(8, 8, 1, positive=True)),
])
def div_inplace(a, b, *, rounding_mode=None) -> OpSpec:
    # a /= b: the result has a's shape; linear in a alone (without rounding).
    spec = elementwise_spec([a.shape, b.shape], a.shape)
    return OpSpec(spec, linear=(_X,) if rounding_mode is None else ())


@register_rule(aten.to.device, samples=lambda: [call(rand(8, 8), "cpu", torch.float64), call(randint(4, 8), "cpu", torch.int64)])
def to_device(x, device, dtype, non_blocking=False, copy=False, memory_format=None) -> OpSpec:
    dims = _L[: x.dim()]
    return OpSpec(f"{dims}->{dims}", linear=(_X,) if x.dtype.is_floating_point and dtype.is_floating_point else ())


def _index_put_spec(x, indices, values, accumulate) -> OpSpec:
    # x[i0, i1, ...] = values: the indexed leading dims stay whole, the trailing dims of x shard
    # together with the matching trailing dims of values (a broadcast size-1 dim stays whole).
    if any(i is None for i in indices):
        return REPLICATED
    k = len(indices)
    trailing = _L[: x.dim() - k]
    x_dims = "_" * k + trailing
    vals = "".join(
        "_" if pos < values.dim() - len(trailing) or values.shape[pos] == 1
        else trailing[pos - (values.dim() - len(trailing))]
        for pos in range(values.dim())
    ) if values.dim() >= len(trailing) else "_" * values.dim()
    specs = [x_dims] + ["_" * i.dim() for i in indices] + [vals]
    # With accumulate, x + scatter(values) is linear in (x, values) jointly.
    linear = (frozenset({0, k + 1}),) if accumulate else ()
    return OpSpec(",".join(specs) + f"->{x_dims}", linear=linear, contract=None)


@register_rule(aten.index_put_.default, aten.index_put.default, samples=lambda: [
    call(rand(16, 8), [randint(16, 8)], rand(8, 8)),
    call(rand(16, 8), [randint(16, 8)], rand(8, 8), True),
    call(randint(16, 16), [randint(16, 16)], randint(16, 16)),
    call(rand(8, 8, 4), [randint(8, 4), randint(8, 4)], rand(4, 4)),
])
def index_put(x, indices, values, accumulate=False) -> OpSpec:
    return _index_put_spec(x, indices, values, accumulate)


@register_rule(aten.index_add.default, aten.index_add_.default, samples=lambda: [
    call(rand(8, 8), 0, randint(8, 16), rand(16, 8)),
    call(rand(8, 8, 4), 1, randint(8, 8), rand(8, 8, 4), alpha=2.0),
])
def index_add(x, dim, index, source, *, alpha=1) -> OpSpec:
    # out = x; out[index[r]] += alpha * source[r] along dim. Other dims shard with x; the added
    # rows r shard on index and source, making out a Partial sum with x added on one piece.
    d = dim % x.dim()
    x_dims = _keep_except(x.dim(), d)
    src = x_dims[:d] + "r" + x_dims[d + 1:]
    return OpSpec(f"{x_dims},r,{src}->{x_dims}", linear=(frozenset({0, 2}),), additive=frozenset({0}))


@register_rule(aten.scatter_add.default, samples=lambda: [
    call(rand(8, 8), 0, randint(8, 16, 8), rand(16, 8)),
    call(rand(8, 8, 4), 1, randint(8, 8, 16, 4), rand(8, 16, 4)),
    call(rand(8, 8), 1, randint(8, 8, 4), rand(8, 8)),
])
def scatter_add(x, dim, index, src) -> OpSpec:
    # out[.., index[p], ..] += src[p] along dim. A dim other than `dim` shards when x, index
    # and src agree in size there; positions along `dim` shard on index and src -> Partial.
    d = dim % x.dim()
    agree = [k != d and x.shape[k] == index.shape[k] == src.shape[k] for k in range(x.dim())]
    if index.shape != src.shape:
        return OpSpec(",".join("_" * t.dim() for t in (x, index, src)) + "->" + "_" * x.dim(), contract=None)
    x_dims = "".join(c if agree[k] else "_" for k, c in enumerate(_L[: x.dim()]))
    idx = "".join("r" if k == d else c for k, c in enumerate(x_dims))
    return OpSpec(f"{x_dims},{idx},{idx}->{x_dims}", linear=(frozenset({0, 2}),), additive=frozenset({0}))


def _grouped_samples():
    offs = torch.tensor([4, 4, 12, 16], dtype=torch.int32)
    return [call(rand(16, 8), rand(4, 8, 16), offs), call(rand(16, 16), rand(4, 16, 8), offs)]


@register_rule("transformers::grouped_mm_fallback", samples=_grouped_samples)
def grouped_mm(x, weight, offs) -> OpSpec:
    # x[S, K] (rows sorted by expert) @ weight[E, K, N] per group of rows given by offs[E]
    # (cumulative counts). Offsets are global row numbers, so rows and experts stay whole; the
    # output columns shard with the weight's, and K is contracted (Partial sums).
    return OpSpec("_k,_kn,_->_n", linear=(frozenset({0}), frozenset({1})))
