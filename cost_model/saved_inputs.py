"""What an op saves for its backward, found by running it once on meta tensors.

ZeRO-3 weights are gathered again in backward only where the op that used them saved them
(``runtime.fsdp``); the cost model asks this module, so predicted bytes equal what runs.
Whether an op saves an input depends on the op and on which of its inputs need gradients
(``mm`` saves its weight only when the other operand needs a gradient), not on layouts, so one
meta run per node answers for every strategy and mesh.

The same run says whether the op saves its own output (softmax, tanh, gelu do not; ``exp``
does) and how many bytes it saves that are neither an input nor its output (layer norm's mean
and rstd, attention's log-sum-exp, dropout's mask). ``kept_output`` combines them: an
activation stays alive for backward only where some op saves it; the cost model's activation
bytes (``costs.activation_bytes``) count exactly those, as autograd keeps them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["saves_input", "SavedFacts", "saved_facts", "kept_output", "SAVING_CONTRACTIONS"]

# Contractions that save a moved input as a panel of their own (``problem.saved_panel_bytes``
# prices it; ``moved_reads`` leaves those copies to it)
SAVING_CONTRACTIONS = frozenset({torch.ops.aten.linear.default, torch.ops.aten.mm.default,
                                 torch.ops.aten.matmul.default, torch.ops.aten.bmm.default,
                                 torch.ops.aten.addmm.default})


@dataclass(frozen=True)
class SavedFacts:
    inputs: frozenset[int]  # tensor inputs (``tensor_leaves`` order) the op saves
    output: bool  # whether it saves (a view of) one of its outputs
    extra_bytes: float  # bytes of saved tensors that are neither inputs nor outputs (whole op)


_SAVED: "weakref.WeakKeyDictionary[fx.Node, SavedFacts]" = weakref.WeakKeyDictionary()
# the same facts by what the meta run depends on (``_signature``): plain values, shared by graphs
_BY_SIGNATURE: dict = {}
_SIGNATURES_KEPT = 1 << 14
_NOTHING = SavedFacts(frozenset(), False, 0.0)


def _is_tensor_node(x) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _attention_facts(node: fx.Node, needs: dict[str, bool]) -> SavedFacts:
    """The fused attention kernels (flash on CUDA and CPU, memory-efficient) save q, k, v, the
    output and the row log-sum-exp (fp32, one per query row); a meta run would take the math
    path, which saves the probabilities instead, so this op is described, not run."""
    q = node.args[0].meta["val"]
    wanted = any(needs.get(x.name, False) for x in node.args[:3] if isinstance(x, fx.Node))
    if not wanted:
        return _NOTHING
    return SavedFacts(frozenset({0, 1, 2}), True, float(q.numel() // q.shape[-1] * 4))


def _saved_facts(node: fx.Node, needs: dict[str, bool]) -> SavedFacts:
    if node.target is torch.ops.aten.scaled_dot_product_attention.default and not node.kwargs.get("attn_mask") \
            and (len(node.args) < 4 or node.args[3] is None):
        return _attention_facts(node, needs)
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
            result = node.target(*args, **kwargs)
    except Exception:  # an op without a meta kernel: assume it keeps every input and its output (counted, not hidden)
        return SavedFacts(frozenset(range(len(leaves))), True, 0.0)
    outs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]

    def among(t, group):
        return any(t is g or t._base is g or (g._base is not None and t._base is g._base) for g in group)

    inputs = frozenset(k for k, leaf in enumerate(leaves) if any(t is leaf or t._base is leaf for t in saved))
    output = any(among(t, outs) for t in saved)
    extra = {}
    for t in saved:
        if not among(t, outs) and not any(t is leaf or t._base is leaf for leaf in leaves):
            base = t._base if t._base is not None else t
            extra[id(base)] = base.untyped_storage().nbytes() if base.device.type != "meta" else \
                base.numel() * base.element_size()
    return SavedFacts(inputs, output, float(sum(extra.values())))


def _signature(node: fx.Node, needs: dict[str, bool]):
    """What the meta run of ``node`` depends on: its op, its arguments with each tensor as
    (shape, stride, dtype, whether it needs a gradient); None where an argument is unhashable."""
    def key(x):
        if isinstance(x, fx.Node):
            val = x.meta.get("val")
            if isinstance(val, torch.Tensor):
                return ("T", tuple(val.shape), val.stride(), val.dtype, bool(needs.get(x.name, False)))
            return ("V", val)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, *map(key, x))
        if isinstance(x, dict):
            return ("D", *((k, key(v)) for k, v in sorted(x.items())))
        return x

    try:
        sig = (node.target, key(node.args), key(node.kwargs))
        hash(sig)
    except TypeError:  # e.g. a symbolic size or a list argument with something unhashable in it
        return None
    return sig


def saved_facts(node: fx.Node, needs: dict[str, bool]) -> SavedFacts:
    """What ``node`` saves for its backward, memoized per node and per ``_signature``: the 96
    blocks of a GPT-3 trace share one meta run per op (1262 runs, 1.6 s of a 175B plan, were one
    per node)."""
    if node.op != "call_function":
        return _NOTHING
    hit = _SAVED.get(node)
    if hit is None:
        sig = _signature(node, needs)
        hit = _BY_SIGNATURE.get(sig) if sig is not None else None
        if hit is None:
            hit = _saved_facts(node, needs)
            if sig is not None:
                if len(_BY_SIGNATURE) >= _SIGNATURES_KEPT:
                    _BY_SIGNATURE.clear()
                _BY_SIGNATURE[sig] = hit
        _SAVED[node] = hit
    return hit


def saves_input(node: fx.Node, k: int, needs: dict[str, bool]) -> bool:
    """Whether ``node`` keeps its k-th tensor input (in ``tensor_leaves`` order) for backward."""
    return k in saved_facts(node, needs).inputs


def _user_saves(user: fx.Node, src: fx.Node, needs: dict[str, bool], views) -> bool:
    if user.op != "call_function":
        return False
    if user.target in views:  # a view shares its base's storage: whoever saves the view keeps the base
        return any(_user_saves(u, user, needs, views) for u in user.users)
    hit = saved_facts(user, needs).inputs
    return any(p is src and k in hit for k, p in enumerate(_tensor_input_nodes(user)))


def _tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    return [x for x in pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]


def kept_output(node: fx.Node, needs: dict[str, bool], views) -> bool:
    """Whether autograd keeps ``node``'s output until backward: the op saves it, or a reader
    does (through views, whose storage is the node's). ``views``: the ops that return views."""
    if saved_facts(node, needs).output:
        return True
    return any(_user_saves(u, node, needs, views) for u in node.users)
