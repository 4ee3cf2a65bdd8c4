"""The vocabulary-parallel cross-entropy: the loss of logits whose class dim is split on one
mesh axis, from per-row statistics gathered over that axis (``runtime.vocab_parallel_ce``).

A column-parallel language-model head leaves the logits split on the vocabulary. The plain
reshard turns them into row shards with an all-to-all of the whole logits (forward and
backward) before the loss; this technique gathers three values per row instead, and its
backward is local. A cross-entropy strategy whose logits have their class dim split on one
axis is this technique's (the cross-entropy rule offers it where the runtime can run it: 2-D
logits, no class weights, no label smoothing); ``cost_model.algorithms.vocab_parallel_ce_steps``
prices its all-gather. No family: the tensor-parallel families and the auto search pick it
where it pays.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.cost_model.algorithms import vocab_parallel_ce_steps
from autopar.runtime.vocab_parallel_ce import vocab_parallel_cross_entropy
from autopar.strategy import Strategy

from autopar.technique import LowerContext, PriceContext, Technique, register

__all__ = ["VOCAB_PARALLEL_CE", "vocab_axis"]

_OPS = frozenset({torch.ops.aten.cross_entropy_loss.default})


def vocab_axis(node: fx.Node, strategy: Strategy) -> int | None:
    """The axis over which this cross-entropy's class dim is split, or None."""
    if node.target not in _OPS or not strategy.inputs:
        return None
    axes = [a for a, c in enumerate(strategy.inputs[0].codes) if c == 1]
    return axes[0] if len(axes) == 1 else None


def _price(ctx: PriceContext, node: fx.Node, st: Strategy, backward: bool):
    logits = node.args[0].meta["val"]
    rows = st.inputs[0].local_shape(ctx.mesh, tuple(logits.shape))[0]
    axis = vocab_axis(node, st)
    return vocab_parallel_ce_steps(rows, ctx.mesh.sizes[axis], axis, ctx.train.activation_bytes_per_elem)


def _lower(ctx: LowerContext, node: fx.Node, st: Strategy, args: tuple, kwargs: dict) -> fx.Node:
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    bound = {**dict(zip(names, args)), **kwargs}
    return ctx.graph.call_function(vocab_parallel_cross_entropy, (
        bound["input"], bound["target"], bound.get("reduction", 1), bound.get("ignore_index", -100),
        ctx.groups[vocab_axis(node, st)]))


VOCAB_PARALLEL_CE = register(Technique(
    name="vocab_parallel_ce",
    title="vocabulary-parallel cross-entropy (row statistics gathered, not the logits)",
    ops=_OPS,
    runs=lambda node, st: vocab_axis(node, st) is not None,
    price=_price,
    lower=_lower,
))
