"""2D tensor parallelism (SUMMA / Optimus, arXiv 2104.05343) and SUMMA's panel loop.

In autopar's vocabulary a layout is one placement per mesh axis, so 2D tensor parallelism is a
region of the ordinary search space. For a linear layer ``Y = X W`` on a ``row x col`` grid: X's
rows are split over ``row``; weights are split over both axes (1/q^2 of every weight matrix per
device); the matmul runs with X's panel gathered along ``col`` and W's panel gathered along
``row``, and activations stay split on ``col`` too, so activation memory is 1/q^2 as well.

The technique adds the SUMMA variant of a linear layer's 2D strategies (:func:`summa_strategies`):
x and W taken as stored (input features split), one K panel at a time moved by broadcasts
(forward) and broadcasts + reduces (backward) instead of whole-panel all-gathers
(``runtime.summa``; priced by ``cost_model.algorithms.summa_steps``). Family ``2d``.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.cost_model.algorithms import summa_steps
from autopar.mesh import MeshSpec
from autopar.runtime.summa import summa_matmul
from autopar.strategy import Layout, Strategy

from .base import Family, LowerContext, PriceContext, Technique, register
from .pins import GridPin, pairs

__all__ = ["SUMMA", "summa_strategies", "summa_axes"]

NAME = "summa"
_OPS = frozenset({torch.ops.aten.linear.default})


def _with_code(layout: Layout, axis: int, placement) -> Layout:
    pl = list(layout.placements)
    pl[axis] = placement
    return Layout.interned(tuple(pl))


def summa_strategies(node: fx.Node, strategies, mesh: MeshSpec) -> list[Strategy]:
    """SUMMA variants of a linear layer's strategies on 2+ axis meshes.

    For a plain strategy that runs ``x @ W.T`` with x's rows split on axis ``r`` and whole on
    axis ``c``, W whole on ``r`` and its output features split on ``c`` (the 2D layout, whose
    inputs arrive by whole-panel all-gathers), the variant takes x with its input features
    split on ``c`` and W with its input features split on ``r``, as they are stored; it keeps
    no gathered panel."""
    if node.target not in _OPS or mesh.ndim < 2:
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
                st = Strategy((new_x, new_w) + tuple(s.inputs[2:]), s.outputs, technique=NAME)
                out[st] = None
    return list(out)


def summa_axes(node: fx.Node, strategy: Strategy) -> tuple[int, int] | None:
    """(row axis, col axis) when ``strategy`` of this linear layer is a SUMMA variant, else None."""
    if node.target not in _OPS or len(strategy.inputs) < 2:
        return None
    kdim = node.args[0].meta["val"].dim() - 1
    xl, wl = strategy.inputs[0], strategy.inputs[1]
    cols = [a for a in range(len(xl.codes)) if xl.codes[a] == kdim and wl.codes[a] == 0]
    rows = [a for a in range(len(xl.codes)) if wl.codes[a] == 1 and 0 <= xl.codes[a] < kdim]
    if len(cols) == 1 and len(rows) == 1:
        return rows[0], cols[0]
    return None


def _price(ctx: PriceContext, node: fx.Node, st: Strategy, backward: bool):
    r, c = summa_axes(node, st)
    x, w = node.args[0], node.args[1]
    x_local = st.inputs[0].local_shape(ctx.mesh, tuple(x.meta["val"].shape))
    n_local = st.inputs[1].local_shape(ctx.mesh, tuple(w.meta["val"].shape))[0]
    return summa_steps(math.prod(x_local[:-1]), w.meta["val"].shape[1], n_local, ctx.mesh.sizes[r],
                       ctx.mesh.sizes[c], r, c, ctx.train.activation_bytes_per_elem, ctx.needs.get(x.name, False),
                       ctx.needs.get(w.name, False), ctx.needs[node.name] and backward)


def _lower(ctx: LowerContext, node: fx.Node, st: Strategy, args: tuple, kwargs: dict) -> fx.Node:
    r, c = summa_axes(node, st)
    bound = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
    w_t = ctx.graph.call_function(torch.ops.aten.t.default, (bound["weight"],))
    out = ctx.graph.call_function(summa_matmul, (bound["input"], w_t, ctx.groups[r], ctx.groups[c]))
    if bound.get("bias") is not None:
        out = ctx.graph.call_function(torch.ops.aten.add.Tensor, (out, bound["bias"]))
    return out


def _meshes_2d(n: int, hw) -> list:
    return [(hw.mesh_spec(("row", "col"), (r, c)), GridPin((0,), (0,), (1,), (1,))) for r, c in pairs(n)]


SUMMA = register(Technique(
    name=NAME,
    title="SUMMA (2D matmul on stored panels: broadcasts and reduces per K panel)",
    ops=_OPS,
    runs=lambda node, st: summa_axes(node, st) is not None,
    strategies=summa_strategies,
    price=_price,
    lower=_lower,
    families=(Family("2d", "2D tensor parallel (SUMMA/Optimus) on a row x col grid", _meshes_2d, rank=30),),
))
