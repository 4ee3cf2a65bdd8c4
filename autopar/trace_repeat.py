"""Trace a deep model with three of its repeated blocks and repeat the middle one.

A trace costs time in proportion to the model's depth: ``torch.export`` runs every op of every
block through FakeTensor dispatch (here gpt2-xl's 48 blocks take ~4 s, GPT-3 175B's 96 ~7 s),
while blocks that are alike give the same nodes each time. Where a ``ModuleList`` holds blocks
that are alike (``alike_blocks``: one class, the same parameter and buffer shapes, the same
settings but their index), the model is traced with its first three blocks only (the list is
swapped for the call and put back, in a ``finally``), and the graph is rebuilt at full depth:
block 1's nodes are copied for blocks 2 .. L-2, each copy reading the one before, and block 2's
nodes become block L-1, which the head reads. Node names, targets, arguments and shapes are
those the full trace gives (tests compare ``graph_fingerprint`` and the arguments on several
models); the runtime checks the fingerprint again against its own full trace.

Anything outside that pattern traces in full (``expand`` returns None): blocks whose settings
differ; a model, block or config holding a list of unequal per-block entries that a block may
index at run time (``config.layer_types``); blocks 0, 1 and 2 traced unlike each other (e.g. a
first block that computes a shared bias); a block reading one that is not its predecessor; ops
outside the blocks reading any block but the last (e.g. a penultimate layer's features); a
forward that fails or checks the block count with three blocks.

Where no library helps: torch.export has no way to trace a module once and reuse its graph
for its repeats (its ``nonstrict`` tracing always runs each call), so the copy is made here.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

__all__ = ["MIN_BLOCKS", "alike_blocks", "trace_repeated", "expand"]

# Fewer blocks save too little to be worth the copy (three are traced in any case).
MIN_BLOCKS = 5

# Attributes that name a block's own position, the one setting in which alike blocks differ.
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "idx", "index"})
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)
_SUFFIX = re.compile(r"^(.*?)_\d+$")


def alike_blocks(model: nn.Module) -> tuple[str, nn.Module, str, nn.ModuleList] | None:
    """(path, parent module, attribute name, list) of the deepest ``ModuleList`` of at least
    ``MIN_BLOCKS`` blocks that are alike, or None."""
    best = None
    for path, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= MIN_BLOCKS and (best is None or len(mod) > len(best[3])):
            if all(_alike(mod[0], b) for b in mod) and not _per_block_table(model, mod):
                parent_path, _, name = path.rpartition(".")
                best = (path, model.get_submodule(parent_path), name, mod)
    return best


def _per_block_table(model: nn.Module, blocks: nn.ModuleList) -> bool:
    """Whether the model, a block or a settings object they hold (a Hugging Face config) keeps a
    list with one unequal entry per block (e.g. ``config.layer_types``): a block may read its
    own entry by its index at run time, which its attributes do not show."""
    holders = [model, blocks[0]]
    holders += [v for h in list(holders) for v in vars(h).values()
                if hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor, type))]
    for h in holders:
        for v in vars(h).values():
            if isinstance(v, (list, tuple)) and len(v) == len(blocks) and not all(_same(v[0], x) for x in v):
                return True
    return False


def _alike(a: nn.Module, b: nn.Module) -> bool:
    """Same class (by name: a class made per instance counts as one), parameters, buffers,
    submodules and settings, but for the attributes naming the block's index."""
    if _class_name(a) != _class_name(b) or any((a._forward_hooks, b._forward_hooks, a._forward_pre_hooks,
                                                    b._forward_pre_hooks)):
        return False
    for own_a, own_b in ((a._parameters, b._parameters), (a._buffers, b._buffers)):
        if own_a.keys() != own_b.keys() or any(not _same_tensor(own_a[k], own_b[k]) for k in own_a):
            return False
    if a._modules.keys() != b._modules.keys() or not all(
            (a._modules[k] is None) == (b._modules[k] is None) and (a._modules[k] is None or _alike(a._modules[k],
                                                                                                 b._modules[k]))
            for k in a._modules):
        return False
    skip = {"_parameters", "_buffers", "_modules"} | _INDEX_NAMES
    keys = (set(a.__dict__) | set(b.__dict__)) - skip
    return all(k in a.__dict__ and k in b.__dict__ and _same(a.__dict__[k], b.__dict__[k]) for k in keys)


def _class_name(x: Any) -> tuple[str, str]:
    return type(x).__module__, type(x).__qualname__


def _same_tensor(x: Any, y: Any) -> bool:
    if x is None or y is None:
        return x is y
    return x.shape == y.shape and x.dtype == y.dtype and x.requires_grad == y.requires_grad and x.device == y.device


def _same(x: Any, y: Any, depth: int = 0) -> bool:
    if x is y:
        return True
    if isinstance(x, nn.Module) and isinstance(y, nn.Module):  # held outside _modules (e.g. a kernel wrapper)
        return _alike(x, y)
    if type(x) is not type(y) or depth > 4:
        return False
    if isinstance(x, _PLAIN):
        return x == y
    if isinstance(x, (tuple, list)) and len(x) == len(y):
        return all(_same(u, v, depth + 1) for u, v in zip(x, y))
    if isinstance(x, (set, frozenset)):
        return all(isinstance(v, _PLAIN) for v in x | y) and x == y
    if isinstance(x, dict) and x.keys() == y.keys():
        return all(_same(x[k], y[k], depth + 1) for k in x)
    if hasattr(x, "__dict__") and not isinstance(x, torch.Tensor) and not callable(getattr(x, "__func__", None)):
        # an object each block holds its own of (e.g. a kernel wrapper): alike if its fields are
        return _same(vars(x), vars(y), depth + 1)
    return False  # not known to be alike


def trace_repeated(model: nn.Module, trace_fn: Callable[[nn.Module], fx.GraphModule]) -> fx.GraphModule | None:
    """``model`` traced by ``trace_fn`` with three of its alike blocks and rebuilt at full depth,
    or None where it cannot be (the caller traces in full)."""
    found = alike_blocks(model)
    if found is None:
        return None
    path, parent, name, blocks = found
    setattr(parent, name, nn.ModuleList(list(blocks)[:3]))
    try:
        small = trace_fn(model)
    except Exception:  # e.g. a forward that checks the block count: the full trace tells the user
        return None
    finally:
        setattr(parent, name, blocks)
    return expand(small, path, blocks)


def _block(n: fx.Node, prefix: str) -> int | None:
    """The index of the block of the list at ``prefix`` that node ``n`` belongs to, or None: a
    weight's by its path, an op's by the module stack export records."""
    if n.op == "get_attr":
        m = re.match(rf"{re.escape(prefix)}\.(\d+)\.", str(n.target))
        return int(m.group(1)) if m else None
    if n.op != "call_function":
        return None
    for path, _ in (n.meta.get("nn_module_stack") or {}).values():
        m = re.fullmatch(rf"{re.escape(prefix)}\.(\d+)", path or "")
        if m:
            return int(m.group(1))
    return None


def _runs(nodes: list[fx.Node], prefix: str) -> list[tuple[int | None, list[fx.Node]]]:
    """Consecutive nodes grouped by the block of ``prefix`` they belong to (None: outside)."""
    out: list[tuple[int | None, list[fx.Node]]] = []
    for n in nodes:
        k = _block(n, prefix)
        if out and out[-1][0] == k:
            out[-1][1].append(n)
        else:
            out.append((k, [n]))
    return out


def expand(small: fx.GraphModule, prefix: str, blocks: nn.ModuleList) -> fx.GraphModule | None:
    """``small`` (traced with blocks 0, 1, 2 of the list ``blocks`` at ``prefix``) with its graph
    rebuilt for all of them (module doc) and their parameters; None where they do not repeat."""
    if any(n.op == "call_module" for n in small.graph.nodes):
        return None
    runs = _runs(list(small.graph.nodes), prefix)
    where: dict[fx.Node, tuple[int, int, int]] = {}  # node -> (block, its run of that block, position)
    seen: dict[int, int] = {0: 0, 1: 0, 2: 0}  # runs of each block so far
    by_key: dict[tuple[int, int], list[fx.Node]] = {}  # (block, its run) -> the run's nodes
    for b, nodes in runs:
        if b is None:
            continue
        if b not in seen:
            return None
        for j, n in enumerate(nodes):
            where[n] = (b, seen[b], j)
        by_key[(b, seen[b])] = nodes
        seen[b] += 1
    if not (seen[0] == seen[1] == seen[2] >= 1):
        return None
    # each run of block 2 comes right after the same run of block 1, itself after block 0's
    order = [b for b, _ in runs if b is not None]
    if order != [b for _ in range(seen[0]) for b in (0, 1, 2)]:
        return None
    for r in range(seen[0]):
        r0, r1, r2 = by_key[(0, r)], by_key[(1, r)], by_key[(2, r)]
        if not (len(r0) == len(r1) == len(r2)) or any(_op(x) != _op(y) or _op(y) != _op(z)
                                                      for x, y, z in zip(r0, r1, r2)):
            return None
        if any(_refs(y, where, 1) != _refs(z, where, 2) for y, z in zip(r1, r2)):
            return None
    for n in small.graph.nodes:  # outside the blocks, only the last block may be read
        if n not in where and any(isinstance(a, fx.Node) and where.get(a, (2,))[0] != 2 for a in n.all_input_nodes):
            return None
        if n.op == "get_attr" and n in where and n.name != str(n.target).replace(".", "_"):
            return None  # a block weight's node not named as its copies will be
    ops = [k for k, (b, nodes) in enumerate(runs) if b is not None and nodes[0].op == "call_function"]
    if any(b is None and any(n.op == "call_function" for n in nodes) for b, nodes in runs[ops[0]:ops[-1]]):
        return None  # ops between the blocks, outside them: run once per block in the full model
    return _rebuild(small, runs, where, by_key, prefix, blocks)


def _op(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
    target = n.target if n.op == "call_function" else re.sub(r"\.\d+\.", ".#.", str(n.target), count=1)
    return n.op, target, shape, len(n.args), tuple(sorted(n.kwargs))


def _refs(n: fx.Node, where: dict, b: int) -> tuple:
    """``n``'s arguments, with nodes of blocks told by their block relative to ``b``."""
    def one(a: Any) -> Any:
        if isinstance(a, fx.Node):
            w = where.get(a)
            return ("node", a.name) if w is None else ("block", w[0] - b, w[1], w[2])
        return a
    return tuple(fx.node.map_aggregate(n.args, one)), tuple(sorted(fx.node.map_aggregate(n.kwargs, one).items()))


def _rebuild(small, runs, where, by_key, prefix: str, blocks: nn.ModuleList) -> fx.GraphModule:
    n_blocks = len(blocks)
    graph = fx.Graph()
    graph.set_codegen(small.graph._codegen)  # the forward takes the user's inputs as export laid them out
    made: dict[tuple[int, int], list[fx.Node]] = {}  # (block, run) -> its new nodes
    env: dict[fx.Node, fx.Node] = {}

    def copy(n: fx.Node, src: int | None, dst: int | None) -> fx.Node:
        """``n`` (of block ``src``, None: outside the blocks) copied as a node of block ``dst``."""
        def arg(a: fx.Node) -> fx.Node:
            w = where.get(a)
            return env[a] if w is None or src is None else made[(dst + w[0] - src, w[1])][w[2]]
        if n.op == "get_attr":
            target = _moved(str(n.target), prefix, src, dst)
            new = graph.create_node("get_attr", target, name=n.name if src == dst else target.replace(".", "_"))
        elif n.op in ("placeholder", "output"):
            new = graph.node_copy(n, lambda a: env[a])
        else:
            base = _SUFFIX.match(n.name)
            new = graph.create_node(n.op, n.target, fx.node.map_arg(n.args, arg), fx.node.map_arg(n.kwargs, arg),
                                    name=base.group(1) if base else n.name, type_expr=n.type)
        new.meta = dict(n.meta)
        if src != dst and "nn_module_stack" in n.meta:
            new.meta["nn_module_stack"] = {_moved(k, prefix, src, dst): (_moved(p, prefix, src, dst), c)
                                           for k, (p, c) in n.meta["nn_module_stack"].items()}
        return new

    for b, nodes in runs:
        if b is None:
            for n in nodes:
                env[n] = copy(n, None, None)
            continue
        r = where[nodes[0]][1]
        if b == 2:  # block 1 again for blocks 2 .. L-2, then block 2 as the last
            for k in range(2, n_blocks - 1):
                made[(k, r)] = []
                for n in by_key[(1, r)]:
                    made[(k, r)].append(copy(n, 1, k))
        dst = n_blocks - 1 if b == 2 else b
        made[(dst, r)] = []
        for n in nodes:
            made[(dst, r)].append(copy(n, b, dst))
            env[n] = made[(dst, r)][-1]
    holder = small.get_submodule(prefix)  # the weights of blocks 2 .. L-1: the model's own
    for k in range(2, n_blocks):
        holder.add_module(str(k), blocks[k])
    small.graph = graph
    small.recompile()
    return small


def _moved(path: str, prefix: str, src: int, dst: int) -> str:
    """``path`` with block ``src`` of ``prefix`` renamed to block ``dst``."""
    if src == dst:
        return path
    return re.sub(rf"(^|(?<=[_.])){re.escape(prefix)}\.{src}(?=\.|$)", f"{prefix}.{dst}", path, count=1)
