"""Cross-entropy over logits whose class (vocabulary) dim is split across one mesh axis.

Each rank holds ``x[:, V/n]``: its slice of every row's logits, the output of a column-parallel
language-model head. The loss of row ``i`` is ``logsumexp_j x[i, j] - x[i, t_i]``, and both
terms need the whole row. Gathering the logits (or turning them into row shards with an
all-to-all, the plain reshard) moves ``N x V`` values; this moves three per row instead. Each
rank reduces its slice to a per-row max ``m_r``, a per-row ``s_r = sum exp(x - m_r)`` and the
target's logit ``t_r`` where the target falls in its slice (0 elsewhere); one all-gather of
those ``[N, 3]`` statistics gives every rank

    M = max_r m_r,   logsumexp = M + log sum_r s_r exp(m_r - M),   x[i, t_i] = sum_r t_r.

The backward needs no collective: the gradient of the logits on this rank's slice is
``softmax(x) - onehot(t)`` there, ``exp(x - logsumexp)`` with the one subtracted on the rank
that holds the target, times the incoming gradient (over the count of counted rows for a
mean). Megatron-LM's language-model head works this way; this is our own kernel.

Written by hand: torch's cross-entropy kernels need whole rows. Statistics are in fp32 (fp64
for fp64 logits) whatever the logits' dtype. Rows whose target is ``ignore_index`` count as
torch counts them: zero loss, zero gradient, not in a mean's denominator. The all-gather is
counted by ``collectives.COUNTER``; ``cost_model.algorithms.vocab_parallel_ce_steps`` prices it.
"""

from __future__ import annotations

import torch

from .collectives import AxisGroup, gather_tensor

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch's Reduction enum, as aten passes it


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _where_target(target: torch.Tensor, ignore_index: int, rank: int, n_local: int):
    """(counted rows, target held by this rank, the target's column in this rank's slice)."""
    counted = target != ignore_index
    column = target - rank * n_local
    here = counted & (column >= 0) & (column < n_local)
    return counted, here, column.clamp(0, n_local - 1)


def _row_parts(x: torch.Tensor) -> list[slice]:
    """Row blocks to work through: all rows at once for fp32/fp64 logits; for half precision,
    eighths, so the fp32 working copy is a quarter of the logits' bytes rather than twice them
    (the memory model prices the logits' gradient and no working copy)."""
    rows = x.shape[0]
    step = max(1, rows if x.dtype == _acc(x.dtype) else -(-rows // 8))
    return [slice(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, reduction, ignore_index, g):
        rows, n_local = x.shape
        counted, here, column = _where_target(target, ignore_index, g.rank, n_local)
        mine = x.new_empty((rows, 3), dtype=_acc(x.dtype))
        for part in _row_parts(x):
            xf = x[part].to(mine.dtype)
            m = xf.amax(1)
            mine[part, 0], mine[part, 1] = m, (xf - m[:, None]).exp_().sum(1)
            mine[part, 2] = torch.where(here[part], xf.gather(1, column[part, None]).squeeze(1), 0.0)
        stats = gather_tensor(mine, 0, g).view(g.size, rows, 3)
        big = stats[..., 0].amax(0)
        lse = big + (stats[..., 1] * (stats[..., 0] - big).exp()).sum(0).log()
        loss = torch.where(counted, lse - stats[..., 2].sum(0), 0.0)
        ctx.save_for_backward(x, target, lse)
        ctx.reduction, ctx.ignore_index, ctx.rank = reduction, ignore_index, g.rank
        if reduction == "none":
            return loss.to(x.dtype)
        total = loss.sum()
        return (total / counted.sum() if reduction == "mean" else total).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, target, lse = ctx.saved_tensors
        counted, here, column = _where_target(target, ctx.ignore_index, ctx.rank, x.shape[1])
        g = grad.to(lse.dtype)
        if ctx.reduction == "mean":
            g = g / counted.sum()
        scale = torch.where(counted, g, 0.0) if ctx.reduction == "none" else counted.to(lse.dtype) * g
        parts = _row_parts(x)
        dx = None if len(parts) == 1 else torch.empty_like(x)
        for part in parts:
            d = (x[part].to(lse.dtype) - lse[part, None]).exp_()  # this slice of softmax(x)
            h = here[part]
            d[h.nonzero(as_tuple=True)[0], column[part][h]] -= 1.0  # the target's one, where held
            d.mul_(scale[part, None])
            if dx is None:
                dx = d  # one block in the logits' own dtype: it is the gradient
            else:
                dx[part] = d
        return dx, None, None, None, None


def vocab_parallel_cross_entropy(x: torch.Tensor, target: torch.Tensor, reduction: int | str, ignore_index: int,
                                 g: AxisGroup) -> torch.Tensor:
    """``cross_entropy(logits, target)`` where this rank holds ``x``, a contiguous slice of the
    logits' class dim (``[N, V / g.size]``, slices in rank order over the axis ``g``), and the
    whole ``target`` (``[N]``). ``reduction``: 0/1/2 (aten's none/mean/sum) or the name. The
    result is whole on every rank of the axis."""
    reduction = _REDUCTIONS.get(reduction, reduction)
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be none, mean or sum; got {reduction!r}")
    if x.dim() != 2 or target.dim() != 1 or target.shape[0] != x.shape[0]:
        raise ValueError(f"vocab_parallel_cross_entropy takes logits [N, C/n] and targets [N]; got "
                         f"{tuple(x.shape)} and {tuple(target.shape)} (flatten the leading dims first)")
    if g.size == 1:
        return torch.nn.functional.cross_entropy(x, target, reduction=reduction, ignore_index=ignore_index)
    return _VocabParallelCE.apply(x, target, reduction, ignore_index, g)
