"""Which storage a reader that saves a moved input really keeps (for ``liveness``).

An op's output counts as kept for backward when the op or one of its readers saves it
(``saved_inputs.kept_output``): a fact about the graph, the same for every layout. But when the
reader takes the tensor in another layout, the runtime moves it first (``passes.lower``: an
all-gather, an all-to-all, a slice copied out of it) and the reader saves the *moved* tensor, a
storage of its own; the producer's output is then freed once the move has read it. So under a
chosen plan the producer's output is kept only where some saving reader reads it in place (or
as a view: a slice of dim 0 is one); otherwise what stays is each moved copy, in the reader's
layout. A contraction's moved copy is already counted as the edge's panel
(``problem.saved_panel_bytes``); other readers' copies (a layer norm reading its sequence
slice of a replicated residual stream) are added here.

Measured on bench/fidelity.py's GPT under Megatron with sequence parallelism (4 CPU ranks,
``bench/memwhere.py``): the residual adds run replicated and the layer norms read their
sequence slices; the walk kept each add's whole output (1 MiB per add, 8 adds) where the run
keeps a quarter of it, and predicted 76.8 MiB for a 68.5 MiB peak.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopar.mesh import MeshSpec
from autopar.strategy import Layout

from .costs import is_view
from .reshard import Transition, transitions
from .saved_inputs import SAVING_CONTRACTIONS, saved_facts

__all__ = ["new_storage", "moved_copy", "moved_read_changes"]



def new_storage(t: Transition, mesh: MeshSpec) -> bool:
    """Whether the runtime's step ``t`` makes a new tensor: it runs on an axis of more than one
    device and is not a slice of dim 0 (``collectives.local_slice`` of dim 0 returns a view)."""
    return mesh.sizes[t.axis] > 1 and not (t.kind == "slice" and t.dst == 0)


def moved_copy(a: Layout, b: Layout, mesh: MeshSpec) -> bool:
    """Whether moving a tensor from ``a`` to ``b`` makes a new storage."""
    return any(new_storage(t, mesh) for t in transitions(a, b))


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [x for x in pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]


def _priced(problem, name: str) -> bool:
    key = problem.rep_of.get(name)
    return key is not None and (key in problem.decisions or key in problem.followers)


def _count(problem, name: str) -> int:
    key = problem.rep_of.get(name, name)
    if key in problem.followers:
        key = problem.followers[key][0]
    return problem.decisions[key].count if key in problem.decisions else 1


def moved_read_changes(problem, choice: dict[str, int], graph_nodes) -> list[tuple[fx.Node, float, int]]:
    """(node, bytes to add to its kept activations over all copies, copies) under ``choice``:
    minus the output of every op whose saving readers all read a moved copy, plus each moved
    copy a non-contraction reader saves (one per layout), at that reader (a repeated block's
    first copy of it, where the block's decisions stand) when it runs as often as the producer."""
    mesh, needs, train = problem.mesh, problem.needs_grad, problem.train
    by_name = {n.name: n for n in graph_nodes}
    out: list[tuple[fx.Node, float, int]] = []
    for n in graph_nodes:
        if n.op != "call_function" or is_view(n) or not needs.get(n.name) or problem.rep_of.get(n.name) != n.name \
                or not _priced(problem, n.name):
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or saved_facts(n, needs).output:
            continue
        a = problem.strategy_of(n.name, choice).outputs[0]
        readers, in_place = [], False
        for u in n.users:
            if u.op != "call_function" or is_view(u):
                in_place = in_place or u.op == "call_function"  # a view's readers: left as counted
                continue
            saved = saved_facts(u, needs).inputs
            ks = [k for k, x in enumerate(_tensor_inputs(u)) if x is n and k in saved]
            if not ks:
                continue
            rep = by_name.get(problem.rep_of.get(u.name, u.name), u)
            if not _priced(problem, rep.name):
                in_place = True  # a reader without a strategy: left as counted
                continue
            st = problem.strategy_of(rep.name, choice)
            for k in ks:
                b = st.inputs[k]
                if moved_copy(a, b, mesh):
                    readers.append((rep, b))
                else:
                    in_place = True
        if in_place or not readers:
            continue
        copies = _count(problem, n.name)
        total = val.numel() * train.activation_bytes_per_elem
        out.append((n, -total * a.local_fraction(mesh) * copies, copies))
        panels = {b for u, b in readers if u.target in SAVING_CONTRACTIONS}
        for u, b in readers:
            if b not in panels:
                panels.add(b)
                # at the reader, or where its copies are not the producer's (an op before the blocks
                # read by the first block's copy only), at the producer: freed a little later
                at = u if _count(problem, u.name) == copies else n
                out.append((at, total * b.local_fraction(mesh) * copies, copies))
    return out
