"""Facts of a traced graph that do not depend on the mesh, memoized per graph or node: which
nodes share a decision (repeated blocks, tied weights), which need a gradient, and each node's
tensor inputs. The problem builder (``cost_model.problem``) reads them for every mesh it prices;
the lowering reads which nodes need a gradient."""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict

import torch
import torch.fx as fx

from autopar.passes.rules import tensor_leaves

from .blocks import block_of

__all__ = ["share_blocks", "share_blocks_and_ties", "requires_grad", "graph_memo", "tensor_inputs"]


def _signature(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    return (node.op, str(node.target) if node.op == "call_function" else "", shape)


def share_blocks(nodes: list[fx.Node]) -> dict[str, str]:
    """Map each node to the node whose decision it shares (itself unless in a repeated block)."""
    rep = {n.name: n.name for n in nodes}
    blocks: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for n in nodes:
        b = block_of(n)
        if b is not None:
            blocks[b].append(n)
    by_prefix: dict[str, list[int]] = defaultdict(list)
    for prefix, index in blocks:
        by_prefix[prefix].append(index)
    for prefix, indices in by_prefix.items():
        indices.sort()
        first = indices[0]
        first_sig = [_signature(n) for n in blocks[(prefix, first)]]
        for index in indices[1:]:
            members = blocks[(prefix, index)]
            if [_signature(n) for n in members] != first_sig:
                first, first_sig = index, [_signature(n) for n in members]
                continue
            for n, r in zip(members, blocks[(prefix, first)]):
                rep[n.name] = r.name
    return rep


def share_blocks_and_ties(gm: fx.GraphModule, nodes: list[fx.Node]) -> tuple[dict[str, str], frozenset[str]]:
    """``share_blocks``, and tied parameters (one tensor under several names, e.g. GPT-2's
    embedding and output head): every use of a tied tensor shares the first use's decision,
    so it has one layout, one ZeRO choice and its memory counted once. Returns the mapping and
    the names of the later uses."""
    rep = share_blocks(nodes)
    first: dict[int, str] = {}
    tied = set()
    for n in nodes:
        if n.op != "get_attr":
            continue
        try:
            t = gm.get_parameter(str(n.target))
        except AttributeError:
            continue
        if id(t) in first and first[id(t)] != n.name:
            rep[n.name] = rep[first[id(t)]]
            tied.add(n.name)
        else:
            first.setdefault(id(t), n.name)
    return rep, frozenset(tied)


def requires_grad(gm: fx.GraphModule) -> dict[str, bool]:
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    needs: dict[str, bool] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point or (
            isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point
                                                   for v in val))
        if n.op == "get_attr":
            needs[n.name] = str(n.target) in params
        elif n.op == "call_function":
            ins = tensor_leaves(n.args, n.kwargs, lambda x: isinstance(x, fx.Node))
            needs[n.name] = bool(floating) and any(needs.get(i.name, False) for i in ins)
        else:  # a placeholder: a pipeline stage's input from the previous stage may need grad
            needs[n.name] = bool(n.meta.get("autopar_requires_grad", False))
    return needs


_GRAPH_MEMO: "weakref.WeakKeyDictionary[fx.Graph, dict]" = weakref.WeakKeyDictionary()


def graph_memo(graph: fx.Graph, name: str, compute):
    """Facts of a graph that do not depend on the mesh (repeated blocks, which nodes need
    gradients), computed once however many meshes the planner prices."""
    memo = _GRAPH_MEMO.setdefault(graph, {})
    if name not in memo:
        memo[name] = compute()
    return memo[name]


_INPUTS: "weakref.WeakKeyDictionary[fx.Node, list]" = weakref.WeakKeyDictionary()


def tensor_inputs(node: fx.Node) -> list[tuple[fx.Node, int]]:
    """(producer, output index) of each tensor input of ``node``, in strategy order (memoized:
    the planner prices one graph for many meshes)."""
    hit = _INPUTS.get(node)
    if hit is not None:
        return hit
    if node.op != "call_function":
        hit = []
    elif node.target is operator.getitem:
        hit = [(node.args[0], int(node.args[1]))]
    else:
        hit = [(p, 0) for p in tensor_leaves(node.args, node.kwargs, lambda x: isinstance(x, fx.Node) and
                                             isinstance(x.meta.get("val"), torch.Tensor))]
    _INPUTS[node] = hit
    return hit
