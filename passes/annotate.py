"""annotate: give every node of a traced graph its candidate strategies on a mesh.

Writes, per node:

* ``node.meta["autopar_strategies"]`` (:data:`STRATEGIES_KEY`): a tuple of
  :class:`~autopar.strategy.Strategy`, the layouts the node may run in. Placeholders and
  parameters (``get_attr``) get every layout of ``Shard``/``Replicate`` that divides their
  shape; ``operator.getitem`` of a multi-output op follows its producer's outputs; every op
  gets its rule's expansion, plus the strategies of the registered techniques that cover it
  (``autopar.techniques``), each strategy a technique runs tagged with its name. A collapsed
  region (target an ``autopar.technique.Region``, ``passes.regions``) gets the strategies of
  the technique that found it only.
* ``node.meta["autopar_fallback"]`` (:data:`FALLBACK_KEY`): ``True`` on an op that has no rule.
  It runs replicated, and one :class:`UnknownOpWarning` per op names it.
"""

from __future__ import annotations

import itertools
import weakref
import operator
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Replicate, Shard

from autopar.mesh import MeshSpec
from autopar.strategy import Layout, Strategy
from autopar.technique import Region, tag, techniques_for

from .rules import expand, get_rule, has_rule, op_name, tensor_info, tensor_leaves

__all__ = ["annotate", "node_strategies", "source_layouts", "STRATEGIES_KEY", "FALLBACK_KEY", "UnknownOpWarning"]

STRATEGIES_KEY = "autopar_strategies"
FALLBACK_KEY = "autopar_fallback"


class UnknownOpWarning(UserWarning):
    """An op without a sharding rule: it runs replicated."""


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _outputs(node: fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def source_layouts(shape: tuple[int, ...], mesh: MeshSpec) -> list[Layout]:
    """Every ``Shard``/``Replicate`` layout of a tensor of ``shape`` that divides evenly."""
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
    per_axis = [choices if size > 1 else [Replicate()] for size in mesh.sizes]  # see _on_unit_axes
    layouts = (Layout.interned(c) for c in itertools.product(*per_axis))
    return [l for l in layouts if l.divides(mesh, shape)]


def _on_unit_axes(strategies: tuple[Strategy, ...], mesh: MeshSpec) -> tuple[Strategy, ...]:
    """``strategies`` less those that shard or leave a partial sum on an axis of size 1.

    On such an axis every placement holds the whole tensor, so these are copies of a replicated
    strategy at equal modelled cost; left in, the solver may pick one (a 1-device pipeline stage
    took ring attention and all-to-alls), and the runtime then runs its collectives on 1-rank
    groups for nothing. Kept as they are when nothing else is left."""
    unit = [a for a, size in enumerate(mesh.sizes) if size == 1]
    if not unit:
        return strategies
    kept = tuple(s for s in strategies
                 if all(isinstance(l.placements[a], Replicate) for l in s.inputs + s.outputs for a in unit))
    return kept or strategies


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.dtype)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def _replicated(n_in: int, n_out: int, mesh: MeshSpec) -> Strategy:
    rep = Layout.replicated(mesh.ndim)
    return Strategy(tuple(rep for _ in range(n_in)), tuple(rep for _ in range(n_out)))


def node_strategies(node: fx.Node, mesh: MeshSpec, cache: dict | None = None) -> tuple[Strategy, ...] | None:
    """Candidate strategies of one node, or None for nodes that carry no tensor.

    Raises :class:`~autopar.passes.rules.RuleError` for an op without a rule; ``annotate``
    turns that into the replicated fallback.
    """
    outs = _outputs(node)
    if node.op in ("placeholder", "get_attr"):
        if not outs:
            return None
        key = ("source", tuple(outs[0].shape), mesh.sizes)
        if cache is not None and key in cache:
            return cache[key]
        result = tuple(Strategy((), (l,)) for l in source_layouts(tuple(outs[0].shape), mesh))
        if cache is not None:
            cache[key] = result
        return result
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        producer, index = node.args
        producer_strategies = producer.meta.get(STRATEGIES_KEY) or ()
        layouts = dict.fromkeys(s.outputs[index] for s in producer_strategies if index < len(s.outputs))
        return tuple(Strategy((l,), (l,)) for l in layouts) or None
    region = isinstance(node.target, Region)  # a collapsed region: its technique gives every strategy
    rule = None if region else get_rule(node.target)
    sig = _SIGNATURES.get(node)
    if sig is None:
        sig = _SIGNATURES[node] = _signature_tree(*pytree.tree_map(_val, (node.args, node.kwargs)))
    covering = techniques_for(node.target)
    # strategies depend on mesh sizes only (and on the techniques registered for the op)
    key = (node.target, sig, mesh.sizes, covering)
    if cache is not None and key in cache:
        return cache[key]
    args, kwargs = pytree.tree_map(_val, (node.args, node.kwargs))
    ins = [tensor_info(t) for t in tensor_leaves(args, kwargs)]
    result = () if rule is None else tuple(expand(rule.fn(*args, **kwargs), ins, [tensor_info(t) for t in outs], mesh))
    for technique in covering:  # e.g. SUMMA's panel-loop linear layer
        if technique.strategies is not None:
            result = result + tuple(technique.strategies(node, result, mesh))
    result = _on_unit_axes(tag(node, result), mesh)  # each strategy a technique runs records its name
    if cache is not None:
        cache[key] = result
    return result


# Per node, its arguments' shapes and values: the planner annotates one graph for many meshes.
_SIGNATURES: "weakref.WeakKeyDictionary[fx.Node, Any]" = weakref.WeakKeyDictionary()


def _signature_tree(args: Any, kwargs: Any) -> Any:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (tuple(_signature(l) for l in leaves), str(spec))


# Expansions shared across annotate calls (the planner annotates one graph for many meshes,
# and every layer of a model repeats the same shapes). Keyed by op, argument shapes and mesh
# sizes; cleared when it grows past _CACHE_LIMIT entries.
_CACHE: dict = {}
_CACHE_LIMIT = 200_000


def annotate(gm: fx.GraphModule, mesh: MeshSpec) -> fx.GraphModule:
    """Attach candidate strategies to every node of ``gm`` for ``mesh`` (see module doc)."""
    if len(_CACHE) > _CACHE_LIMIT:
        _CACHE.clear()
    cache = _CACHE
    unknown: dict[str, int] = {}
    for node in gm.graph.nodes:
        node.meta.pop(FALLBACK_KEY, None)
        if node.op == "call_function" and node.target is not operator.getitem and not has_rule(node.target) \
                and not techniques_for(node.target):
            name = op_name(node.target)
            unknown[name] = unknown.get(name, 0) + 1
            n_in = len(tensor_leaves(node.args, node.kwargs, _is_tensor_node))
            node.meta[STRATEGIES_KEY] = (_replicated(n_in, len(_outputs(node)), mesh),)
            node.meta[FALLBACK_KEY] = True
            continue
        strategies = node_strategies(node, mesh, cache)
        if strategies is None:
            node.meta.pop(STRATEGIES_KEY, None)
        else:
            node.meta[STRATEGIES_KEY] = strategies
    for name, count in unknown.items():
        warnings.warn(
            f"autopar: no sharding rule for {name} ({count} node{'s' if count > 1 else ''}); it runs "
            f"replicated, gathering its inputs. Register a rule with "
            f"@autopar.passes.rules.register_rule({name}, samples=...) to let the planner shard it.",
            UnknownOpWarning,
            stacklevel=2,
        )
    return gm
