"""Expert parallelism (GShard, arXiv 2006.16668; DeepSpeed-MoE; Switch): the experts of each
mixture-of-experts block split over one mesh axis, tokens sent to the rank holding their expert
and back with all-to-all of uneven splits (``runtime.expert_parallel``).

This file is the whole technique, in the registry's shape (``autopar.technique``):

* **region** - :func:`_regions` finds each Hugging Face MoE block of the traced graph (Mixtral,
  Qwen-MoE in transformers 5: ``sort`` of the router's top-k experts, ``histc`` + ``cumsum``
  offsets, two grouped matmuls with an activation between, the router-weighted combine); the
  region pass collapses it into one node taking (hidden ``[T, H]``, top-k experts ``[T, K]``,
  top-k weights ``[T, K]``, ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
* **strategies** - :func:`_strategies`: per mesh axis the block is replicated, token-split
  (experts replicated: data parallel, their gradient all-reduced) or expert-split (tokens and
  experts split on the axis: this technique), at most one expert axis;
* **pricing** - :func:`_price`: the all-to-alls on the expert axis per block and step: the
  counts (``E`` int64) once, then dispatch and combine of every (token, slot) row in forward and
  again in backward. Bytes come from the router's *capacity* at factor 1 (each rank's
  ``T_local * K`` rows spread evenly over the experts: ``(ep - 1) / ep`` of them leave the rank),
  which is what a plan can know before running. The runtime sends the rows the router actually
  chose (uneven splits); ``runtime.expert_parallel.predict_bytes`` gives those from the measured
  counts, and the two agree exactly when routing is even (tests/test_expert_parallel.py);
* **lowering** - :func:`_lower`: the block becomes one call of
  ``runtime.expert_parallel.grouped_experts_moe`` on this rank's tokens and experts;
* **family** - ``strategy="ep"`` (``--strategy ep``): experts over one axis ``ep`` (every
  divisor of the device count; a ``dp`` axis takes the rest), everything else as the search likes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autopar.cost_model.problem import PinError
from autopar.cost_model.reshard import CommStep
from autopar.runtime.expert_parallel import grouped_experts_moe
from autopar.strategy import Layout, Strategy
from autopar.technique import Family, Pin, Region, RegionMatch, Technique, register

__all__ = ["EXPERT_PARALLEL", "ExpertPin", "expert_axis"]

NAME = "expert_parallel"
aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CASTS = {aten.to.dtype, aten._to_copy.default}
_ACT_OPS = {aten.silu.default: "silu", aten.gelu.default: "gelu", aten.relu.default: "relu"}
HIDDEN, INDEX, WEIGHTS, GATE_UP, DOWN = range(5)  # the region's inputs, in order


def _through_views(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n


def _is_grouped_mm(n: fx.Node) -> bool:
    return n.op == "call_function" and "grouped_mm" in str(n.target)


def _expert_weight(n: fx.Node) -> fx.Node | None:
    """The 3-D parameter a grouped matmul reads, as ``transpose(param, -2, -1)``."""
    if n.op == "call_function" and n.target is aten.transpose.int and n.args[0].op == "get_attr" \
            and n.args[0].meta["val"].dim() == 3:
        return n.args[0]
    return None


def _match(gate_up_mm: fx.Node, down_mm: fx.Node) -> RegionMatch | None:
    """The MoE block around two grouped matmuls sharing their offsets (module doc), or None."""
    w_gate_up, w_down = _expert_weight(gate_up_mm.args[1]), _expert_weight(down_mm.args[1])
    gather = gate_up_mm.args[0]
    while gather.op == "call_function" and (gather.target in _VIEWS or gather.target in _CASTS):
        gather = gather.args[0]
    if w_gate_up is None or w_down is None or gather.target is not aten.index.Tensor:
        return None
    hidden = gather.args[0]
    # the block's own sort is the last one the offsets depend on (an earlier block's sort is an
    # ancestor too, through the hidden states); picked by graph order, never by a set's order
    order = {n: i for i, n in enumerate(gate_up_mm.graph.nodes)}
    sorts = [n for n in _ancestors(gate_up_mm.args[2], set()) if n.target is aten.sort.default]
    if not sorts:
        return None
    sort = max(sorts, key=order.__getitem__)
    index = _through_views(sort.args[0])
    if not (index.target is operator.getitem and index.args[0].target is aten.topk.default):
        return None
    out = _combine(down_mm, hidden)
    if out is None:
        return None
    # the routing weights: a float 1-D gather, by the sorted order, of a value shaped like the
    # top-k index; candidates are taken in graph order (a set's order would make the match, and so
    # the graph's fingerprint, differ from one process to the next)
    weights = None
    for n in sorted(_ancestors(out, {hidden, index, w_gate_up, w_down}), key=order.__getitem__):
        if n.target is aten.index.Tensor and n.args[0] is not hidden and n.meta["val"].dim() == 1 \
                and n.meta["val"].is_floating_point():
            source = _through_views(n.args[0])
            if tuple(source.meta["val"].shape) == tuple(index.meta["val"].shape):
                weights = source
                break
    if weights is None:
        return None
    stops = {hidden, index, weights, w_gate_up, w_down}
    inside = _ancestors(out, stops) | {out}
    if any(n.op in ("placeholder", "get_attr") or order[n] < order[weights] for n in inside):
        return None
    acts = [n for n in inside if n.target in _ACT_OPS]
    if len(acts) != 1 or sum(_is_grouped_mm(n) for n in inside) != 2:
        return None
    return RegionMatch(tuple(sorted(inside, key=order.__getitem__)), (hidden, index, weights, w_gate_up, w_down))


def _ancestors(node: fx.Node, stops: set) -> set:
    seen, todo = set(), [node]
    while todo:
        for i in todo.pop().all_input_nodes:
            if i not in seen and i not in stops:
                seen.add(i)
                todo.append(i)
    return seen


def _combine(down_mm: fx.Node, hidden: fx.Node) -> fx.Node | None:
    """The first sum after the second grouped matmul whose value has the hidden states' shape."""
    todo, seen = [down_mm], set()
    shape = tuple(hidden.meta["val"].shape)
    while todo:
        n = todo.pop(0)
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target is aten.sum.dim_IntList and tuple(u.meta["val"].shape) == shape:
                return u
            todo.append(u)
    return None


def _regions(gm: fx.GraphModule) -> list[RegionMatch]:
    by_offsets: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if _is_grouped_mm(n) and len(n.args) >= 3 and isinstance(n.args[2], fx.Node):
            by_offsets.setdefault(n.args[2], []).append(n)
    out = []
    for mms in by_offsets.values():
        if len(mms) == 2:
            match = _match(*mms)
            if match is not None:
                out.append(match)
    return out


def _layout(placements) -> Layout:
    return Layout.interned(tuple(placements))


def _strategies(node: fx.Node, _rule: tuple, mesh) -> list[Strategy]:
    """Per axis: replicated, token-split or expert-split (module doc), at most one expert axis."""
    tokens = node.args[HIDDEN].meta["val"].shape[0]
    experts = node.args[GATE_UP].meta["val"].shape[0]
    out = []
    for choice in _product("RTE", mesh.ndim):
        if choice.count("E") > 1:
            continue
        split = math.prod(s for c, s in zip(choice, mesh.sizes) if c != "R")
        ep = math.prod(s for c, s in zip(choice, mesh.sizes) if c == "E")
        if tokens % split or experts % ep:
            continue
        tok = _layout(Replicate() if c == "R" else Shard(0) for c in choice)
        exp = _layout(Shard(0) if c == "E" else Replicate() for c in choice)
        out.append(Strategy((tok, tok, tok, exp, exp), (tok,)))
    return out


def _product(letters: str, n: int) -> list[str]:
    return [""] if n == 0 else [c + rest for c in letters for rest in _product(letters, n - 1)]


def expert_axis(strategy: Strategy) -> int | None:
    """The mesh axis a strategy of the MoE region splits the experts on, or None."""
    return next((a for a, c in enumerate(strategy.inputs[GATE_UP].codes) if c == 0), None)


def _runs(node: fx.Node, strategy: Strategy) -> bool:
    return expert_axis(strategy) is not None


def _price(ctx, node: fx.Node, strategy: Strategy, backward: bool) -> list[CommStep]:
    axis = expert_axis(strategy)
    if axis is None:
        return []
    hidden = node.args[HIDDEN].meta["val"]
    top_k = node.args[INDEX].meta["val"].shape[1]
    experts = node.args[GATE_UP].meta["val"].shape[0]
    token_split = math.prod(s for c, s in zip(strategy.inputs[HIDDEN].codes, ctx.mesh.sizes) if c == 0)
    # all_to_all's nbytes is the per-rank buffer, (ep - 1) / ep of which leaves the rank: at
    # capacity factor 1 that buffer is every (token, slot) row of this rank
    rows_bytes = ctx.tensor_bytes(hidden) / token_split * top_k
    passes = 4 if backward and ctx.needs.get(node.name, True) else 2  # dispatch + combine, then their backward
    return [CommStep("all_to_all", axis, experts * 8.0)] + [CommStep("all_to_all", axis, rows_bytes)] * passes


def _activation(node: fx.Node) -> str:
    region: Region = node.target
    return next(_ACT_OPS[n.target] for n in region.graph_module.graph.nodes if n.target in _ACT_OPS)


def _lower(ctx, node: fx.Node, strategy: Strategy, args: tuple, kwargs: dict) -> fx.Node:
    axis = expert_axis(strategy)
    experts = node.args[GATE_UP].meta["val"].shape[0]
    return ctx.graph.call_function(grouped_experts_moe, (*args, ctx.groups[axis], experts, _activation(node)))


def _report(runs: list, axis_names) -> str:
    axes = sorted({axis_names[expert_axis(s)] for _, s in runs})
    return f"expert parallel over {', '.join(axes)} ({len(runs)} MoE block{'s' if len(runs) > 1 else ''})"


@dataclass(frozen=True)
class ExpertPin(Pin):
    """``strategy="ep"``: every MoE block splits its experts over axis ``axis`` (of ``size``
    devices); every other node is left to the search."""

    axis: int = 0
    size: int = 1

    def __call__(self, node: fx.Node, option) -> bool:
        if not (isinstance(node.target, Region) and node.target.technique == NAME):
            return True
        experts = node.args[GATE_UP].meta["val"].shape[0]
        if experts % self.size:
            short = f"{experts} experts do not split over ep={self.size}"
            raise PinError(f"expert parallelism cannot be followed: {short}; pick a device count or an ep axis "
                           f"that divides {experts}", short)
        return expert_axis(option[0]) == self.axis


def _meshes(n: int, hw) -> list:
    out = [(hw.mesh_spec(("ep",), (n,)), ExpertPin(0, n))] if n > 1 else []
    for ep in range(2, n):
        if n % ep == 0:
            out.append((hw.mesh_spec(("dp", "ep"), (n // ep, ep)), ExpertPin(1, ep)))
    return out


EXPERT_PARALLEL = register(Technique(
    name=NAME,
    title="expert parallel (experts split over an axis, tokens by all-to-all)",
    regions=_regions,
    strategies=_strategies,
    runs=_runs,
    price=_price,
    lower=_lower,
    report=_report,
    families=(Family("ep", "experts split over one axis, tokens dispatched and combined by all-to-all", _meshes,
                     rank=45),),
))
