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
of earlier weights overlap the CPU's work. A plan that offloads some parameter groups only
(``Plan.offload_params``, ``autopar/offload_search.py``) keeps the others' moments on the device
and steps them there with torch's AdamW arithmetic (``on_device``). The copies do not yet overlap the backward pass:
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
from typing import Sequence

import torch
from torch import nn
from torch.optim.adamw import adamw

from autopar.errors import AutoparError
from autopar.optim.cpu_kernels import adam_step

__all__ = ["OffloadAdamW", "make_optimizer", "plan_offloads"]


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW over device parameters whose fp32 master weights, moments and gradient buffer are
    host tensors (module doc). ``state[p]``: ``step``, ``master``, ``grad``, ``exp_avg``,
    ``exp_avg_sq`` (all on the host)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, on_device: Sequence[torch.Tensor] = ()):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._pin = any(p.device.type == "cuda" for g in self.param_groups for p in g["params"])
        self._copy_stream = torch.cuda.Stream() if self._pin else None
        # per-group offload (autopar/offload_search.py): these keep their moments on the device
        # and step there, with torch's AdamW arithmetic
        self._on_device = {id(p) for p in on_device}
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise AutoparError(f"OffloadAdamW takes floating parameters; got {p.dtype} of shape "
                                       f"{tuple(p.shape)}: leave it out of the optimizer")
                self.state[p] = self._device_state(p) if id(p) in self._on_device else self._host_state(p)

    @staticmethod
    def _device_state(p: torch.Tensor) -> dict:
        # the step count as a Python int: no per-parameter step tensor on the device (the plan
        # prices the moments only, cost_model/offload.device_parts)
        return dict(step=0, exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))

    def _host_state(self, p: torch.Tensor) -> dict:
        def host() -> torch.Tensor:
            return torch.zeros(p.shape, dtype=torch.float32, device="cpu", pin_memory=self._pin)

        master = host()
        master.copy_(p.detach())
        return dict(step=0, master=master, grad=host(), exp_avg=host(), exp_avg_sq=host())

    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer keeps in host memory."""
        return [s[k] for s in self.state.values() if "master" in s for k in ("master", "grad", "exp_avg", "exp_avg_sq")]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for group, p in [(g, p) for g, p in todo if id(p) in self._on_device]:
            self._device_step(group, p)
        todo = [(g, p) for g, p in todo if id(p) not in self._on_device]
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


    def _device_step(self, group: dict, p: torch.Tensor) -> None:
        s = self.state[p]
        step = torch.tensor(float(s["step"]))  # torch's AdamW counts it up itself
        b1, b2 = group["betas"]
        adamw([p], [p.grad], [s["exp_avg"]], [s["exp_avg_sq"]], [], [step], foreach=False, amsgrad=False, beta1=b1,
              beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        s["step"] = int(step.item())


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
        moved = {name for p in plans for name in p.offload_params}
        # a weight tied under two names is one tensor: offloaded if either name is
        host = {id(i.tensor) for i in module.shards() if i.name in moved} if moved else set()
        on_device = [p for p in params if id(p) not in host] if moved else []
        if moved and not host:
            raise AutoparError(f"the plan offloads {sorted(moved)[:3]}... but this module holds none of them; "
                               "make the optimizer for the module autopar.parallelize returned with this plan")
        return OffloadAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, on_device=on_device)
    # torch's fused kernel (CUDA and CPU): one pass, no temporaries besides the state, as the
    # cost model's memory walk assumes (cost_model/liveness.py); the loop where it cannot run.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") and type(p) in (torch.Tensor, nn.Parameter)
                for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused or None)
