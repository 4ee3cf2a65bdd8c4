"""CPUAdamW: AdamW (or Adam) on fp32 CPU tensors through the fused kernel of ``csrc/``.

For an offloaded optimizer (ZeRO-Offload keeps fp32 master weights and moments on the CPU,
arXiv 2101.06840) and usable alone. Same arithmetic as ``torch.optim.AdamW``; an optional
``bf16_copies`` map receives each parameter's bf16 copy in the same pass (what an offload path
sends back to the device).
"""

from __future__ import annotations

import torch

from .cpu_kernels import adam_step
from .hyper import OptimizerConfigError, check_range

__all__ = ["CPUAdamW"]


class CPUAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, decoupled: bool = True,
                 bf16_copies: dict[torch.Tensor, torch.Tensor] | None = None):
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            check_range("CPUAdamW", name, value)
        for i, beta in enumerate(betas):
            check_range("CPUAdamW", f"betas[{i}]", beta, hi=1.0, hi_open=True)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled))
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                    raise OptimizerConfigError(f"CPUAdamW takes contiguous fp32 CPU parameters; got {p.dtype} on "
                                               f"{p.device} of shape {tuple(p.shape)}: keep an fp32 CPU master copy")
        self.bf16_copies = bf16_copies or {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                adam_step(p, grad, state["exp_avg"], state["exp_avg_sq"], int(state["step"].item()), group["lr"],
                          b1, b2, group["eps"], group["weight_decay"], group["decoupled"], self.bf16_copies.get(p))
        return loss
