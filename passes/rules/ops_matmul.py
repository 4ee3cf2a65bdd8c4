"""Rules for contractions: mm, bmm, addmm, baddbmm, matmul, linear, conv2d."""

from __future__ import annotations

import torch

from ._samples import call, rand
from .registry import register_rule
from .spec import OpSpec

aten = torch.ops.aten
_A, _B = frozenset({0}), frozenset({1})


@register_rule(aten.mm.default, samples=lambda: [call(rand(8, 16), rand(16, 8))])
def mm(a, b) -> OpSpec:
    return OpSpec("mk,kn->mn", linear=(_A, _B))


@register_rule(aten.bmm.default, samples=lambda: [call(rand(8, 8, 16), rand(8, 16, 8))])
def bmm(a, b) -> OpSpec:
    return OpSpec("bmk,bkn->bmn", linear=(_A, _B))


@register_rule(aten.addmm.default, samples=lambda: [
    call(rand(8), rand(8, 16), rand(16, 8)),
    call(rand(8, 8), rand(8, 16), rand(16, 8), beta=0.5, alpha=2.0),
])
def addmm(bias, a, b, *, beta=1, alpha=1) -> OpSpec:
    bias_dims = "mn"[2 - bias.dim():] if bias.dim() else ""
    bias_dims = "".join("_" if s == 1 else c for c, s in zip(bias_dims, bias.shape))
    # bias + a @ b is linear in (bias, a) jointly and in (bias, b) jointly.
    return OpSpec(f"{bias_dims},mk,kn->mn", linear=(frozenset({0, 1}), frozenset({0, 2})),
                  additive=frozenset({0}))


@register_rule(aten.baddbmm.default, samples=lambda: [call(rand(8, 8, 8), rand(8, 8, 16), rand(8, 16, 8))])
def baddbmm(bias, a, b, *, beta=1, alpha=1) -> OpSpec:
    bias_dims = "".join("_" if s == 1 else c for c, s in zip("bmn"[3 - bias.dim():], bias.shape))
    return OpSpec(f"{bias_dims},bmk,bkn->bmn", linear=(frozenset({0, 1}), frozenset({0, 2})),
                  additive=frozenset({0}))


def _batch_dims(shape, out_batch: str) -> str:
    """Letters of the leading (batch) dims of one matmul operand, `_` where it broadcasts."""
    batch = shape[:-2]
    letters = out_batch[len(out_batch) - len(batch):] if batch else ""
    return "".join("_" if s == 1 else c for c, s in zip(letters, batch))


@register_rule(aten.matmul.default, samples=lambda: [
    call(rand(8, 16), rand(16, 8)), call(rand(8, 8, 16), rand(16, 8)), call(rand(8, 8, 8, 16), rand(8, 16, 8)),
    call(rand(16), rand(16, 8)), call(rand(8, 16), rand(16)), call(rand(8, 8, 16), rand(8, 1, 16, 8)),
])
def matmul(a, b) -> OpSpec:
    if a.dim() == 1 and b.dim() == 1:
        return OpSpec("k,k->", linear=(_A, _B))
    if a.dim() == 1:
        return OpSpec(f"k,{_batch_dims(b.shape, 'pqrs')}kn->{'pqrs'[4 - (b.dim() - 2):] if b.dim() > 2 else ''}n",
                      linear=(_A, _B))
    if b.dim() == 1:
        batch = "pqrs"[4 - (a.dim() - 2):] if a.dim() > 2 else ""
        return OpSpec(f"{batch}mk,k->{batch}m", linear=(_A, _B))
    nb = max(a.dim(), b.dim()) - 2
    out_batch = "pqrs"[4 - nb:] if nb else ""
    # A batch dim where one operand broadcasts (size 1) is `_` for it and keeps its letter in the other.
    a_b, b_b = _batch_dims(a.shape, out_batch), _batch_dims(b.shape, out_batch)
    return OpSpec(f"{a_b}mk,{b_b}kn->{out_batch}mn", linear=(_A, _B))


@register_rule(aten.linear.default, samples=lambda: [
    call(rand(8, 8, 16), rand(8, 16), rand(8)), call(rand(8, 16), rand(8, 16)),
])
def linear(x, weight, bias=None) -> OpSpec:
    lead = "pqrs"[4 - (x.dim() - 1):]
    if bias is None:
        return OpSpec(f"{lead}k,nk->{lead}n", linear=(_A, _B))
    return OpSpec(f"{lead}k,nk,n->{lead}n", linear=(frozenset({0, 2}), frozenset({1, 2})),
                  additive=frozenset({2}))


@register_rule(aten.conv2d.default, samples=lambda: [
    call(rand(8, 8, 8, 8), rand(8, 8, 2, 2), rand(8), [2, 2]),
    call(rand(8, 8, 8, 8), rand(8, 8, 3, 3), None, [1, 1], [1, 1]),
])
def conv2d(x, weight, bias=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1) -> OpSpec:
    # Spatial dims stay whole (kernels overlap shard borders); batch, output channels and the
    # contracted input channels shard. Grouped convolutions shard the batch only.
    c = "c" if groups == 1 else "_"
    o = "o" if groups == 1 else "_"
    if bias is None:
        return OpSpec(f"b{c}__,{o}{c}__->b{o}__", linear=(_A, _B))
    return OpSpec(f"b{c}__,{o}{c}__,{o}->b{o}__", linear=(frozenset({0, 2}), frozenset({1, 2})),
                  additive=frozenset({2}))
