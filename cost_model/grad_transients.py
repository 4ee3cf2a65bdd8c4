"""Gradients in flight: the bytes an op's backward holds besides the saved activations.

While autograd runs the backward of one op, two sets of gradients are alive that the step walk
(``cost_model/liveness.py``) does not otherwise count: the gradient of the op's output (made
by the backward of the op after it, freed when this backward returns) and the gradients this
backward makes for its activation inputs (alive until the ops before it consume them).
Parameter gradients are not transient (the walk counts them as gradients from here on).

They last one op each, so they matter where one op's tensors are large next to everything
kept: a language model's head, whose logits (batch x sequence x vocabulary) dwarf the hidden
states. The cross-entropy's backward holds the log-softmax it saved, the gradient of the
log-probabilities and the gradient of the logits at once: three logits-sized tensors where
the forward kept one (measured on 4 CPU ranks: ``bench/memwhere.py``).

A view's gradient is a view (nothing new); ops that need no gradient have no backward. A
composite op also holds the gradients between its parts (``_INNER_GRADS``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.mesh import MeshSpec
from autopar.strategy import Strategy

from .costs import TrainingSpec, is_view

__all__ = ["backward_transient_bytes"]


def _tensor(x) -> torch.Tensor | None:
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _float_bytes(t: torch.Tensor | None, fraction: float, train: TrainingSpec) -> float:
    if t is None or not t.dtype.is_floating_point:
        return 0.0
    return t.numel() * train.activation_bytes_per_elem * fraction


# Composite ops whose backward holds a gradient between its parts, in units of its first
# input's local bytes: cross_entropy_loss = log_softmax then nll_loss, and the gradient of the
# log-probabilities is alive while log_softmax's backward makes the logits' gradient. A meta
# run cannot measure this: the meta kernels decompose the backward into more temporaries
# than the CPU and CUDA kernels make (it measured twice the real figure).
_INNER_GRADS = {torch.ops.aten.cross_entropy_loss.default: 1.0}


def backward_transient_bytes(node: fx.Node, strategy: Strategy, mesh: MeshSpec, train: TrainingSpec,
                             needs: dict[str, bool]) -> float:
    """Bytes of the gradient of ``node``'s output plus the gradients its backward makes for
    its activation inputs, on one device under ``strategy`` (0 for views and for ops that
    need no gradient)."""
    if node.op != "call_function" or is_view(node) or not needs.get(node.name, False):
        return 0.0
    val = node.meta.get("val")
    outs = [t for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]
    out_bytes = sum(_float_bytes(t, l.local_fraction(mesh), train) for t, l in zip(outs, strategy.outputs))
    inputs = [x for x in pytree.tree_leaves((node.args, node.kwargs)) if _tensor(x) is not None]
    in_bytes = 0.0
    for x, layout in zip(inputs, strategy.inputs):
        if x.op == "get_attr" or not needs.get(x.name, False):
            continue  # a parameter's gradient is counted as a gradient
        in_bytes += _float_bytes(_tensor(x), layout.local_fraction(mesh), train)
    # A technique's kernel replaces torch's composite: its backward holds no such inner gradient
    # (the vocabulary-parallel cross-entropy makes the logits' gradient in one buffer).
    inner = _INNER_GRADS.get(node.target, 0.0) if strategy.technique is None else 0.0
    if inner and inputs and strategy.inputs:
        inner *= _float_bytes(_tensor(inputs[0]), strategy.inputs[0].local_fraction(mesh), train)
    return out_bytes + in_bytes + inner
