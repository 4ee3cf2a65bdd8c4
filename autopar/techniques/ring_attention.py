"""Ring attention (arXiv 2310.01889): attention with Q, K, V split on the sequence; K/V blocks
pass around the axis's ring with an online softmax (``runtime.ring_attention``).

The attention rule offers K sequence-split only where this algorithm can run it (no mask, no
dropout); a strategy with K split on its sequence dim on some axis is this technique's. Family
``ring``: sequence parallel with every attention run this way.
"""

from __future__ import annotations

import math

import torch.fx as fx

from autopar.cost_model.algorithms import ring_attention_steps
from autopar.runtime.ring_attention import ring_attention
from autopar.strategy import Strategy

from .base import Family, LowerContext, PriceContext, Technique, register
from .pins import ATTENTION, sequence_meshes

__all__ = ["RING_ATTENTION", "is_ring_attention", "ring_axes"]

NAME = "ring_attention"


def is_ring_attention(node: fx.Node, strategy: Strategy) -> bool:
    """True when ``strategy`` runs this attention as ring attention: K split on its sequence
    dim on some axis (plain attention needs whole keys; only the ring algorithm can run it)."""
    if node.target not in ATTENTION or len(strategy.inputs) < 2:
        return False
    seq_dim = node.args[1].meta["val"].dim() - 2
    return any(c == seq_dim for c in strategy.inputs[1].codes)


def ring_axes(node: fx.Node, strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes whose ring the attention runs on (K sequence-split there)."""
    seq_dim = node.args[1].meta["val"].dim() - 2
    return tuple(a for a, c in enumerate(strategy.inputs[1].codes) if c == seq_dim)


def _price(ctx: PriceContext, node: fx.Node, st: Strategy, backward: bool):
    """K and V blocks around the ring (``cost_model.algorithms.ring_attention_steps``)."""
    (axis,) = ring_axes(node, st)
    k, v = node.args[1], node.args[2]
    kb = ctx.tensor_bytes(k.meta["val"]) * st.inputs[1].local_fraction(ctx.mesh)
    vb = ctx.tensor_bytes(v.meta["val"]) * st.inputs[2].local_fraction(ctx.mesh)
    return ring_attention_steps(kb, vb, ctx.mesh.sizes[axis], axis, ctx.needs[node.name] and backward,
                                ctx.train.activation_bytes_per_elem)


def _lower(ctx: LowerContext, node: fx.Node, st: Strategy, args: tuple, kwargs: dict) -> fx.Node:
    (axis,) = ring_axes(node, st)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {**dict(zip(names, args)), **kwargs}
    return ctx.graph.call_function(ring_attention, (bound["query"], bound["key"], bound["value"], ctx.groups[axis]),
                                   {"causal": bool(bound.get("is_causal", False)), "scale": bound.get("scale")})


def _report(runs: list, axis_names) -> str:
    axes = sorted({axis_names[a] for node, st in runs for a in ring_axes(node, st)})
    return f"ring attention over {', '.join(axes)} (K/V blocks passed around the ring)"


RING_ATTENTION = register(Technique(
    name=NAME,
    title="ring attention (K/V blocks passed around the ring)",
    ops=ATTENTION,
    runs=is_ring_attention,
    price=_price,
    lower=_lower,
    report=_report,
    sequence_parallel=True,
    families=(Family("ring", "sequence parallel, every attention as ring attention",
                     lambda n, hw: sequence_meshes(n, hw, NAME), rank=42),),
))
