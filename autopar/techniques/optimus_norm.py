"""Optimus's layer norm (arXiv 2104.05343): a layer norm over a hidden dim split on one mesh
axis, its per-row statistics all-reduced there (``runtime.sharded_norm``).

A layer-norm strategy whose input has its last dim split on exactly one axis is this
technique's; ``cost_model.algorithms.sharded_norm_steps`` prices its all-reduces. It offers no
family: the 2D/2.5D/3D families and the auto search pick it where it pays.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.cost_model.algorithms import sharded_norm_steps
from autopar.runtime.sharded_norm import sharded_layer_norm
from autopar.strategy import Strategy

from .base import LowerContext, PriceContext, Technique, register

__all__ = ["OPTIMUS_NORM", "sharded_norm_axis"]

_OPS = frozenset({torch.ops.aten.layer_norm.default})


def sharded_norm_axis(node: fx.Node, strategy: Strategy) -> int | None:
    """The axis over which this layer norm's hidden dim is split, or None."""
    if node.target not in _OPS or not strategy.inputs:
        return None
    last = node.args[0].meta["val"].dim() - 1
    axes = [a for a, c in enumerate(strategy.inputs[0].codes) if c == last]
    return axes[0] if len(axes) == 1 else None


def _price(ctx: PriceContext, node: fx.Node, st: Strategy, backward: bool):
    x = node.args[0].meta["val"]
    local = st.inputs[0].local_shape(ctx.mesh, tuple(x.shape))
    return sharded_norm_steps(math.prod(local[:-1]), sharded_norm_axis(node, st),
                              ctx.train.activation_bytes_per_elem, ctx.needs[node.name] and backward)


def _lower(ctx: LowerContext, node: fx.Node, st: Strategy, args: tuple, kwargs: dict) -> fx.Node:
    names = ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")
    bound = {**dict(zip(names, args)), **kwargs}
    return ctx.graph.call_function(sharded_layer_norm, (
        bound["input"], list(node.args[1]), bound.get("weight"), bound.get("bias"), bound.get("eps", 1e-5),
        ctx.groups[sharded_norm_axis(node, st)]))


OPTIMUS_NORM = register(Technique(
    name="optimus_norm",
    title="Optimus layer norm (hidden dim split, row statistics all-reduced)",
    ops=_OPS,
    runs=lambda node, st: sharded_norm_axis(node, st) is not None,
    price=_price,
    lower=_lower,
))
