"""Layer norm over a hidden dim split across one mesh axis (Optimus's 2D layer norm).

Each rank holds ``x[..., h/n]`` (its slice of the hidden features) and the matching slices of
the weight and bias. The row statistics need the whole row, so the forward all-reduces two
per-row sums over the axis: ``sum x`` (for the mean), then ``sum (x - mean)^2`` (for the
variance; two passes, as stable as the unsharded op). The backward of
``y = xhat * w + b`` with ``xhat = (x - mean) * rstd`` is, per row,

    dx = rstd * (g - mean_h(g) - xhat * mean_h(g * xhat)),   g = dy * w,

whose two row means over the whole hidden dim come from one all-reduce of both partial sums.
The weight and bias gradients are local: each rank owns its slice of them. So the activations
never need gathering on this axis: 2D tensor parallelism keeps them split over both axes.

Written by hand: torch's layer norm kernels normalize over local data only. Every all-reduce
is counted by ``collectives.COUNTER`` (``cost_model.algorithms.sharded_norm_steps`` prices
the same three).
"""

from __future__ import annotations

import torch

from .collectives import AxisGroup, sum_tensor

__all__ = ["sharded_layer_norm"]


class _ShardedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, g, hidden):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        mean = sum_tensor(xf.sum(-1, keepdim=True), g) / hidden
        xc = xf - mean
        var = sum_tensor((xc * xc).sum(-1, keepdim=True), g) / hidden
        rstd = torch.rsqrt(var + eps)
        xhat = xc * rstd
        out = xhat
        if weight is not None:
            out = out * weight.to(acc)
        if bias is not None:
            out = out + bias.to(acc)
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.g, ctx.hidden, ctx.has_bias, ctx.dtype = g, hidden, bias is not None, x.dtype
        return out.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        gf = grad.to(xhat.dtype)
        lead = tuple(range(gf.dim() - 1))
        dweight = (gf * xhat).sum(lead).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        dbias = gf.sum(lead).to(ctx.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dxhat = gf * weight.to(gf.dtype) if weight is not None else gf
        sums = sum_tensor(torch.cat([dxhat.sum(-1, keepdim=True), (dxhat * xhat).sum(-1, keepdim=True)], -1), ctx.g)
        mean_g, mean_gx = sums[..., :1] / ctx.hidden, sums[..., 1:] / ctx.hidden
        dx = rstd * (dxhat - mean_g - xhat * mean_gx)
        return dx.to(ctx.dtype), dweight, dbias, None, None, None


def sharded_layer_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       eps: float, g: AxisGroup) -> torch.Tensor:
    """``layer_norm`` of ``x`` over its last dim, which is split over the axis ``g`` (this rank
    holds a contiguous slice of it, and of ``weight`` and ``bias``)."""
    if len(normalized_shape) != 1:
        raise ValueError(f"sharded_layer_norm normalizes over one (the last) dim; got normalized_shape "
                         f"{list(normalized_shape)}")
    hidden = x.shape[-1] * g.size
    if g.size == 1:
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _ShardedLayerNorm.apply(x, weight, bias, eps, g, hidden)
