"""bf16 mixed precision at run time, as the cost model prices it.

The policy (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` is the
reference for the semantics; ``cost_model.costs.TrainingSpec`` for the bytes):

* **Master weights stay fp32**: the Parameters the optimizer holds (this rank's shards) and
  their ``.grad`` are fp32, and so is the optimizer state.
* **Compute and activations in bf16**: the lowering (``passes/lower.py``) casts every floating
  parameter, buffer and input to bf16 where the program reads it, *before* any collective, so
  ZeRO-3 / ZeRO-2 all-gathers and Megatron's activation collectives move bf16. Dtype arguments
  that name fp32 (the dtype the model was traced in) name bf16 in the program, and tensors the
  graph makes from nothing (factories) are cast: every floating activation is bf16, as the
  plan prices every floating tensor at 2 bytes. This includes what a model's code writes as
  explicit fp32 islands (e.g. an RMSNorm's variance, a softmax's ``dtype=torch.float32``):
  a trace in fp32 cannot tell those casts from no-ops, and a collective on an fp32 island
  would send bytes the plan does not count.
* **Gradients reduced in bf16** (``reduce_dtype``): a gradient all-reduce or reduce-scatter
  runs on the gradient of the bf16 copy, in bf16; the bucketed data-parallel all-reduce
  (``runtime/grad_buckets.py``) casts each fresh gradient to bf16 for the wire. The cast's
  backward brings the reduced gradient back to fp32, where it accumulates into ``.grad``.

The loss and outputs come back in bf16 (``loss.backward()`` works as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MixedPrecision", "BF16", "policy_for", "to_compute_dtype",
           "retarget_dtypes"]


@dataclass(frozen=True)
class MixedPrecision:
    """What runs in which dtype (module doc). ``traced_dtype``: the floating dtype the graph was
    traced in; dtype arguments naming it are retargeted to ``param_dtype``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.bfloat16
    traced_dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return f"params/activations {self.param_dtype}, gradient reduction {self.reduce_dtype}, master weights fp32"


BF16 = MixedPrecision()


def policy_for(mixed_precision: bool) -> MixedPrecision | None:
    """The run-time policy a plan's ``mixed_precision`` flag stands for (None: all fp32)."""
    return BF16 if mixed_precision else None


def to_compute_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype`` where it is floating (autograd casts the gradient back to ``x``'s dtype)."""
    if not x.is_floating_point() or x.dtype == dtype:
        return x
    return x.to(dtype)


def retarget_dtypes(args: tuple, kwargs: dict, policy: MixedPrecision) -> tuple[tuple, dict]:
    """An op's arguments with every dtype naming the traced dtype replaced by the compute dtype."""
    def swap(v: Any) -> Any:
        return policy.param_dtype if v is policy.traced_dtype else v

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
