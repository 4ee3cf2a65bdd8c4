"""ZeRO-Offload in the cost model: optimizer state and fp32 master weights in host memory.

With ``TrainingSpec.offload`` every parameter keeps on the device only its weights (in the
training precision) and its gradients; the optimizer state, an fp32 master copy and an fp32
buffer the gradient is copied into live in host memory (``runtime/offload.py`` holds exactly
these), and the optimizer step runs on the host CPU. Each step, as
ZeRO-Offload does (arXiv 2101.06840): this rank's piece of the gradient goes down over the host
link, the host runs AdamW on it, and the updated weights come back up (2 x 2 Psi bytes in mixed
precision). Priced per parameter decision, with what ZeRO-2 splits split here too:

    device bytes = weights + gradients / z          host bytes = (moments + 4 + 4) x elements / z
    seconds      = (gradients + weights) / z / host link  +  elements / z / host AdamW rate

(z: the product of the parameter's ZeRO-2 axes). The transfers are not overlapped with
backward in this model. Host memory is a row of its own in the ILP (``cost_model.ilp``), under
``Hardware.host_memory_bytes``. Device and host bytes are reported apart (``Prediction``), so on
a CPU-only machine, where both are the same memory, the accounting still says which is which.

The host bytes were first the optimizer state alone (plus the master copy in mixed precision);
the run (``bench/memtrack.py``) also holds an fp32 master in fp32 training (the device weights
cannot be the host's) and the gradient buffer, so both are counted now.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from autopar.mesh import MeshSpec
from autopar.strategy import REPLICATE_CODE, Layout

from .costs import OPTIMIZER_STATE_BYTES, TrainingSpec
from .hardware import Hardware

__all__ = ["param_option_cost", "DeviceParts", "device_parts", "HostMemory", "add_host_memory", "host_bytes",
           "HOST_MASTER_AND_GRAD_BYTES", "offloads", "parameter_group", "OffloadTargets"]

HOST_MASTER_AND_GRAD_BYTES = 8  # per element on the host besides the moments: fp32 master + fp32 gradient


class OffloadTargets(tuple):
    """The parameter names (targets) a per-group offload keeps on the host, as
    ``TrainingSpec.offload`` holds them (``autopar/offload_search.py`` expands groups to these)."""


def offloads(train: TrainingSpec, target: str) -> bool:
    """Whether the parameter at ``target`` keeps its optimizer state on the host: every one
    under ``offload=True``, the named ones under a tuple of names (per-group offload)."""
    return train.offload is True or (isinstance(train.offload, tuple) and target in train.offload)


def parameter_group(target: str) -> str:
    """The group a per-group offload moves as one: the parameter's role in every copy of a
    repeated block (``blocks.3.mlp.fc.weight`` -> ``blocks.*.mlp.fc.weight``), since the cost
    problem prices a repeated block's copies as one decision; else the parameter itself."""
    return ".".join("*" if part.isdigit() else part for part in target.split("."))


@dataclass(frozen=True)
class DeviceParts:
    """A parameter's device bytes by kind (``cost_model.liveness`` places each kind in the step)."""

    weights: float
    grads: float
    state: float  # optimizer state (and fp32 master) kept on the device
    bucket: float  # its slot in a gradient all-reduce bucket (runtime/grad_buckets.py)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.state + self.bucket


def device_parts(numel: int, layout: Layout, mesh: MeshSpec, train: TrainingSpec,
                 zero_axes: Sequence[int] = (), target: str = "") -> DeviceParts:
    """The device bytes of one parameter stored in ``layout``. A parameter replicated on some
    axis of size > 1 and not ZeRO-split has its gradient all-reduced through a flat bucket that
    the runtime allocates once and keeps (``runtime/grad_buckets.py``, as DDP's reducer does),
    in the wire precision; ZeRO-2/3 gradients are reduce-scattered without one."""
    local = numel * layout.local_fraction(mesh)
    split = math.prod(mesh.sizes[a] for a in zero_axes)
    weights = local * train.param_bytes_per_elem
    grads = local * train.param_bytes_per_elem / split
    state = 0.0 if offloads(train, target) else local * train.state_bytes_per_elem / split
    replicated = any(mesh.sizes[a] > 1 and layout.codes[a] == REPLICATE_CODE for a in range(mesh.ndim))
    bucket = local * train.activation_bytes_per_elem if replicated and not zero_axes else 0.0
    return DeviceParts(weights, grads, state, bucket)


def param_option_cost(numel: int, layout: Layout, mesh: MeshSpec, hw: Hardware, train: TrainingSpec,
                      zero_axes: Sequence[int] = (), target: str = "") -> tuple[float, float, float]:
    """(optimizer-step seconds, device bytes, host bytes) of one parameter stored in ``layout``;
    the device bytes include its gradient bucket slot (:func:`device_parts`)."""
    parts = device_parts(numel, layout, mesh, train, zero_axes, target)
    local = numel * layout.local_fraction(mesh)
    split = math.prod(mesh.sizes[a] for a in zero_axes)
    weights, grads = parts.weights, parts.grads
    if not offloads(train, target):
        if hw.optimizer_params_per_s > 0 and train.optimizer in ("adam", "adamw"):
            # the measured rate of torch's AdamW on this device (autopar calibrate)
            return local / split / hw.optimizer_params_per_s, parts.total, 0.0
        streamed = weights + grads + parts.state
        # the optimizer step streams weights, gradients and state once
        return streamed / (hw.efficiency * hw.memory_bandwidth_bytes_per_s), parts.total, 0.0
    moved = grads + weights / split  # gradient piece down, updated weight piece up
    seconds = moved / hw.host_link_bytes_per_s + local / split / hw.host_adam_params_per_s
    # moments, the fp32 master copy and the fp32 gradient buffer (runtime/offload.py)
    host = local / split * (OPTIMIZER_STATE_BYTES[train.optimizer] + HOST_MASTER_AND_GRAD_BYTES)
    return seconds, parts.total, host


@dataclass
class HostMemory:
    """Host bytes per parameter decision option (count included), and the host budget."""

    budget_bytes: float
    per_option: dict[str, list[float]] = field(default_factory=dict)


def add_host_memory(problem, hw: Hardware, train: TrainingSpec) -> None:
    """Set ``problem.host`` (a ``HostMemory``) when ``train.offload``; else leave it None."""
    if not train.offload:
        return
    host = HostMemory(float(hw.host_memory_bytes))
    for key, d in problem.decisions.items():
        if d.is_param:
            numel = d.node.meta["val"].numel()
            host.per_option[key] = [param_option_cost(numel, st.output, problem.mesh, hw, train, zero,
                                                      str(d.node.target))[2] * d.count for st, zero in d.options]
    problem.host = host


def host_bytes(problem, choice: dict) -> float:
    """Host bytes per device under ``choice`` (0 without offload)."""
    host = getattr(problem, "host", None)
    if host is None:
        return 0.0
    return sum(per_option[choice[key]] for key, per_option in host.per_option.items())
