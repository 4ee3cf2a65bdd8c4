"""Sharding rules: the registry, the einsum-like notation, and one module per op family.

Importing this package registers every built-in rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from . import ops_matmul, ops_nn, ops_pointwise, ops_routing, ops_view  # noqa: F401  (registers the rules)
from .registry import (Rule, RuleError, RuleFn, SampleFn, get_rule, has_rule, op_name, register_rule,
                       registered_ops, temporary_rule)
from .spec import REPLICATED, AxisOption, OpSpec, TensorInfo, axis_options, elementwise_spec, expand, without_algorithms

__all__ = [
    "Rule", "RuleError", "RuleFn", "SampleFn", "get_rule", "has_rule", "op_name", "register_rule",
    "registered_ops", "temporary_rule", "REPLICATED", "AxisOption", "OpSpec", "TensorInfo", "axis_options",
    "elementwise_spec", "expand", "tensor_leaves", "tensor_info", "without_algorithms",
]


def tensor_leaves(args: Any, kwargs: Any, is_tensor=lambda x: isinstance(x, torch.Tensor)) -> list[Any]:
    """The tensor arguments of a call in the order strategies list their input layouts:
    positional then keyword, nested lists flattened, a tensor used twice listed twice."""
    return [leaf for leaf in pytree.tree_leaves((args, kwargs)) if is_tensor(leaf)]


def tensor_info(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(tuple(int(s) for s in t.shape), t.dtype.is_floating_point or t.dtype.is_complex)
