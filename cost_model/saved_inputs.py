"""Which inputs an op saves for its backward, found by running it once on meta tensors.

ZeRO-3 weights are gathered again in backward only where the op that used them saved them
(``runtime.fsdp``); the cost model asks this module, so predicted bytes equal what runs.
Whether an op saves an input depends on the op and on which of its inputs need gradients
(``mm`` saves its weight only when the other operand needs a gradient), not on layouts, so one
meta run per node answers for every strategy and mesh.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["saves_input"]

_SAVED: "weakref.WeakKeyDictionary[fx.Node, frozenset[int]]" = weakref.WeakKeyDictionary()


def _is_tensor_node(x) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _saved_indices(node: fx.Node, needs: dict[str, bool]) -> frozenset[int]:
    leaves: list[torch.Tensor] = []

    def meta(x):
        if not isinstance(x, fx.Node):
            return x
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return val
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        if needs.get(x.name, False) and val.dtype.is_floating_point:
            t.requires_grad_(True)
        leaves.append(t)
        return t

    args, kwargs = pytree.tree_map(meta, (node.args, node.kwargs))
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            node.target(*args, **kwargs)
    except Exception:  # an op without a meta kernel: assume it keeps every input (counted, not hidden)
        return frozenset(range(len(leaves)))
    out = set()
    for k, leaf in enumerate(leaves):
        if any(t is leaf or t._base is leaf for t in saved):
            out.add(k)
    return frozenset(out)


def saves_input(node: fx.Node, k: int, needs: dict[str, bool]) -> bool:
    """Whether ``node`` keeps its k-th tensor input (in ``tensor_leaves`` order) for backward."""
    if node.op != "call_function":
        return False
    hit = _SAVED.get(node)
    if hit is None:
        hit = _SAVED[node] = _saved_indices(node, needs)
    return k in hit
