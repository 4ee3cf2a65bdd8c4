"""Checks of ``autopar.plan``'s arguments, before any work: each error names the value and the fix."""

from __future__ import annotations

import math
import numbers
from typing import Any

from torch import nn

from .errors import BadArgumentError

__all__ = ["check_plan_arguments"]


def check_plan_arguments(model: Any, n_gpus: Any, memory_budget_bytes: Any, model_name: str | None = None) -> None:
    """Raise :class:`BadArgumentError` for a device count, memory budget or model autopar cannot plan."""
    # bool is an int to Python, but plan(model, True) is a slip, not one device
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise BadArgumentError(f"n_gpus must be a positive integer, got {n_gpus!r}; pass the number of devices, "
                               "e.g. autopar.plan(model, 8, example_inputs)")
    if memory_budget_bytes is not None:
        if (isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, numbers.Real)
                or not math.isfinite(memory_budget_bytes) or memory_budget_bytes <= 0):
            raise BadArgumentError(f"memory_budget_bytes must be a positive number of bytes, got "
                                   f"{memory_budget_bytes!r}; e.g. 40e9 (or leave it None: the device's memory)")
    if not isinstance(model, nn.Module):
        raise BadArgumentError(f"autopar.plan expects an nn.Module, got {type(model).__name__}; pass the model "
                               "object (e.g. model, inputs = autopar.models.get_model('gpt2'))")
    if next(iter(model.parameters()), None) is None:
        raise BadArgumentError(
            f"{model_name or type(model).__name__} has no parameters, so there is nothing to shard or train; layers kept in a "
            "plain Python list or dict are not registered: hold them in nn.ModuleList / nn.ModuleDict")
