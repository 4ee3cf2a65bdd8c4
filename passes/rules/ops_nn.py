"""Rules for neural-network ops: normalizations, softmax, embedding, attention, losses,
reductions, scans and tensor factories."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.tensor import Replicate, Shard

from ._samples import call, rand, randint
from .registry import register_rule
from .spec import REPLICATED, OpSpec

aten = torch.ops.aten
_X = frozenset({0})
_L = "abcdefghijklmnopqrstuvwxyz"


def _keep_except(nd: int, *positions: int) -> str:
    skip = {p % nd for p in positions}
    return "".join("_" if k in skip else c for k, c in enumerate(_L[:nd]))


@register_rule(aten.softmax.int, aten.log_softmax.int,
               samples=lambda: [call(rand(8, 8, 16), -1), call(rand(8, 16, 8), 1, torch.float32)])
def softmax(x, dim, dtype=None) -> OpSpec:
    dims = _keep_except(x.dim(), dim)
    return OpSpec(f"{dims}->{dims}")


@register_rule(aten._softmax.default, aten._log_softmax.default,
               samples=lambda: [call(rand(8, 8, 16), -1, False), call(rand(8, 16, 8), 1, False)])
def softmax_internal(x, dim, half_to_float) -> OpSpec:
    return softmax(x, dim)


@register_rule(aten.layer_norm.default, samples=lambda: [
    call(rand(8, 8, 16), [16], rand(16), rand(16), 1e-5), call(rand(8, 8, 16), [16]),
    call(rand(8, 8, 16), [8, 16], rand(8, 16), None),
])
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True) -> OpSpec:
    k = len(normalized_shape)
    dims = _keep_except(x.dim(), *range(-k, 0))
    params = [t for t in (weight, bias) if t is not None]
    # Optimus's layer norm (runtime.sharded_norm): the hidden dim split on one axis, the row
    # statistics all-reduced there; the weight and bias split alike.
    split = ()
    if k == 1:
        split = (((Shard(x.dim() - 1),) + (Shard(0),) * len(params), (Shard(x.dim() - 1),)),)
    return OpSpec(",".join([dims] + ["_" * k] * len(params)) + f"->{dims}", algorithm=split)


@register_rule(aten.rms_norm.default, samples=lambda: [call(rand(8, 8, 16), [16], rand(16), 1e-6)])
def rms_norm(x, normalized_shape, weight=None, eps=None) -> OpSpec:
    k = len(normalized_shape)
    dims = _keep_except(x.dim(), *range(-k, 0))
    return OpSpec(",".join([dims] + (["_" * k] if weight is not None else [])) + f"->{dims}")


@register_rule(aten.embedding.default, samples=lambda: [call(rand(16, 8), randint(16, 8, 8)), call(rand(16, 8), randint(16, 8))])
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False) -> OpSpec:
    # Rows of the table are looked up by value, so the vocabulary dim stays whole here; the
    # hidden dim and the index dims shard. (Vocabulary-parallel embedding needs a masked lookup
    # and lives with the lowering.) Output is linear in the table.
    idx = _L[1:1 + indices.dim()]
    return OpSpec(f"_h,{idx}->{idx}h", linear=(_X,))


@register_rule(aten.scaled_dot_product_attention.default, samples=lambda: [
    call(rand(8, 8, 8, 4), rand(8, 8, 8, 4), rand(8, 8, 8, 8)),
    call(rand(8, 8, 8, 4), rand(8, 8, 16, 4), rand(8, 8, 16, 4), is_causal=False),
    call(rand(8, 8, 8, 4), rand(8, 8, 8, 4), rand(8, 8, 8, 4), is_causal=True),
    call(rand(8, 8, 8, 4), rand(8, 8, 8, 4), rand(8, 8, 8, 4), randint(2, 8, 1, 8, 8).bool()),
    call(rand(8, 8, 8, 4), rand(8, 8, 8, 4), rand(8, 8, 8, 4), rand(1, 1, 8, 8), scale=0.3),
])
def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False) -> OpSpec:
    # Batch and heads shard everywhere; the value dim shards (the output is linear in v); the
    # key dim and key/value sequence stay whole (softmax spans them). Query rows shard only
    # without is_causal, whose mask is anchored at row 0 and would be wrong on a shard.
    s = "_" if is_causal else "s"
    lead_q, lead_k = "bh"[: q.dim() - 2], "bh"[: k.dim() - 2]
    specs = [f"{lead_q}{s}_", f"{lead_k}__", f"{lead_k}_e"]
    if attn_mask is not None:
        full = f"{lead_q}{s}_"
        m = full[len(full) - attn_mask.dim():]
        target = q.shape[: q.dim() - 2] + (q.shape[-2], k.shape[-2])
        target = target[len(target) - attn_mask.dim():]
        specs.append("".join("_" if ms != ts else c for c, ms, ts in zip(m, attn_mask.shape, target)))
    # Ring attention (runtime.ring_attention): Q, K and V split on the sequence on one axis, K/V
    # blocks passed around the ring with an online softmax; causal masks are block masks there.
    ring = ()
    if attn_mask is None and not dropout_p and not enable_gqa and q.shape[-2] == k.shape[-2]:
        seq = Shard(q.dim() - 2)
        ring = (((seq, Shard(k.dim() - 2), Shard(v.dim() - 2)), (seq,)),)
    return OpSpec(",".join(specs) + f"->{lead_q}{s}e", linear=(frozenset({2}),), algorithm=ring)


_REDUCTIONS = {0: None, 1: "avg", 2: "sum"}  # torch's Reduction enum: none, mean, sum


@register_rule(aten.nll_loss.default, samples=lambda: [
    call(rand(16, 8), randint(8, 16)), call(rand(16, 8), randint(8, 16), None, 2), call(rand(16, 8), randint(8, 16), None, 0),
])
def nll_loss(logits, target, weight=None, reduction=1, ignore_index=-100) -> OpSpec:
    return _loss_spec(logits, weight, reduction)


@register_rule(aten.cross_entropy_loss.default, samples=lambda: [
    call(rand(16, 8), randint(8, 16)), call(rand(16, 8), randint(8, 16), None, 2),
    call(rand(16, 8), randint(8, 16), None, 0), call(rand(8, 8, 8), randint(8, 8, 8)),
])
def cross_entropy(logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0) -> OpSpec:
    # The vocabulary-parallel cross-entropy (runtime.vocab_parallel_ce): [N, C] logits split on
    # the class dim on one axis, the targets whole there, the loss whole; per-row statistics are
    # gathered in place of the logits.
    spec = _loss_spec(logits, weight, reduction)
    if logits.dim() == 2 and weight is None and not label_smoothing:
        spec = replace(spec, algorithm=(((Shard(1), Replicate()), (Replicate(),)),))
    return spec


def _loss_spec(logits, weight, reduction) -> OpSpec:
    # Rows (and any trailing dims of a [N, C, d1, ...] input) shard; the class dim stays whole.
    # A sharded mean is the mean of the per-shard means (Partial(avg)): exact when every shard
    # has the same number of counted targets - always, unless targets hit ignore_index unevenly
    # across shards. Known limitation; the exact split (sum and count reduced separately) is
    # left to the lowering.
    rows = "n" + _L[1: logits.dim() - 1] if logits.dim() > 1 else ""
    inp = rows[:1] + "_" + rows[1:] if logits.dim() > 1 else "_"
    specs = [inp, rows] + (["_"] if weight is not None else [])
    op = _REDUCTIONS[reduction]
    if op is None:
        return OpSpec(",".join(specs) + f"->{rows}")
    if weight is not None and op == "avg":
        return OpSpec(",".join("_" * len(s) for s in specs) + "->", contract=None)
    return OpSpec(",".join(specs) + "->", contract=op)


def _reduce_spec(x, dims, keepdim: bool, contract: str) -> OpSpec:
    src = _L[: x.dim()]
    reduced = {d % x.dim() for d in (dims if dims else range(x.dim()))}
    out = "".join("_" if k in reduced else c for k, c in enumerate(src)) if keepdim else \
        "".join(c for k, c in enumerate(src) if k not in reduced)
    return OpSpec(f"{src}->{out}", linear=(_X,), contract=contract)


_REDUCE_SAMPLES = lambda: [  # noqa: E731
    call(rand(8, 8, 8), [1]), call(rand(8, 8, 8), [0, 2], True), call(rand(8, 8, 8), [-1]),
]


@register_rule(aten.sum.dim_IntList, samples=_REDUCE_SAMPLES)
def sum_dims(x, dims, keepdim=False, *, dtype=None) -> OpSpec:
    return _reduce_spec(x, dims, keepdim, "sum")


@register_rule(aten.mean.dim, samples=_REDUCE_SAMPLES)
def mean_dims(x, dims, keepdim=False, *, dtype=None) -> OpSpec:
    # Shards are equal in size (uneven splits are pruned), so the mean of shard means is exact.
    return _reduce_spec(x, dims, keepdim, "avg")


@register_rule(aten.sum.default, samples=lambda: [call(rand(8, 8))])
def sum_all(x, *, dtype=None) -> OpSpec:
    return _reduce_spec(x, None, False, "sum")


@register_rule(aten.mean.default, samples=lambda: [call(rand(8, 8))])
def mean_all(x, *, dtype=None) -> OpSpec:
    return _reduce_spec(x, None, False, "avg")


@register_rule(aten.amax.default, aten.amin.default, samples=lambda: [call(rand(8, 8, 8), [1]), call(rand(8, 8, 8), [-1], True)])
def amax(x, dims=(), keepdim=False) -> OpSpec:
    reduced = {d % x.dim() for d in (dims if dims else range(x.dim()))}
    src = _keep_except(x.dim(), *reduced)
    out = src if keepdim else "".join(c for k, c in enumerate(src) if k not in reduced)
    return OpSpec(f"{src}->{out}")


@register_rule(aten.cumsum.default, samples=lambda: [call(rand(8, 8, 8), 1), call(randint(4, 8, 8), -1)])
def cumsum(x, dim, *, dtype=None) -> OpSpec:
    dims = _keep_except(x.dim(), dim)
    return OpSpec(f"{dims}->{dims}", linear=(_X,))


@register_rule(aten.diff.default, samples=lambda: [call(randint(4, 8, 8)), call(rand(8, 8), 1, 0)])
def diff(x, n=1, dim=-1, prepend=None, append=None) -> OpSpec:
    dims = _keep_except(x.dim(), dim)
    extra = [_keep_except(t.dim(), dim) for t in (prepend, append) if isinstance(t, torch.Tensor)]
    return OpSpec(",".join([dims] + extra) + f"->{dims}", linear=(frozenset(range(1 + len(extra))),))


def factory(*args, **kwargs) -> OpSpec:
    """A new tensor made from sizes alone is made whole on every device: its values may depend
    on the position (arange), so a rank could not make its slice without an offset."""
    return REPLICATED


# Uninitialized factories (empty, new_empty) have no rule: their values cannot be validated.
_FACTORY_SAMPLES = {
    aten.arange.default: [call(8)], aten.arange.start: [call(0, 8)], aten.arange.start_step: [call(0, 8, 2)],
    aten.full.default: [call([8, 8], 1.5)], aten.zeros.default: [call([4, 8])], aten.ones.default: [call([4, 8])],
    aten.scalar_tensor.default: [call(2.0)],
    aten.new_ones.default: [call(rand(8, 8), [4, 8])], aten.new_zeros.default: [call(rand(8, 8), [4, 8])],
    aten.new_full.default: [call(rand(8, 8), [4, 8], 2.0)],
}
for _op, _samples in _FACTORY_SAMPLES.items():
    register_rule(_op, samples=lambda s=_samples: s)(factory)


@register_rule(aten.mse_loss.default, aten.l1_loss.default, samples=lambda: [
    call(rand(8, 8), rand(8, 8)), call(rand(8, 4, 8), rand(8, 4, 8), 2), call(rand(8, 8), rand(8, 8), 0),
])
def pointwise_loss(x, target, reduction=1) -> OpSpec:
    # Elementwise, then reduced over every element: a shard's mean is a Partial(avg) of the
    # whole (shards are equal in size), its sum a Partial(sum).
    dims = _L[: x.dim()]
    op = _REDUCTIONS[reduction]
    if op is None:
        return OpSpec(f"{dims},{dims}->{dims}")
    return OpSpec(f"{dims},{dims}->", contract=op)


@register_rule(aten.smooth_l1_loss.default, aten.huber_loss.default, samples=lambda: [
    call(rand(8, 8), rand(8, 8)), call(rand(8, 4, 8), rand(8, 4, 8), 2, 0.5), call(rand(8, 8), rand(8, 8), 0),
])
def pointwise_loss_with_beta(x, target, reduction=1, beta=1.0) -> OpSpec:
    return pointwise_loss(x, target, reduction)


@register_rule(aten.binary_cross_entropy_with_logits.default, samples=lambda: [
    call(rand(8, 8), rand(8, 8, positive=True)), call(rand(8, 8), rand(8, 8, positive=True), rand(8), rand(8), 2),
    call(rand(8, 4), rand(8, 4, positive=True), None, None, 0),
])
def bce_with_logits(x, target, weight=None, pos_weight=None, reduction=1) -> OpSpec:
    # weight and pos_weight broadcast from the right; they are cut with the dims they span.
    dims = _L[: x.dim()]
    specs = [dims, dims] + [dims[x.dim() - w.dim():] for w in (weight, pos_weight) if w is not None]
    op = _REDUCTIONS[reduction]
    if op is None:
        return OpSpec(",".join(specs) + f"->{dims}")
    return OpSpec(",".join(specs) + "->", contract=op)
