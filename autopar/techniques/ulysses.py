"""Ulysses sequence parallelism (arXiv 2309.14509): activations split on the sequence, and
attention re-split over heads by all-to-all from the sequence split.

There is no kernel of its own: the all-to-alls are the reshards from a sequence split to a
heads split that ``cost_model.reshard`` prices and ``passes.lower`` emits. A strategy of an
attention with Q split on its heads (dim 1) that is not ring attention is this technique's (the
report names it). Families: ``ulysses`` (every attention over heads) and ``sp`` (sequence
parallel, each attention as the ILP likes: over heads or as ring attention).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.strategy import Strategy

from .base import Family, Technique, register
from .pins import ATTENTION, sequence_meshes

__all__ = ["ULYSSES"]


def _runs(node: fx.Node, st: Strategy) -> bool:
    if node.target not in ATTENTION or len(st.inputs) < 2:
        return False
    seq_dim = node.args[1].meta["val"].dim() - 2
    ring = any(c == seq_dim for c in st.inputs[1].codes)  # K sequence-split: ring attention's
    return not ring and any(c == 1 for c in st.inputs[0].codes)


def _report(runs: list, axis_names) -> str:
    return "attention over heads (Ulysses: all-to-all from the sequence split)"


ULYSSES = register(Technique(
    name="ulysses",
    title="Ulysses (attention over heads, all-to-all from the sequence split)",
    ops=ATTENTION,
    runs=_runs,
    report=_report,
    families=(
        Family("sp", "sequence parallel, each attention over heads or as ring attention",
               lambda n, hw: sequence_meshes(n, hw, None), rank=40),
        Family("ulysses", "sequence parallel, every attention over heads (all-to-all)",
               lambda n, hw: sequence_meshes(n, hw, "ulysses"), rank=41),
    ),
))
