"""Rules for elementwise ops: unary, binary with broadcasting, where, dropout, dtype casts.

Every elementwise op shards any output dim, with broadcast dims kept whole on the inputs
that broadcast. Linear ops (negation, scaling, add/sub of tensors, casts between floating
types, dropout's mask-and-scale) also carry ``Partial`` through.
"""

from __future__ import annotations

import torch

from ._samples import call, rand, randint
from .registry import register_rule
from .spec import OpSpec, elementwise_spec

aten = torch.ops.aten

_X = frozenset({0})


def _tensors(*args) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _unary_spec(x, linear: bool) -> OpSpec:
    return OpSpec(elementwise_spec([x.shape], x.shape), linear=(_X,) if linear else ())


_NONLINEAR_UNARY = [
    aten.gelu.default, aten.relu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default,
    aten.exp.default, aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.abs.default,
    aten.erf.default, aten.sin.default, aten.cos.default, aten.reciprocal.default,
    aten.ones_like.default,
]


def _unary_samples():
    return [call(rand(8, 8, 4, positive=True))]


@register_rule(*_NONLINEAR_UNARY, samples=_unary_samples)
def nonlinear_unary(x, *args, **kwargs) -> OpSpec:
    return _unary_spec(x, linear=False)


_LINEAR_UNARY = [
    aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten.zeros_like.default, aten.lift_fresh_copy.default,
]


@register_rule(aten.logical_not.default, aten.bitwise_not.default,
               samples=lambda: [call(randint(2, 8, 8, 4).bool())])
def logical_unary(x) -> OpSpec:
    return _unary_spec(x, linear=False)


@register_rule(*_LINEAR_UNARY, samples=_unary_samples)
def linear_unary(x, *args, **kwargs) -> OpSpec:
    return _unary_spec(x, linear=True)


@register_rule(aten.dropout.default, samples=lambda: [call(rand(8, 8, 4), 0.1, False), call(rand(8, 8, 4), 0.0, True)])
def dropout(x, p, train) -> OpSpec:
    # x * mask / (1 - p) is linear in x. Each rank draws its own mask for its shard; the
    # parallel run is a different (equally valid) sample of dropout, equal only with p=0 or eval.
    return _unary_spec(x, linear=True)


@register_rule(aten.to.dtype, samples=lambda: [
    call(rand(8, 8, 4), torch.float32), call(rand(8, 8, 4), dtype=torch.float32), call(randint(4, 8, 8), torch.float64),
])
def cast(x, *args, **kwargs) -> OpSpec:
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), x.dtype))
    # Summing then casting equals casting then summing only between floating types.
    return _unary_spec(x, linear=x.dtype.is_floating_point and dtype.is_floating_point)


@register_rule(aten._to_copy.default, aten.to.dtype_layout, samples=lambda: [
    call(rand(8, 8, 4), dtype=torch.float32), call(randint(4, 8, 8), dtype=torch.float64), call(rand(8, 8, 4)),
])
def cast_keyword(x, **kwargs) -> OpSpec:
    return cast(x, **kwargs)


@register_rule(aten.mul.Scalar, aten.div.Scalar, samples=lambda: [call(rand(8, 8, 4), 3.0)])
def scale_by_scalar(x, other) -> OpSpec:
    return _unary_spec(x, linear=True)


_ADDITIVE = [aten.add.Tensor, aten.sub.Tensor]
_MULTIPLICATIVE = [aten.mul.Tensor]
_COMPARE_TENSOR = [
    aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default,
    aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor,
]
_LOGICAL = [
    aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.logical_and.default, aten.logical_or.default,
]
_WITH_SCALAR = [
    aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar,
    aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.fmod.Scalar, aten.remainder.Scalar,
    aten.pow.Tensor_Scalar, aten.clamp.default, aten.hardtanh.default, aten.leaky_relu.default,
]


def _binary_samples():
    return [
        call(rand(8, 8, 4, positive=True), rand(8, 8, 4, positive=True)),
        call(rand(8, 8, 4, positive=True), rand(4, positive=True)),
        call(rand(8, 1, 4, positive=True), rand(8, 8, 1, positive=True)),
        call(rand(8, 8, 4, positive=True), 2.0),
    ]


def _broadcast_spec(a, b, linear) -> OpSpec:
    ts = _tensors(a, b)
    out_shape = torch.broadcast_shapes(*(t.shape for t in ts))
    return OpSpec(elementwise_spec([t.shape for t in ts], out_shape), linear=linear)


@register_rule(*_ADDITIVE, samples=_binary_samples)
def add_sub(a, b, *, alpha=1) -> OpSpec:
    # (a1 + a2) + (b1 + b2) = (a1 + b1) + (a2 + b2): linear in both jointly; a scalar
    # operand would be added once per rank, so then there is no Partial option.
    both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return _broadcast_spec(a, b, (frozenset({0, 1}),) if both else ())


@register_rule(*_MULTIPLICATIVE, samples=_binary_samples)
def mul(a, b) -> OpSpec:
    n = len(_tensors(a, b))
    return _broadcast_spec(a, b, tuple(frozenset({k}) for k in range(n)))


@register_rule(aten.div.Tensor, samples=_binary_samples)
def div(a, b, *, rounding_mode=None) -> OpSpec:
    linear = (frozenset({0}),) if rounding_mode is None and isinstance(a, torch.Tensor) else ()
    return _broadcast_spec(a, b, linear)


@register_rule(*_COMPARE_TENSOR, samples=lambda: [
    call(rand(8, 8, 4, positive=True), rand(8, 8, 4, positive=True)),
    call(rand(8, 1, 4, positive=True), rand(8, 8, 1, positive=True)),
])
def nonlinear_binary(a, b) -> OpSpec:
    return _broadcast_spec(a, b, ())


@register_rule(*_LOGICAL, samples=lambda: [
    call(randint(2, 8, 8, 4).bool(), randint(2, 8, 4).bool()),
    call(randint(2, 8, 1, 4).bool(), randint(2, 8, 8, 1).bool()),
])
def logical_binary(a, b) -> OpSpec:
    return _broadcast_spec(a, b, ())


@register_rule(*_WITH_SCALAR, samples=lambda: [call(rand(8, 8, 4, positive=True), 2.0)])
def nonlinear_with_scalar(x, other, *args, **kwargs) -> OpSpec:
    return _unary_spec(x, linear=False)


@register_rule(aten.masked_fill.Scalar, samples=lambda: [
    call(rand(8, 8, 4), randint(2, 8, 8, 4).bool(), -1e9), call(rand(8, 8, 4), randint(2, 8, 4).bool(), 0.0),
])
def masked_fill(x, mask, value) -> OpSpec:
    return OpSpec(elementwise_spec([x.shape, mask.shape], x.shape))


@register_rule(aten.where.self, samples=lambda: [
    call(randint(2, 8, 8, 4).bool(), rand(8, 8, 4), rand(8, 8, 4)),
    call(randint(2, 8, 1, 4).bool(), rand(8, 8, 4), rand(4)),
])
def where(cond, a, b) -> OpSpec:
    ts = _tensors(cond, a, b)
    out_shape = torch.broadcast_shapes(*(t.shape for t in ts))
    # where(c, x, y) picks elementwise, so it is linear in (x, y) jointly with c whole.
    linear = (frozenset({1, 2}),) if len(ts) == 3 else ()
    return OpSpec(elementwise_spec([t.shape for t in ts], out_shape), linear=linear)


@register_rule(aten.broadcast_tensors.default, samples=lambda: [
    call([rand(8, 8), rand(8, 8)]), call([rand(8, 1, 4), rand(8, 4)]), call([rand(4, 8), rand(8)]),
])
def broadcast_tensors(tensors) -> OpSpec:
    # Output k is input k expanded to the common shape: every output has all the dims.
    out_shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return OpSpec(elementwise_spec([t.shape for t in tensors], out_shape, n_outputs=len(tensors)))
