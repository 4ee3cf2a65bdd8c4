"""Expert parallelism (GShard, arXiv 2006.16668; DeepSpeed-MoE; Switch): the experts of each
mixture-of-experts layer split over one mesh axis ``ep``, tokens sent to the rank holding their
expert and back with all-to-all of uneven splits (``runtime.expert_parallel``), every other
weight as data parallel over the same axis.

What this file holds, in the technique shape (strategies, pricing, lowering, family, report):

* **strategies** - per MoE layer: ``replicated`` (every expert on every device, expert gradients
  all-reduced as data parallel does) or ``expert_parallel`` over an axis of size ``ep``;
* **pricing** - :func:`price`: memory of expert weights, gradients and AdamW state per device,
  and the all-to-all bytes per step, from the router's *capacity* (``capacity_factor`` times the
  even share ``tokens * top_k / E`` per expert; 1.0 = uniform routing) - what the plan can know
  before running. The runtime's bytes follow the *measured counts* of each batch's routing
  (``runtime.expert_parallel.predict_bytes``); the test checks those on every rank;
* **lowering** - :func:`lower`: each experts module becomes ``runtime.expert_parallel``'s
  ``ExpertParallelExperts`` holding its rank's experts;
* **family** - :data:`EP_FAMILY` (``strategy="ep"``): experts over one axis of all devices;
  :func:`choose` picks between the strategies by memory first, then step time.

Not yet on the graph planner: the routing region (top-k .. sort .. grouped matmul .. sum) has
per-op rules (``passes/rules/ops_routing.py``) but its sort runs whole, so the ILP cannot express
tokens split on the batch through it; ``choose`` is this technique's own decision, made
with the cost model's alpha-beta formulas and hardware profiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from autopar.cost_model.comm import all_reduce_s, all_to_all_s
from autopar.errors import BadArgumentError
from autopar.mesh import Link
from autopar.runtime.expert_parallel import ExpertAxis, shard_experts

__all__ = ["MoEShape", "EPCost", "ExpertParallelFamily", "EP_FAMILY", "price", "choose", "lower", "report", "planned_all_to_all_bytes", "TITLE"]

TITLE = "expert parallel (experts split over an axis, tokens by all-to-all)"
ADAMW_BYTES_PER_PARAM = 16  # fp32 weight, gradient, two moments


@dataclass(frozen=True)
class MoEShape:
    """The sizes that price a mixture-of-experts model (per training step, per device)."""

    layers: int  # MoE layers
    experts: int
    top_k: int
    hidden: int
    intermediate: int  # per expert
    dense_params: int  # everything that is not an expert
    tokens_per_device: int  # batch x sequence on one device
    itemsize: int = 4

    @property
    def expert_params(self) -> int:
        return self.layers * self.experts * 3 * self.hidden * self.intermediate  # gate, up, down


@dataclass(frozen=True)
class EPCost:
    strategy: str  # "replicated" or "expert_parallel"
    ep: int  # devices the experts are split over (1: replicated)
    memory_bytes: float  # weights + gradients + optimizer state per device
    all_to_all_bytes: float  # sent per device per step
    comm_s: float  # expert-related communication per step (all-to-all, or the expert gradient all-reduce)


@dataclass(frozen=True)
class ExpertParallelFamily:
    """``strategy="ep"``: experts split over one axis ``name`` of ``size`` devices."""

    name: str = "ep"
    description: str = "experts split over one axis, tokens dispatched and combined by all-to-all"


EP_FAMILY = ExpertParallelFamily()


def planned_all_to_all_bytes(shape: MoEShape, ep: int, capacity_factor: float = 1.0) -> float:
    """Bytes one device sends per step: per MoE layer the counts (``E`` int64) once, then
    dispatch and combine in forward and again in backward, each moving the rows bound for other
    devices: at most ``capacity_factor * tokens * top_k * (ep - 1) / ep`` (even routing at 1.0)."""
    if ep == 1:
        return 0.0
    rows = capacity_factor * shape.tokens_per_device * shape.top_k * (ep - 1) / ep
    counts = shape.experts * 8 * (ep - 1) / ep
    return shape.layers * (counts + 4 * rows * shape.hidden * shape.itemsize)


def price(shape: MoEShape, n_devices: int, link: Link, ep: int | None = None,
          capacity_factor: float = 1.0) -> EPCost:
    """Per-device memory and expert communication of ``replicated`` (``ep=None``) or of experts
    split over ``ep`` devices (the rest data parallel over all ``n_devices``)."""
    dense = shape.dense_params * ADAMW_BYTES_PER_PARAM
    if ep is None:
        expert_bytes = shape.expert_params * ADAMW_BYTES_PER_PARAM
        grad_bytes = shape.expert_params * shape.itemsize
        return EPCost("replicated", 1, dense + expert_bytes, 0.0, all_reduce_s(grad_bytes, n_devices, link))
    if ep < 1 or shape.experts % ep or n_devices % ep:
        raise BadArgumentError(
            f"expert parallel over ep={ep}: {shape.experts} experts and {n_devices} devices must both divide "
            f"by it; pick ep from {[d for d in range(1, n_devices + 1) if not shape.experts % d and not n_devices % d]}")
    local = shape.expert_params // ep
    a2a = planned_all_to_all_bytes(shape, ep, capacity_factor)
    # The ep ranks of one expert hold different tokens; copies across n / ep groups all-reduce.
    sync = all_reduce_s(local * shape.itemsize, n_devices // ep, link) if n_devices > ep else 0.0
    a2a_s = all_to_all_s(a2a * ep / (ep - 1), ep, link) if ep > 1 else 0.0
    return EPCost("expert_parallel", ep, dense + local * ADAMW_BYTES_PER_PARAM, a2a, a2a_s + sync)


def choose(shape: MoEShape, n_devices: int, memory_bytes: float, link: Link,
           capacity_factor: float = 1.0) -> EPCost:
    """The cheapest strategy that fits ``memory_bytes`` per device: replicated, or experts over
    the largest/fastest ``ep`` that divides both experts and devices."""
    options = [price(shape, n_devices, link)] + [
        price(shape, n_devices, link, ep, capacity_factor)
        for ep in range(2, n_devices + 1) if not shape.experts % ep and not n_devices % ep]
    fitting = [o for o in options if o.memory_bytes <= memory_bytes]
    if not fitting:
        least = min(options, key=lambda o: o.memory_bytes)
        raise BadArgumentError(
            f"no expert placement fits {memory_bytes / 2**30:.1f} GiB per device: the least is "
            f"{least.memory_bytes / 2**30:.1f} GiB ({least.strategy}); use more devices or ZeRO on the dense weights")
    return min(fitting, key=lambda o: (o.comm_s, o.memory_bytes))


def lower(model: nn.Module, axis: ExpertAxis) -> list[str]:
    """Give each experts module of ``model`` only this rank's experts (the runtime kernel)."""
    return shard_experts(model, axis)


def report(cost: EPCost) -> str:
    """How the report names a choice."""
    if cost.strategy == "replicated":
        return "experts replicated (expert gradients all-reduced)"
    return f"{TITLE}: ep={cost.ep}, {cost.all_to_all_bytes / 2**20:.1f} MiB all-to-all per device per step"
