"""The pins the built-in families share: restrictions on each node's (strategy, zero) options.

A pin is a frozen dataclass (``autopar.technique.Pin``): its fields are the family's parameters (which mesh
axes split the batch, which split the weights, ...), its ``__call__`` the predicate the cost
problem applies to every option, and its class settings ``zero2``/``strict`` what the problem
reads. Per-graph facts (the batch sizes, whether the model has repeated blocks) are memoized in
fields that take no part in equality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autopar.cost_model.blocks import block_of
from autopar.passes.rules import tensor_leaves

from autopar.technique import Pin

__all__ = ["ClassicPin", "GridPin", "SequencePin", "OuterDataAxis", "batch_sizes", "is_tensor_node", "ATTENTION",
           "LAYER_NORMS", "sequence_meshes", "pairs"]

aten = torch.ops.aten
ATTENTION = frozenset({aten.scaled_dot_product_attention.default})
LAYER_NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})


def is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _batch_dim_ok(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0


def batch_sizes(graph: fx.Graph) -> set[int]:
    """The leading dims of the graph's tensor inputs (the batch sizes activations may carry)."""
    return {int(n.meta["val"].shape[0]) for n in graph.nodes if n.op == "placeholder" and _batch_dim_ok(n)}


def _memo(cache: dict, graph: fx.Graph, compute) -> Any:
    key = id(graph)
    if key not in cache:
        cache[key] = compute(graph)
    return cache[key]


def _weight_positions(cache: dict, node: fx.Node) -> list[int]:
    """Positions of the node's tensor arguments that are weight matrices (parameters of 2+ dims)."""
    if node not in cache:
        cache[node] = [k for k, p in enumerate(tensor_leaves(node.args, node.kwargs, is_tensor_node))
                       if p.op == "get_attr" and p.meta["val"].dim() >= 2]
    return cache[node]


def _memo_field():
    return field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class ClassicPin(Pin):
    """What a classic family means (data parallel, ZeRO, Megatron), per option:

    * ``data_axes``: inputs batch-sharded; every activation whose leading dim is the batch stays
      batch-sharded (or partial, as a loss is) - no gathering the batch; parameters replicated
      (``zero3``: stored sharded, gathered for use); gradients and optimizer state split over the
      data axes with ``zero2`` (DeepSpeed ZeRO-2), else whole (DDP, FSDP);
    * ``tp_axes``: inputs whole; every weight matrix sharded (column or row parallel); layer
      norms see whole (``sp=False``) or sequence-sharded (``sp=True``, Megatron-SP) activations.
    """

    data_axes: tuple[int, ...] = ()
    tp_axes: tuple[int, ...] = ()
    zero3: bool = False
    sp: bool | None = None
    zero2: bool = False
    strict: bool = True
    _batches: dict = _memo_field()
    _weights: dict = _memo_field()

    def __call__(self, node: fx.Node, option) -> bool:
        strategy, zero_axes = option
        data_axes, tp_axes = self.data_axes, self.tp_axes
        val = node.meta.get("val")
        if node.op == "placeholder" and _batch_dim_ok(node):
            pl = strategy.output.placements
            return all(pl[a] == Shard(0) for a in data_axes) and all(isinstance(pl[a], Replicate) for a in tp_axes)
        if node.op == "get_attr":
            pl = strategy.output.placements
            if self.zero2:
                return set(data_axes) <= set(zero_axes) and all(isinstance(pl[a], Replicate) for a in data_axes)
            if zero_axes:
                return False
            if tp_axes and val.dim() >= 2 and not all(isinstance(pl[a], Shard) for a in tp_axes):
                return False
            if self.zero3:
                return all(isinstance(pl[a], Shard) for a in data_axes)
            return all(isinstance(pl[a], Replicate) for a in data_axes)
        if node.op != "call_function":
            return True
        for layout in (strategy.inputs[k] for k in _weight_positions(self._weights, node)):
            # weights are used whole on data axes and cut on tensor axes
            if not all(isinstance(layout.placements[a], Replicate) for a in data_axes):
                return False
            if not all(isinstance(layout.placements[a], Shard) for a in tp_axes):
                return False
        if data_axes and isinstance(val, torch.Tensor) and val.dim() > 0 \
                and val.shape[0] in _memo(self._batches, node.graph, batch_sizes):
            for layout in strategy.outputs:
                if not all(layout.placements[a] == Shard(0) or layout.codes[a] < -1 for a in data_axes):
                    return False
        if node.target in LAYER_NORMS and self.sp is not None and tp_axes:
            pl = strategy.inputs[0].placements
            want = (lambda p: p == Shard(1)) if self.sp else (lambda p: isinstance(p, Replicate))
            return all(want(pl[a]) for a in tp_axes)
        return True


@dataclass(frozen=True)
class OuterDataAxis(Pin):
    """The auto search's restriction on 3-axis meshes: the outermost axis is a data axis
    (batch-sharded activations, parameters replicated or ZeRO-sharded there) and the inner two
    axes are searched freely: the full 3-axis space is ~10x the variables of a 2-axis one.
    Non-strict: a batch that does not divide by the outer axis leaves the inputs free instead of
    the mesh out."""

    strict: bool = False

    def __call__(self, node: fx.Node, option) -> bool:
        strategy, _ = option
        if node.op == "get_attr":
            return True
        if node.op == "placeholder":
            return not _batch_dim_ok(node) or strategy.output.placements[0] == Shard(0)
        outs_ok = all(l.placements[0] == Shard(0) or l.has_partial and not isinstance(l.placements[0], Shard)
                      for l in strategy.outputs)
        ins_ok = all(isinstance(l.placements[0], (Replicate,)) or l.placements[0] == Shard(0)
                     for l in strategy.inputs)
        return outs_ok and ins_ok


def _has_blocks(graph: fx.Graph) -> bool:
    return any(block_of(n) is not None for n in graph.nodes if n.op == "call_function")


@dataclass(frozen=True)
class GridPin(Pin):
    """The options of a multi-dimensional tensor-parallel family (2D, 2.5D, 3D):

    * inputs batch-split on ``batch_axes``; activations with a batch leading dim stay split
      there (no gathering the batch);
    * weight matrices (parameters of 2+ dims) stored split on ``tp_axes`` and on ``zero3_axes``
      (a subset of the batch axes: stored split, gathered for use, as SUMMA's weight panels),
      replicated on the other batch axes (2.5D's depth), and used whole on the batch axes and
      split on every tensor axis (a SUMMA strategy takes W as stored, split on its row axis);
    * activations with a batch leading dim split (or Partial) on each of ``split_axes`` too:
      activation memory falls with every axis, as the algorithms' does.

    The op constraints hold inside the repeated blocks (the transformer layers the papers
    parallelize); embeddings, the output head and the loss are left to the ILP (a 3D-split
    vocabulary projection would reduce-scatter and re-gather the logits, the largest tensor).
    """

    batch_axes: tuple[int, ...] = ()
    zero3_axes: tuple[int, ...] = ()
    tp_axes: tuple[int, ...] = ()
    split_axes: tuple[int, ...] = ()
    summa: str = "summa"  # the technique whose strategies take W as stored
    _batches: dict = _memo_field()
    _layered: dict = _memo_field()
    _weights: dict = _memo_field()

    def __call__(self, node: fx.Node, option) -> bool:
        strategy, zero_axes = option
        batch_axes, zero3_axes, tp_axes = self.batch_axes, self.zero3_axes, self.tp_axes
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return True
        if node.op == "placeholder":
            pl = strategy.output.placements
            return val.dim() == 0 or all(pl[a] == Shard(0) for a in batch_axes)
        if node.op == "get_attr":
            if zero_axes:
                return False
            pl = strategy.output.placements
            if val.dim() >= 2:
                return (all(isinstance(pl[a], Shard) for a in tp_axes + zero3_axes)
                        and all(isinstance(pl[a], Replicate) for a in batch_axes if a not in zero3_axes))
            return all(isinstance(pl[a], Replicate) for a in batch_axes if a not in zero3_axes)
        if node.op != "call_function":
            return True
        if _memo(self._layered, node.graph, _has_blocks) and block_of(node) is None:
            return True  # embeddings, output head and loss: the ILP lays them out freely
        summa_row = _summa_row_axis(node, strategy) if strategy.technique == self.summa else None
        for layout in (strategy.inputs[k] for k in _weight_positions(self._weights, node)):
            pl = layout.placements
            if not all(isinstance(pl[a], Replicate) or a == summa_row for a in batch_axes):
                return False
            if not all(isinstance(pl[a], Shard) for a in tp_axes):
                return False
            if len({layout.codes[a] for a in tp_axes}) < len(tp_axes):
                return False  # 3D cuts k on one axis and n on the other, not one dim twice
        if val.dim() > 0 and int(val.shape[0]) in _memo(self._batches, node.graph, batch_sizes):
            for layout in strategy.outputs:
                pl = layout.placements
                if not all(pl[a] == Shard(0) or layout.codes[a] < -1 for a in batch_axes):  # split, or partial there
                    return False
                if not all(not isinstance(pl[a], Replicate) for a in self.split_axes):
                    return False
        return True


def _summa_row_axis(node: fx.Node, strategy) -> int | None:
    """The axis a SUMMA linear layer's W arrives split on (its input features, as stored; x's
    rows are split there), or None."""
    kdim = node.args[0].meta["val"].dim() - 1
    xl, wl = strategy.inputs[0], strategy.inputs[1]
    rows = [a for a in range(len(xl.codes)) if wl.codes[a] == 1 and 0 <= xl.codes[a] < kdim]
    return rows[0] if len(rows) == 1 else None


@dataclass(frozen=True)
class SequencePin(Pin):
    """Sequence parallelism on ``sp_axis``: token inputs split on their sequence dim (dim 1),
    weights replicated there (gradients all-reduced, as data parallel), activations with a
    batch leading dim never whole on the axis (split on sequence, or on heads inside
    attention). ``attention``: the technique every attention must run as (``"ring_attention"``
    keeps Q, K, V sequence-split; ``"ulysses"`` splits them over heads by all-to-all from the
    sequence split), None: either."""

    sp_axis: int = 0
    batch_axes: tuple[int, ...] = ()
    attention: str | None = None
    _batches: dict = _memo_field()

    def on_mesh(self, sizes: tuple[int, ...]) -> Pin:
        if sizes[self.sp_axis] == 1:  # nothing to split the sequence over: data parallel on the rest
            return ClassicPin(tuple(a for a in self.batch_axes if sizes[a] > 1), ())
        return super().on_mesh(sizes)

    def __call__(self, node: fx.Node, option) -> bool:
        strategy, zero_axes = option
        sp_axis, batch_axes = self.sp_axis, self.batch_axes
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return True
        if node.op == "placeholder":
            pl = strategy.output.placements
            if val.dim() == 0:
                return True
            if not all(pl[a] == Shard(0) for a in batch_axes):
                return False
            return val.dim() < 2 or pl[sp_axis] == Shard(1)
        if node.op == "get_attr":
            pl = strategy.output.placements
            return not zero_axes and all(isinstance(pl[a], Replicate) for a in (sp_axis,) + batch_axes)
        if node.op != "call_function":
            return True
        for p, layout in zip(tensor_leaves(node.args, node.kwargs, is_tensor_node), strategy.inputs):
            if p.op == "get_attr" and not isinstance(layout.placements[sp_axis], Replicate):
                return False
        if node.target in ATTENTION and self.attention is not None:
            seq = node.args[0].meta["val"].dim() - 2
            q_code = strategy.inputs[0].codes[sp_axis]
            if self.attention == "ring_attention" and not (q_code == seq and strategy.technique == self.attention):
                return False
            if self.attention == "ulysses" and q_code != 1:  # over heads, from the sequence split
                return False
        if val.dim() > 1 and int(val.shape[0]) in _memo(self._batches, node.graph, batch_sizes):
            for layout in strategy.outputs:
                pl = layout.placements
                if isinstance(pl[sp_axis], Replicate):
                    return False
                if not all(pl[a] == Shard(0) or layout.codes[a] < -1 for a in batch_axes):  # split, or partial there
                    return False
        return True


def sequence_meshes(n: int, hw, attention: str | None) -> list:
    """(mesh, pin) candidates of sequence parallelism on n devices: ``sp=n``, and ``dp x sp``
    for dp of 2, 4, 8; every attention run as technique ``attention`` (None: as the ILP likes)."""
    out = [(hw.mesh_spec(("sp",), (n,)), SequencePin(0, (), attention))]
    for dp in (2, 4, 8):
        if n % dp == 0 and n // dp >= 2:
            out.append((hw.mesh_spec(("dp", "sp"), (dp, n // dp)), SequencePin(1, (0,), attention)))
    return out


def pairs(n: int) -> list[tuple[int, int]]:
    """(rows, cols) with both >= 2 and rows x cols = n, squarest first."""
    out = [(a, n // a) for a in range(2, n) if n % a == 0 and n // a >= 2]
    return sorted(out, key=lambda rc: (abs(math.log(rc[0] / rc[1])), rc[0]))
