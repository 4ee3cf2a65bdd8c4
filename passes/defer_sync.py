"""Which gradient syncs of the lowered program run elsewhere, and how (a helper of ``lower``).

Two rewrites of the per-use gradient all-reduces ``lower`` emits (``grad_sync``), both exact:

* **Deferred (data parallel).** A parameter whose every gradient contribution passes through
  the same chain of ``grad_sync`` steps, with no reshard between the parameter and that chain
  (so the synced tensor is the parameter's local tensor, same size), gets the same result if
  the sum is taken once on the accumulated gradient: the all-reduce is linear and every step
  between it and the parameter is a view or an op whose backward is linear in the incoming
  gradient with coefficients that are equal on every rank of the synced axes (the tensor is
  replicated there). ``defer_param_syncs`` removes such chains from the program and returns the
  parameters and axes; ``runtime.grad_buckets`` all-reduces them bucketed and overlapped with
  the rest of backward. Bytes per tensor and axis are unchanged: one all-reduce of the
  parameter's local size, as ``cost_model.problem`` prices the sync.
* **Fused (ZeRO-3 / FSDP).** A parameter stored sharded on axis ``a`` and gathered whole on
  ``a`` for work split on ``a`` used to all-gather forward, then all-reduce the whole gradient and
  slice it. ``fsdp_axis`` names that axis when the gather is the last step of the reshard; the
  lowering then emits ``runtime.fsdp.fsdp_gather`` (backward: one reduce-scatter, which is the
  all-reduce followed by the slice) and no ``grad_sync`` on ``a``. The cost model prices the
  same rule (``cost_model.fsdp_pricing``, where ``fsdp_axis`` lives).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from autopar.cost_model.fsdp_pricing import fsdp_axis

__all__ = ["ParamUse", "fsdp_axis", "defer_param_syncs"]


@dataclass(frozen=True)
class ParamUse:
    """One read of a parameter (directly or through followers) by ``node`` in the lowering."""

    node: str
    by_follower: bool  # the reader is itself a follower (an intermediate step, not the use)
    syncs: tuple  # the grad_sync chain the value passed through (lowered nodes), outermost last
    resharded: bool  # a collective or slice moved the value between the parameter and its use


def _reads_only_by_ops(gm: fx.GraphModule, root_of: Callable[[fx.Node], str]) -> dict[str, bool]:
    """Per parameter node: every node carrying its value (itself, its followers) is read only by
    ops the lowering routes through ``input_value`` (so every gradient contribution is seen)."""
    ok: dict[str, bool] = {}
    for n in gm.graph.nodes:
        if n.op not in ("get_attr", "call_function"):
            continue
        root = root_of(n)
        if not root:
            continue
        good = all(u.op == "call_function" and u.target is not operator.getitem for u in n.users)
        ok[root] = ok.get(root, True) and good
    return ok


def defer_param_syncs(gm: fx.GraphModule, graph: fx.Graph, uses: dict[str, list[ParamUse]],
                      root_of: Callable[[fx.Node], str]) -> dict[str, tuple[fx.Node, ...]]:
    """Remove the deferrable parameters' ``grad_sync`` chains from ``graph`` (see module doc);
    returns {parameter target: the group nodes (``get_attr``) of its sync axes, in order}."""
    from autopar.runtime import collectives as C

    ok = _reads_only_by_ops(gm, root_of)
    by_param: dict[int, list[str]] = {}  # tied weights: one tensor under several parameter nodes
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.name in uses:
            by_param.setdefault(id(gm.get_parameter(str(n.target))), []).append(n.name)
    deferred: dict[str, tuple[fx.Node, ...]] = {}
    for roots in by_param.values():
        all_uses = [u for r in roots for u in uses[r]]
        terminal = [u for u in all_uses if not u.by_follower]
        if not terminal or not all(ok.get(r, False) for r in roots):
            continue
        chain = terminal[0].syncs
        if (not chain or any(u.syncs for u in all_uses if u.by_follower)
                or any(u.syncs != chain or u.resharded for u in terminal)
                or any(s.op != "call_function" or s.target is not C.grad_sync for s in chain)):
            continue
        keys = tuple(s.args[1] for s in chain)
        for s in reversed(chain):
            s.replace_all_uses_with(s.args[0])
            graph.erase_node(s)
        target = next(str(n.target) for n in gm.graph.nodes if n.name == roots[0])
        deferred[target] = keys
    return deferred
