"""LAMB: layer-wise adaptive moments for large-batch training, correct on sharded parameters.

You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
(arXiv 1904.00962), Algorithm 2. Per parameter x with gradient g at step t:

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)        (no bias correction if off)
    u = r + wd x
    x = x - lr * phi(||x||) / ||u|| * u   phi(z) = min(max(z, clip_lo), clip_hi) (``weight_norm_clip``)

The ratio is 1 where ||x|| or ||u|| is 0, and is capped at ``max_trust_ratio`` when given (as
LAMBC does). Parameter groups with ``adaptive=False`` (commonly biases and norms) take plain
Adam steps with the same decoupled weight decay.

The norms are of the *whole* parameter: on a parallelized model each local Parameter carries
its ShardInfo, and ``shard_norms.reduce_squared_norms`` sums the pieces over exactly the mesh
axes it is split on, one all-reduce per axis per step for all parameters together.

fp32 CPU tensors take the fused kernel of ``csrc/`` (``autopar.optim.cpu_kernels``) when it
is built, else (or with ``fused=False``) the torch ops below, which are the reference.
"""

from __future__ import annotations

import math

import torch

from .cpu_kernels import extension as fused_extension
from .hyper import OptimizerConfigError, check_range
from .shard_norms import reduce_squared_norms

__all__ = ["LAMB"]


class LAMB(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, *, bias_correction: bool = True,
                 weight_norm_clip: tuple[float, float] | None = None, max_trust_ratio: float | None = None,
                 adaptive: bool = True, fused: bool | None = None):
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            check_range("LAMB", name, value)
        for i, beta in enumerate(betas):
            check_range("LAMB", f"betas[{i}]", beta, hi=1.0, hi_open=True)
        if weight_norm_clip is not None:
            check_range("LAMB", "weight_norm_clip[1]", weight_norm_clip[1], lo=weight_norm_clip[0])
        if max_trust_ratio is not None:
            check_range("LAMB", "max_trust_ratio", max_trust_ratio)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        weight_norm_clip=weight_norm_clip, max_trust_ratio=max_trust_ratio, adaptive=adaptive)
        super().__init__(params, defaults)
        self.fused = fused

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, param, state, update or None when the kernel recomputes it)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                work.append((group, p, state))
        if not work:
            return loss
        kernel = fused_extension() if self._use_kernel([p for _, p, _ in work]) else None
        rows, updates = [], []
        for group, p, state in work:
            b1, b2 = group["betas"]
            step = int(state["step"].item())
            args = (step, b1, b2, group["eps"], group["weight_decay"], group["bias_correction"])
            if kernel is not None:
                rows.append(kernel.lamb_phase1(p, p.grad, state["exp_avg"], state["exp_avg_sq"], *args).float())
                updates.append(None)
            else:
                u = _reference_update(p, p.grad, state["exp_avg"], state["exp_avg_sq"], *args)
                rows.append(torch.stack([p.float().pow(2).sum(), u.float().pow(2).sum()]))
                updates.append(u)
        sq = reduce_squared_norms([p for _, p, _ in work], torch.stack(rows))
        ratios = _trust_ratios(sq, [g for g, _, _ in work]).tolist()
        for (group, p, state), u, ratio in zip(work, updates, ratios):
            scale = group["lr"] * ratio
            if kernel is not None:
                b1, b2 = group["betas"]
                kernel.lamb_phase2(p, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), scale, b1, b2,
                                   group["eps"], group["weight_decay"], group["bias_correction"], None)
            else:
                p.add_(u, alpha=-scale)
        return loss

    def _use_kernel(self, params) -> bool:
        if self.fused is False:
            return False
        fits = all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
                   and p.grad.dtype == torch.float32 and p.grad.is_contiguous() for p in params)
        if self.fused and not fits:
            raise OptimizerConfigError("LAMB(fused=True) runs contiguous fp32 CPU tensors only; pass fused=None to fall back")
        return fits and fused_extension() is not None


def _reference_update(p, grad, exp_avg, exp_avg_sq, step, b1, b2, eps, wd, bias_correction) -> torch.Tensor:
    """Update the moments in place and return u = r + wd x (the torch-ops reference of the kernel)."""
    exp_avg.lerp_(grad, 1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bc1 = 1 - b1 ** step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1 - b2 ** step) if bias_correction else 1.0
    u = (exp_avg / bc1).div_((exp_avg_sq.sqrt() / bc2_sqrt).add_(eps))
    if wd:
        u.add_(p, alpha=wd)
    return u


def _trust_ratios(sq: torch.Tensor, groups) -> torch.Tensor:
    """phi(||x||) / ||u|| per row of whole squared norms (1 where a norm is 0 or not adaptive)."""
    w_norm, u_norm = sq[:, 0].sqrt(), sq[:, 1].sqrt()
    out = torch.ones_like(w_norm)
    for i, group in enumerate(groups):
        if not group["adaptive"]:
            continue
        w, u = w_norm[i], u_norm[i]
        if group["weight_norm_clip"] is not None:
            w = w.clamp(*group["weight_norm_clip"])
        if w > 0 and u > 0:
            out[i] = w / u
            if group["max_trust_ratio"] is not None:
                out[i] = out[i].clamp(max=group["max_trust_ratio"])
    return out

