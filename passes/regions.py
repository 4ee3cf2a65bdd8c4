"""regions: collapse each sub-graph a region technique runs as one call into one node.

A region technique (``autopar.technique.Technique.regions``; a mixture-of-experts block is one:
routing, dispatch, experts, combine) names sub-graphs of the traced graph. This pass replaces
each by a single ``call_function`` node whose target is an :class:`~autopar.technique.Region`
holding the sub-graph (calling it runs the original ops), whose arguments are the region's
inputs and whose ``meta`` is the last node's. From then on the region is one node for every
pass: annotate asks its technique for its strategies, the cost problem prices it once (its
technique's collectives, its ops' compute summed), and the lowering emits one call of the
technique's runtime kernel in its place.

A match that is not a closed region (an inner value used outside it, or an input produced
inside it) is left as it is, with a warning naming the technique and the value: the graph then
plans op by op, as it would without the technique.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from autopar.technique import Region, RegionMatch, techniques

__all__ = ["collapse_regions", "RegionWarning"]


class RegionWarning(UserWarning):
    """A region a technique found is not closed; the graph keeps its ops."""


def collapse_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every region of every registered region technique collapsed (module doc),
    changed in place and returned."""
    changed = False
    for t in techniques():
        if t.regions is None:
            continue
        for index, match in enumerate(t.regions(gm)):
            problem = _not_closed(match)
            if problem:
                warnings.warn(f"autopar: technique {t.name!r} found a region ending at {match.nodes[-1].name} "
                              f"that is not closed ({problem}); its ops are planned one by one", RegionWarning,
                              stacklevel=2)
                continue
            _collapse(gm, match, t.name, index)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _not_closed(match: RegionMatch) -> str:
    inside = set(match.nodes)
    for n in match.nodes[:-1]:
        outside = [u.name for u in n.users if u not in inside]
        if outside:
            return f"{n.name} is also used by {', '.join(outside)}"
    for n in match.nodes:
        for i in n.all_input_nodes:
            if i not in inside and i not in match.inputs:
                return f"{n.name} reads {i.name}, which is neither inside nor an input"
    return ""


def _collapse(gm: fx.GraphModule, match: RegionMatch, technique: str, index: int) -> fx.Node:
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, i in enumerate(match.inputs):
        env[i] = sub.placeholder(f"in_{k}")
        env[i].meta = dict(i.meta)
    for n in match.nodes:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(env[match.nodes[-1]])
    last = match.nodes[-1]
    kind = technique.replace(" ", "_")
    region = Region(technique, kind, tuple(str(n.target) for n in match.nodes), fx.GraphModule(torch.nn.Module(), sub))
    with gm.graph.inserting_before(last):
        node = gm.graph.create_node("call_function", region, tuple(match.inputs), {}, name=f"region_{kind}_{index}")
    node.meta = dict(last.meta)
    last.replace_all_uses_with(node)
    for n in reversed(match.nodes):
        gm.graph.erase_node(n)
    return node
