"""Multi-dimensional tensor parallelism (2D, 2.5D, 3D) and sequence parallelism, as pins.

In autopar's vocabulary a layout is one placement per mesh axis, so the classic
multi-dimensional algorithms are regions of the ordinary search space, not new machinery. For
a linear layer ``Y = X W`` (X: rows = batch x sequence, k = input features; W: k x n):

* **2D** (SUMMA / Optimus, arXiv 2104.05343) on a ``row x col`` grid: X's rows are split over
  ``row``; weights are split over both axes (1/q^2 of every weight matrix per device). The
  matmul runs with X's panel gathered along ``col`` and W's panel gathered along ``row`` (the
  SUMMA exchange; ``runtime.summa`` runs it as the broadcast loop where the whole-panel gather
  would hold more memory), and activations stay split on ``col`` too (hidden, heads or
  sequence), so activation memory is 1/q^2 as well.
* **2.5D** (Tesseract, arXiv 2105.14500) on ``dep x row x col``: 2D on ``row x col``, and the
  ``dep`` axis splits the rows again with the weights replicated over it (their gradients
  all-reduced there): parameter memory 1/q^2, activations 1/(d q^2).
* **3D** (arXiv 2105.14450) on ``x y z``: rows split over ``x`` (weights stored split there
  and gathered for use), and the weight used split on both ``y`` and ``z`` (one axis cuts k,
  giving a Partial output that is reduce-scattered: the 3D matmul's reduce-scatter; the other
  cuts n): 1/q^3 of weights, activations and compute per device.
* **SP**: activations split on the sequence dim over an ``sp`` axis, weights replicated there;
  attention either re-splits Q, K, V over heads by all-to-all (Ulysses, arXiv 2309.14509) or
  passes K/V blocks around the ring with an online softmax (ring attention, arXiv 2310.01889).
  ``ring`` and ``ulysses`` pin one of the two; ``sp`` lets the ILP choose per attention.

Each family here is a mesh shape and a pin (a predicate on a node's options, as the classic
baselines in ``autopar.planner`` are). ``auto`` searches the same space unpinned, and
:func:`layout_kind` names what a plan turned out to be.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from .mesh import MeshSpec
from .passes.rules import tensor_leaves

__all__ = ["TP_FAMILIES", "SP_FAMILIES", "family_meshes", "layout_kind", "describe_parallelism", "is_ring_attention",
           "ring_axes", "grid_pin", "sp_pin"]

aten = torch.ops.aten
TP_FAMILIES = ("2d", "2.5d", "3d")
SP_FAMILIES = ("sp", "ulysses", "ring")
_ATTENTION = {aten.scaled_dot_product_attention.default}
RING_TARGETS = _ATTENTION
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}

Pin = Callable[[fx.Node, Any], bool]


def _is_tensor_node(x: Any) -> bool:
    return isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def _batch_sizes(graph: fx.Graph) -> set[int]:
    return {int(n.meta["val"].shape[0]) for n in graph.nodes
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0}


def is_ring_attention(node: fx.Node, strategy) -> bool:
    """True when ``strategy`` runs this attention as ring attention: K split on its sequence
    dim on some axis (plain attention needs whole keys; only the ring algorithm can run it)."""
    if node.target not in _ATTENTION or len(strategy.inputs) < 2:
        return False
    k_layout = strategy.inputs[1]
    seq_dim = node.args[1].meta["val"].dim() - 2
    return any(c == seq_dim for c in k_layout.codes)


def ring_axes(node: fx.Node, strategy) -> tuple[int, ...]:
    """The mesh axes whose ring the attention runs on (K sequence-split there)."""
    seq_dim = node.args[1].meta["val"].dim() - 2
    return tuple(a for a, c in enumerate(strategy.inputs[1].codes) if c == seq_dim)


def grid_pin(batch_axes: Sequence[int], zero3_axes: Sequence[int], tp_axes: Sequence[int],
             split_axes: Sequence[int] = ()) -> Pin:
    """The options of a multi-dimensional tensor-parallel family:

    * inputs batch-split on ``batch_axes``; activations with a batch leading dim stay split
      there (no gathering the batch);
    * weight matrices (parameters of 2+ dims) stored split on ``tp_axes`` and on ``zero3_axes``
      (a subset of the batch axes: stored split, gathered for use, as SUMMA's weight panels),
      replicated on the other batch axes (2.5D's depth), and used whole on the batch axes and
      split on every tensor axis;
    * activations with a batch leading dim split (or Partial) on each of ``split_axes`` too:
      activation memory falls with every axis, as the algorithms' does.

    The op constraints hold inside the repeated blocks (the transformer layers the papers
    parallelize); embeddings, the output head and the loss are left to the ILP (a 3D-split
    vocabulary projection would reduce-scatter and re-gather the logits, the largest tensor).
    """
    batch_axes, zero3_axes, tp_axes, split_axes = map(tuple, (batch_axes, zero3_axes, tp_axes, split_axes))
    cache: dict[int, set[int]] = {}
    weight_positions: dict[fx.Node, list[int]] = {}

    def batches(node: fx.Node) -> set[int]:
        if id(node.graph) not in cache:
            cache[id(node.graph)] = _batch_sizes(node.graph)
        return cache[id(node.graph)]

    layered: dict[int, bool] = {}

    def in_layers(node: fx.Node) -> bool:
        """Inside a repeated block (the transformer layers the algorithms are about); every
        node when the model has no repeated blocks."""
        from autopar.cost_model.problem import _block_of

        key = id(node.graph)
        if key not in layered:
            layered[key] = any(_block_of(n) is not None for n in node.graph.nodes if n.op == "call_function")
        return not layered[key] or _block_of(node) is not None

    def pin(node: fx.Node, option) -> bool:
        strategy, zero_axes = option
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
        if not in_layers(node):
            return True  # embeddings, output head and loss: the ILP lays them out freely
        if node not in weight_positions:
            weight_positions[node] = [k for k, p in enumerate(tensor_leaves(node.args, node.kwargs, _is_tensor_node))
                                      if p.op == "get_attr" and p.meta["val"].dim() >= 2]
        summa = summa_axes(node, strategy)
        for layout in (strategy.inputs[k] for k in weight_positions[node]):
            pl = layout.placements
            # (SUMMA takes W as stored, split on the row axis too: its panel loop moves it)
            if not all(isinstance(pl[a], Replicate) or (summa and a == summa[0]) for a in batch_axes):
                return False
            if not all(isinstance(pl[a], Shard) for a in tp_axes):
                return False
            if len({layout.codes[a] for a in tp_axes}) < len(tp_axes):
                return False  # 3D cuts k on one axis and n on the other, not one dim twice
        if val.dim() > 0 and int(val.shape[0]) in batches(node):
            for layout in strategy.outputs:
                pl = layout.placements
                if not all(pl[a] == Shard(0) or layout.codes[a] < -1 for a in batch_axes):  # split, or partial there
                    return False
                if not all(not isinstance(pl[a], Replicate) for a in split_axes):
                    return False
        return True

    pin.zero2 = False
    pin.strict = True
    return pin


def sp_pin(sp_axis: int, batch_axes: Sequence[int] = (), attention: str | None = None) -> Pin:
    """Sequence parallelism on ``sp_axis``: token inputs split on their sequence dim (dim 1),
    weights replicated there (gradients all-reduced, as data parallel), activations with a
    batch leading dim never whole on the axis (split on sequence, or on heads inside
    attention). ``attention``: ``"ring"`` keeps Q, K, V sequence-split (ring attention),
    ``"ulysses"`` splits them over heads (all-to-all from the sequence split), None: either."""
    batch_axes = tuple(batch_axes)
    cache: dict[int, set[int]] = {}

    def pin(node: fx.Node, option) -> bool:
        strategy, zero_axes = option
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
        if id(node.graph) not in cache:
            cache[id(node.graph)] = _batch_sizes(node.graph)
        for p, layout in zip(tensor_leaves(node.args, node.kwargs, _is_tensor_node), strategy.inputs):
            if p.op == "get_attr" and not isinstance(layout.placements[sp_axis], Replicate):
                return False
        if node.target in _ATTENTION and attention is not None:
            seq = node.args[0].meta["val"].dim() - 2
            q_code = strategy.inputs[0].codes[sp_axis]
            if attention == "ring" and not (q_code == seq and is_ring_attention(node, strategy)):
                return False
            if attention == "ulysses" and q_code != 1:
                return False
        if val.dim() > 1 and int(val.shape[0]) in cache[id(node.graph)]:
            for layout in strategy.outputs:
                pl = layout.placements
                if isinstance(pl[sp_axis], Replicate):
                    return False
                if not all(pl[a] == Shard(0) or layout.codes[a] < -1 for a in batch_axes):  # split, or partial there
                    return False
        return True

    pin.zero2 = False
    pin.strict = True
    return pin


def _pairs(n: int) -> list[tuple[int, int]]:
    """(rows, cols) with both >= 2, squarest first."""
    out = [(a, n // a) for a in range(2, n) if n % a == 0 and n // a >= 2]
    return sorted(out, key=lambda rc: (abs(math.log(rc[0] / rc[1])), rc[0]))


def family_meshes(family: str, n: int, hw) -> list[tuple[MeshSpec, Pin]]:
    """Candidate (mesh, pin) pairs of a multi-dimensional or sequence-parallel family on n devices."""
    out: list[tuple[MeshSpec, Pin]] = []
    if family == "2d":
        for r, c in _pairs(n):
            out.append((hw.mesh_spec(("row", "col"), (r, c)), grid_pin([0], [0], [1], [1])))
    elif family == "2.5d":
        for q in range(2, int(math.isqrt(n // 2)) + 1):
            if n % (q * q) == 0 and n // (q * q) >= 2:
                out.append((hw.mesh_spec(("dep", "row", "col"), (n // (q * q), q, q)),
                            grid_pin([0, 1], [1], [2], [2])))
    elif family == "3d":
        cube = round(n ** (1 / 3))
        sizes = [(cube, cube, cube)] if cube ** 3 == n and cube >= 2 else [
            (a, b, n // (a * b)) for a in range(2, n) for b in range(2, n)
            if n % (a * b) == 0 and n // (a * b) >= 2]
        for s in sizes[:6]:
            out.append((hw.mesh_spec(("x", "y", "z"), s), grid_pin([0], [0], [1, 2], [1, 2])))
    elif family in SP_FAMILIES:
        attention = None if family == "sp" else family
        out.append((hw.mesh_spec(("sp",), (n,)), sp_pin(0, (), attention)))
        for dp in (2, 4, 8):
            if n % dp == 0 and n // dp >= 2:
                out.append((hw.mesh_spec(("dp", "sp"), (dp, n // dp)), sp_pin(1, (0,), attention)))
    else:
        raise ValueError(f"not a multi-dimensional or sequence-parallel family: {family!r}")
    return out


def layout_kind(plan) -> str:
    """What a plan's tensor layouts are, by where its weight matrices are split:

    ``"replicated"`` / ``"DP"`` (no weight used split), ``"1D"`` (weights used split on one
    axis, stored split on no other), ``"2D"`` (used split on one axis and stored split on a
    second, batch-splitting axis: SUMMA's panels), ``"2.5D"`` (2D plus an axis that splits the
    batch with weights replicated), ``"3D"`` (used split on two axes, stored split on a third);
    with ``+SP`` when some activation is split on its sequence dim on a tensor axis (Megatron-SP)
    or an attention runs as ring attention or over heads from a sequence split.
    """
    problem, choice = plan.problem, plan.choice
    if problem is None:
        return "unknown"
    used: dict[int, int] = {}
    stored: dict[int, int] = {}
    n_weights = n_uses = 0
    batch_axes: set[int] = set()
    batch_sizes = _batch_sizes(next(iter(problem.decisions.values())).node.graph)
    sp = False
    for key, d in problem.decisions.items():
        node = d.node
        st, zero_axes = d.options[choice[key]]
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 1:
            batch_axes |= {a for a, c in enumerate(st.output.codes) if c == 0}
            # dim 1 is the sequence of token ids (b, s) and of (b, s, h) inputs; of a float
            # (rows, features) input it is the features
            seq_input = val.dim() >= 3 or (val.dim() == 2 and not val.dtype.is_floating_point)
            if seq_input and any(c == 1 for c in st.output.codes):
                sp = True
        if node.op == "call_function" and isinstance(val, torch.Tensor) and val.dim() >= 2 \
                and int(val.shape[0]) in batch_sizes:
            # inputs may arrive whole and be cut by the first op (a free slice): activations tell
            batch_axes |= {a for a, c in enumerate(st.output.codes) if c == 0}
        if d.is_param and val.dim() >= 2:
            n_weights += 1
            for a, c in enumerate(st.output.codes):
                if c >= 0:
                    stored[a] = stored.get(a, 0) + 1
        if node.op == "call_function" and node.target in _ATTENTION and is_ring_attention(node, st):
            sp = True
        if node.op == "call_function" and node.target in _NORMS and node.args[0].meta["val"].dim() >= 3 \
                and any(c == 1 for c in st.inputs[0].codes):
            sp = True  # layer norms on sequence-split activations (Megatron-SP)
    graph = next(iter(problem.decisions.values())).node.graph
    for node in graph.nodes:
        if node.op != "call_function" or node.name not in problem.rep_of:
            continue
        st = problem.strategy_of(node.name, choice)
        leaves = tensor_leaves(node.args, node.kwargs, _is_tensor_node)
        for p, layout in zip(leaves, st.inputs):
            if p.op == "get_attr" and p.meta["val"].dim() >= 2:
                n_uses += 1
                for a, c in enumerate(layout.codes):
                    if c >= 0:
                        used[a] = used.get(a, 0) + 1
    if not n_weights:
        return "replicated"
    # an axis counts where at least half of the weight matrices (half of their uses) are split on it
    used_axes = {a for a, k in used.items() if k * 2 >= n_uses}
    stored_axes = {a for a, k in stored.items() if k * 2 >= n_weights}
    if not used_axes:
        kind = "DP" if batch_axes else ("" if sp else "replicated")
    elif len(used_axes) >= 2:  # (SUMMA uses weights as stored: split on both grid axes)
        if stored_axes - used_axes:
            kind = "3D"
        else:
            kind = "2.5D" if batch_axes - used_axes - stored_axes else "2D"
    else:
        gathered = (stored_axes - used_axes) & batch_axes  # split in storage, whole in use: panels
        if not gathered:
            kind = "1D"
        else:
            depth = batch_axes - stored_axes - used_axes
            kind = "2.5D" if depth else "2D"
    return "+".join(k for k in (kind, "SP" if sp else "") if k)


_KIND_WORDS = {
    "replicated": "replicated (every device runs the whole model)",
    "DP": "data parallel (weights whole on every device in use)",
    "1D": "1D tensor parallel (Megatron: each weight matrix split on one axis)",
    "2D": "2D tensor parallel (SUMMA/Optimus: weight panels split on two axes, rows of the activations on one)",
    "2.5D": "2.5D tensor parallel (Tesseract: 2D on two axes, the batch split again over a depth axis)",
    "3D": "3D tensor parallel (weights split on three axes; the matmul's k and n on two of them)",
}


def describe_parallelism(plan) -> list[str]:
    """Report lines naming the plan's tensor layout family and its sequence parallelism."""
    kind = layout_kind(plan)
    if kind == "unknown":
        return []
    base, _, sp = kind.partition("+")
    if base == "SP":
        base, sp = "", "SP"
    lines = [f"parallelism: {_KIND_WORDS.get(base, base) if base else 'sequence parallel only'}"]
    if sp or base == "":
        problem, choice = plan.problem, plan.choice
        ring, heads = [], []
        seq_axes: set[int] = set()
        for key, d in problem.decisions.items():
            st, _ = d.options[choice[key]]
            node = d.node
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 2:
                seq_axes |= {a for a, c in enumerate(st.output.codes) if c == 1}
            if node.op == "call_function" and node.target in _ATTENTION:
                if is_ring_attention(node, st):
                    ring += [plan.mesh.axes[a] for a in ring_axes(node, st)]
                elif any(c == 1 for c in st.inputs[0].codes):
                    heads.append(node.name)
            if node.op == "call_function" and node.target in (aten.layer_norm.default,):
                seq_axes |= {a for a, c in enumerate(st.inputs[0].codes) if c == 1}
        how = []
        if ring:
            how.append(f"ring attention over {', '.join(sorted(set(ring)))} (K/V blocks passed around the ring)")
        if heads:
            how.append("attention over heads (Ulysses: all-to-all from the sequence split)")
        axes = ", ".join(plan.mesh.axes[a] for a in sorted(seq_axes)) or "-"
        lines.append(f"sequence parallel: activations split on the sequence over {axes}"
                     + (f"; {'; '.join(how)}" if how else "; layer norms and residuals sequence-split around "
                                                        "tensor-parallel regions (Megatron-SP)"))
    return lines


# --- SUMMA: the 2D matmul as its own strategy ------------------------------------------------------

def _with_code(layout, axis: int, placement):
    from autopar.strategy import Layout

    pl = list(layout.placements)
    pl[axis] = placement
    return Layout.interned(tuple(pl))


def summa_strategies(node: fx.Node, strategies, mesh: MeshSpec) -> list:
    """SUMMA variants of a linear layer's strategies on 2+ axis meshes (``runtime.summa``).

    For a plain strategy that runs ``x @ W.T`` with x's rows split on axis ``r`` and whole on
    axis ``c``, W whole on ``r`` and its output features split on ``c`` (the 2D layout, whose
    inputs arrive by whole-panel all-gathers), the variant takes x with its input features
    split on ``c`` and W with its input features split on ``r``, as they are stored, and moves
    one K panel at a time by broadcasts (forward) and broadcasts + reduces (backward). Its
    sends are priced by ``cost_model.algorithms.summa_steps``; it keeps no gathered panel."""
    from autopar.strategy import Strategy

    if node.target is not aten.linear.default or mesh.ndim < 2:
        return []
    x, w = node.args[0].meta["val"], node.args[1].meta["val"]
    if w.dim() != 2 or x.dim() < 2:
        return []
    kdim = x.dim() - 1
    out: dict = {}
    for s in strategies:
        xl, wl, y = s.inputs[0], s.inputs[1], s.outputs[0]
        for r in range(mesh.ndim):
            for c in range(mesh.ndim):
                if r == c or mesh.sizes[r] < 2 or mesh.sizes[c] < 2:
                    continue
                if not (0 <= xl.codes[r] < kdim and xl.codes[c] < 0 and not xl.has_partial
                        and wl.codes[r] < 0 and wl.codes[c] == 0 and y.codes[r] == xl.codes[r]
                        and y.codes[c] == kdim):
                    continue
                others = [a for a in range(mesh.ndim) if a not in (r, c)]
                if any(xl.codes[a] == kdim or wl.codes[a] >= 0 or wl.codes[a] < -1 for a in others):
                    continue
                new_x = _with_code(xl, c, Shard(kdim))
                new_w = _with_code(wl, r, Shard(1))
                if not (new_x.divides(mesh, x.shape) and new_w.divides(mesh, w.shape)):
                    continue
                st = Strategy((new_x, new_w) + tuple(s.inputs[2:]), s.outputs)
                out[st] = None
    return list(out)


def summa_axes(node: fx.Node, strategy) -> tuple[int, int] | None:
    """(row axis, col axis) when ``strategy`` of this linear layer is a SUMMA variant, else None."""
    if node.target is not aten.linear.default or len(strategy.inputs) < 2:
        return None
    kdim = node.args[0].meta["val"].dim() - 1
    xl, wl = strategy.inputs[0], strategy.inputs[1]
    cols = [a for a in range(len(xl.codes)) if xl.codes[a] == kdim and wl.codes[a] == 0]
    rows = [a for a in range(len(xl.codes)) if wl.codes[a] == 1 and 0 <= xl.codes[a] < kdim]
    if len(cols) == 1 and len(rows) == 1:
        return rows[0], cols[0]
    return None


def sharded_norm_axis(node: fx.Node, strategy) -> int | None:
    """The axis over which this layer norm's hidden dim is split (Optimus's layer norm,
    ``runtime.sharded_norm``), or None."""
    if node.target is not aten.layer_norm.default or not strategy.inputs:
        return None
    last = node.args[0].meta["val"].dim() - 1
    axes = [a for a, c in enumerate(strategy.inputs[0].codes) if c == last]
    return axes[0] if len(axes) == 1 else None
