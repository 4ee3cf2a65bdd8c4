"""LARS: layer-wise adaptive rate scaling, correct on sharded parameters.

You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks" (arXiv 1708.03888),
Algorithm 1. Per parameter w with gradient g:

    local_lr = eta * ||w|| / (||g|| + wd ||w|| + eps)     (1 where ||w|| or ||g|| is 0)
    d = local_lr * (g + wd w)
    buf = momentum buf + d                                (buf = d on the first step)
    w = w - lr * buf                                      (nesterov: lr * (d + momentum buf))

``eta`` is the paper's trust coefficient (0.001 there). ``max_trust_ratio`` caps local_lr
(NVIDIA's LARC "clip" mode caps it at 1). Groups with ``adaptive=False`` (commonly biases and
norms, which the paper leaves out) take plain momentum SGD with weight decay. The global lr
sits outside the momentum buffer (as torch.optim.SGD), so a schedule changes it at once.

||w|| and ||g|| are whole-parameter norms: ``shard_norms.reduce_squared_norms`` sums a
parallelized model's pieces over the mesh axes each is split on, batched for all parameters.
"""

from __future__ import annotations

import torch

from .hyper import check_range
from .shard_norms import reduce_squared_norms

__all__ = ["LARS"]


class LARS(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 1e-4, *,
                 trust_coefficient: float = 0.001, eps: float = 1e-9, nesterov: bool = False,
                 max_trust_ratio: float | None = None, adaptive: bool = True):
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("trust_coefficient", trust_coefficient),
                            ("eps", eps)):
            check_range("LARS", name, value)
        check_range("LARS", "momentum", momentum, hi=1.0, hi_open=True)
        if max_trust_ratio is not None:
            check_range("LARS", "max_trust_ratio", max_trust_ratio)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, max_trust_ratio=max_trust_ratio, adaptive=adaptive)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not work:
            return loss
        rows = torch.stack([torch.stack([p.float().pow(2).sum(), p.grad.float().pow(2).sum()]) for _, p in work])
        sq = reduce_squared_norms([p for _, p in work], rows)
        w_norms, g_norms = sq[:, 0].sqrt().tolist(), sq[:, 1].sqrt().tolist()
        for (group, p), w_norm, g_norm in zip(work, w_norms, g_norms):
            wd = group["weight_decay"]
            local_lr = 1.0
            if group["adaptive"] and w_norm > 0 and g_norm > 0:
                local_lr = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
                if group["max_trust_ratio"] is not None:
                    local_lr = min(local_lr, group["max_trust_ratio"])
            d = p.grad.add(p, alpha=wd) if wd else p.grad.clone()
            d.mul_(local_lr)
            momentum = group["momentum"]
            if momentum:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = d.clone()
                else:
                    state["momentum_buffer"].mul_(momentum).add_(d)
                buf = state["momentum_buffer"]
                d = d.add(buf, alpha=momentum) if group["nesterov"] else buf
            p.add_(d, alpha=-group["lr"])
        return loss
