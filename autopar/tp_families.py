"""What a plan's layouts turned out to be, in the report's words: 1D / 2D / 2.5D / 3D tensor
parallel, and how its sequence parallelism runs attention.

The families themselves (their meshes and pins), the runtime algorithms (SUMMA, ring attention,
Optimus's layer norm) and their pricing and lowering are registered techniques
(``autopar.techniques``); this module reads a plan's strategies and their technique tags.
"""

from __future__ import annotations

import torch

from .passes.rules import tensor_leaves
from .techniques.base import technique, techniques
from .techniques import catalog  # noqa: F401 (imports every technique file, so each registers)
from .techniques.pins import LAYER_NORMS, batch_sizes, is_tensor_node

__all__ = ["layout_kind", "describe_parallelism"]

aten = torch.ops.aten


def layout_kind(plan) -> str:
    """What a plan's tensor layouts are, by where its weight matrices are split:

    ``"replicated"`` / ``"DP"`` (no weight used split), ``"1D"`` (weights used split on one
    axis, stored split on no other), ``"2D"`` (used split on one axis and stored split on a
    second, batch-splitting axis: SUMMA's panels), ``"2.5D"`` (2D plus an axis that splits the
    batch with weights replicated), ``"3D"`` (used split on two axes, stored split on a third);
    with ``+SP`` when some activation is split on its sequence dim on a tensor axis (Megatron-SP)
    or an attention runs as ring attention or over heads from a sequence split.
    """
    problem, choice = plan._problem, plan._choice
    if problem is None:
        return "unknown"
    used: dict[int, int] = {}
    stored: dict[int, int] = {}
    n_weights = n_uses = 0
    batch_axes: set[int] = set()
    batch_dims = batch_sizes(next(iter(problem.decisions.values())).node.graph)
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
                and int(val.shape[0]) in batch_dims:
            # inputs may arrive whole and be cut by the first op (a free slice): activations tell
            batch_axes |= {a for a, c in enumerate(st.output.codes) if c == 0}
        if d.is_param and val.dim() >= 2:
            n_weights += 1
            for a, c in enumerate(st.output.codes):
                if c >= 0:
                    stored[a] = stored.get(a, 0) + 1
        if node.op == "call_function" and st.technique is not None and technique(st.technique).sequence_parallel:
            sp = True  # e.g. ring attention
        if node.op == "call_function" and node.target in LAYER_NORMS and node.args[0].meta["val"].dim() >= 3 \
                and any(c == 1 for c in st.inputs[0].codes):
            sp = True  # layer norms on sequence-split activations (Megatron-SP)
    graph = next(iter(problem.decisions.values())).node.graph
    for node in graph.nodes:
        if node.op != "call_function" or node.name not in problem.rep_of:
            continue
        st = problem.strategy_of(node.name, choice)
        leaves = tensor_leaves(node.args, node.kwargs, is_tensor_node)
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
        problem, choice = plan._problem, plan._choice
        runs: dict[str, list] = {}  # technique name -> the (node, strategy) pairs it runs
        seq_axes: set[int] = set()
        for key, d in problem.decisions.items():
            st, _ = d.options[choice[key]]
            node = d.node
            val = node.meta.get("val")
            if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 2:
                seq_axes |= {a for a, c in enumerate(st.output.codes) if c == 1}
            if node.op == "call_function" and st.technique is not None:
                runs.setdefault(st.technique, []).append((node, st))
            if node.op == "call_function" and node.target in (aten.layer_norm.default,):
                seq_axes |= {a for a, c in enumerate(st.inputs[0].codes) if c == 1}
        how = [t.report(runs[t.name], plan.mesh.axes) for t in techniques() if t.report is not None and t.name in runs]
        axes = ", ".join(plan.mesh.axes[a] for a in sorted(seq_axes)) or "-"
        lines.append(f"sequence parallel: activations split on the sequence over {axes}"
                     + (f"; {'; '.join(how)}" if how else "; layer norms and residuals sequence-split around "
                                                        "tensor-parallel regions (Megatron-SP)"))
    return lines

