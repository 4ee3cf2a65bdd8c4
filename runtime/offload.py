"""ZeRO-Offload at run time: the optimizer state lives in host memory and the step runs there.

When a plan offloads (``Plan.host_bytes > 0``: ``cost_model/offload.py`` priced it), each rank
keeps on the device only its parameter shards and their gradients. ``OffloadAdamW`` holds, per
device parameter, in host memory (pinned when the parameters are on CUDA):

* an fp32 **master** copy of the shard, the two AdamW **moments**, and an fp32 **gradient
  buffer** the device gradient is copied into (the ZeRO-Offload data flow, arXiv 2101.06840:
  gradients down, the step on the CPU, updated weights up).

``step()`` copies every gradient down at once (non-blocking, on a side stream on CUDA, one
event per parameter), then walks the parameters in order: it waits for that parameter's
gradient, runs the fused CPU AdamW (``autopar.optim.cpu_kernels.adam_step``) on the host
copy, and sends the updated weights up (non-blocking), so the copies of later gradients and
of earlier weights overlap the CPU's work. The copies do not yet overlap the backward pass:
the data-parallel gradients are final only when ``runtime/grad_buckets.py`` has written them
at the end of backward.

On a CPU-only machine "device" and "host" are the same memory; the host tensors are still
separate tensors, and ``host_tensors()`` names them, so a measurement (``bench/memtrack.py``)
can count them as host bytes, apart from the device's.

The arithmetic is ``torch.optim.AdamW``'s (the same kernel as ``autopar.optim.CPUAdamW``), so
an offloaded run equals one without offload. Written here rather than taken from a library:
torch has no offloaded optimizer, and DeepSpeed's needs its engine.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.optim.cpu_kernels import adam_step

__all__ = ["OffloadAdamW", "make_optimizer", "plan_offloads"]


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW over device parameters whose fp32 master weights, moments and gradient buffer are
    host tensors (module doc). ``state[p]``: ``step``, ``master``, ``grad``, ``exp_avg``,
    ``exp_avg_sq`` (all on the host)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._pin = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
        self._copy_stream = torch.cuda.Stream() if self._pin else None
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise AutoparError(f"OffloadAdamW takes floating parameters; got {p.dtype} of shape "
                                       f"{tuple(p.shape)}: leave it out of the optimizer")
                self.state[p] = self._host_state(p)

    def _host_state(self, p: torch.Tensor) -> dict:
        def host() -> torch.Tensor:
            return torch.zeros(p.shape, dtype=torch.float32, device="cpu", pin_memory=self._pin)

        master = host()
        master.copy_(p.detach())
        return dict(step=0, master=master, grad=host(), exp_avg=host(), exp_avg_sq=host())

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer keeps in host memory."""
        return [s[k] for s in self.state.values() for k in ("master", "grad", "exp_avg", "exp_avg_sq")]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        # gradients down, all queued at once
        events = []
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _, p in todo:
                self.state[p]["grad"].copy_(p.grad, non_blocking=stream is not None)
                if stream is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(stream)
        # per parameter: wait for its gradient, step on the host, weights up
        for i, (group, p) in enumerate(todo):
            if events:
                events[i].synchronize()
            s = self.state[p]
            s["step"] += 1
            b1, b2 = group["betas"]
            adam_step(s["master"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s["step"], group["lr"], b1, b2,
                      group["eps"], group["weight_decay"], True)
            p.copy_(s["master"], non_blocking=stream is not None)
        return loss


def plan_offloads(plan) -> bool:
    """Whether ``plan`` keeps optimizer state in host memory (it priced host bytes)."""
    return float(getattr(plan, "host_bytes", 0.0)) > 0.0


def make_optimizer(module: nn.Module, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8, weight_decay: float = 1e-2) -> torch.optim.Optimizer:
    """The AdamW ``module``'s plan asks for: ``OffloadAdamW`` (state on the host) when the plan
    offloads, else ``torch.optim.AdamW`` (state on the device). ``module``: what
    ``autopar.parallelize`` returned."""
    plan = getattr(module, "plan", None)
    plans = [plan] if plan is not None else list(getattr(module, "plans", None) or ())  # a pipeline: its stages'
    if not plans:
        raise AutoparError(f"make_optimizer takes the module autopar.parallelize returned; got a "
                           f"{type(module).__name__} without a plan: parallelize it first")
    params = [p for p in module.parameters() if p.requires_grad]
    if any(plan_offloads(p) for p in plans):
        return OffloadAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    # torch's fused kernel (CUDA and CPU): one pass, no temporaries besides the state, as the
    # cost model's memory walk assumes (cost_model/liveness.py); the loop where it cannot run.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") and type(p) in (torch.Tensor, nn.Parameter)
                for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)
