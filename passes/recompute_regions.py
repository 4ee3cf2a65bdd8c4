"""recompute_regions: run each recomputed block of a lowered program under a checkpoint.

The plan names the runs of repeated blocks whose activations are recomputed
(``Plan.recompute``, priced by ``cost_model.recompute``). In the per-rank program, a block's
region is its ops (by their ``nn_module_stack``, which the lowering keeps) and the collectives
the lowering put in front of them (reshards of their inputs, gradient syncs); weights stay
outside (``get_attr``, ZeRO-2 gathers) and enter as arguments. Each region becomes a submodule
called through non-reentrant ``torch.utils.checkpoint``: its forward keeps no activation but
its inputs, and backward re-runs it, collectives included, as the cost model counts. Written
here because torch's own region tools (``torch.fx.passes.utils.fuser_utils``) outline a
partition but know nothing of checkpointing; the outlining itself is twenty lines.

Non-reentrant checkpointing stacks its own saved-tensor hooks over ``runtime.fsdp``'s: inside a
region, a ZeRO-3 weight is gathered again by the recompute, not by the backward re-gather.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from autopar.cost_model.blocks import attention_segment_of, block_of, split_recompute_entry
from autopar.errors import AutoparError
from autopar.runtime import collectives as C
from autopar.runtime import fsdp as F
from autopar.runtime.zero2 import zero2_gather_unit

__all__ = ["CheckpointedBlock", "checkpoint_blocks", "RECOMPUTED_KEY"]

RECOMPUTED_KEY = "autopar_recomputed_blocks"  # program.meta: the block names (``blocks.3``) checkpointed


class CheckpointedBlock(torch.nn.Module):
    """One block's lowered ops, run under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, inner: fx.GraphModule, name: str):
        super().__init__()
        self.inner = inner
        self.block = name

    def forward(self, *args):
        # The whole block runs again, as cost_model.recompute prices it: by default torch stops
        # the recompute after the last op that saved a tensor, which would leave out the block's
        # trailing ops and their collectives (the plan's bytes would not be what is sent).
        with set_checkpoint_early_stop(False):
            return checkpoint(self.inner, *args, use_reentrant=False)


def _unit_member(n: fx.Node) -> bool:
    """A ZeRO-2 unit gather's member (``operator.getitem`` of its result): a weight, outside."""
    return n.target is operator.getitem and getattr(n.args[0], "target", None) is zero2_gather_unit


def _owners(nodes: list[fx.Node], prefixes: frozenset[str]) -> list[tuple[str, int] | None]:
    """The recomputed region each node of the program belongs to, (entry, block index), or
    None. An entry is a run of blocks (``blocks``) or one segment of each (``blocks:attn``,
    selective recompute). Nodes the lowering made (no module stack: reshards, syncs) belong to
    the op they were made for, the next op."""
    segments = dict(split_recompute_entry(p) for p in prefixes)
    owner: list[tuple[str, int] | None] = [None] * len(nodes)
    nxt = None
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        if n.op != "call_function" or n.target in (C.zero2_gather, zero2_gather_unit) or _unit_member(n):
            continue  # weights stay outside
        if "nn_module_stack" in n.meta:
            b = block_of(n)
            nxt = None
            if b is not None and b[0] in segments:
                segment = segments[b[0]]
                if segment is None:
                    nxt = b
                elif attention_segment_of(n) == segment:
                    nxt = (f"{b[0]}:{segment}", b[1])
        owner[i] = nxt
    return owner


def _outline(program: fx.GraphModule, members: list[fx.Node], name: str) -> None:
    """Replace ``members`` (in program order) by one checkpointed call placed after the last."""
    inside = set(members)
    first, last = members[0], members[-1]
    node = first
    while node is not last:  # nothing between them may read the region (it would run too early)
        if node not in inside and any(a in inside for a in node.all_input_nodes):
            raise AutoparError(f"cannot recompute block {name}: op {node.name} between its ops reads "
                               f"{[a.name for a in node.all_input_nodes if a in inside]}; plan with recompute='none'")
        node = node.next
    inputs = list(dict.fromkeys(a for m in members for a in m.all_input_nodes if a not in inside))
    outputs = [m for m in members if any(u not in inside for u in m.users)]
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in inputs}
    for m in members:
        env[m] = graph.node_copy(m, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    attr = "recompute_" + name.replace(".", "_")
    program.add_submodule(attr, CheckpointedBlock(fx.GraphModule(torch.nn.Module(), graph), name))
    with program.graph.inserting_after(last):
        call = program.graph.call_module(attr, tuple(inputs))
    prev = call
    for k, o in enumerate(outputs):
        with program.graph.inserting_after(prev):
            prev = program.graph.call_function(operator.getitem, (call, k))
        o.replace_all_uses_with(prev, delete_user_cb=lambda u: u not in inside)
    for m in reversed(members):
        program.graph.erase_node(m)


def checkpoint_blocks(program: fx.GraphModule, prefixes: Sequence[str]) -> fx.GraphModule:
    """Wrap every block of the runs ``prefixes`` (``"blocks"``) in ``program`` in a
    ``CheckpointedBlock`` (module doc); in place, returned for chaining."""
    if not prefixes:
        return program
    # runtime.parallel_module enters runtime.fsdp's hooks only where the program gathers
    # ZeRO-3 weights; after outlining, those gathers may sit inside the regions only
    program.meta["autopar_fsdp_gathers"] = any(n.op == "call_function" and n.target is F.fsdp_gather
                                               for n in program.graph.nodes)
    nodes = list(program.graph.nodes)
    regions: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for n, b in zip(nodes, _owners(nodes, frozenset(prefixes))):
        if b is not None:
            regions[b].append(n)
    if not regions:
        raise AutoparError(f"the plan recomputes {', '.join(prefixes)} but the program has no op of those blocks; "
                           f"re-plan for this model")
    names = []
    for (entry, index), members in regions.items():
        prefix, segment = split_recompute_entry(entry)
        names.append(f"{prefix}.{index}" + (f".{segment}" if segment else ""))
        _outline(program, members, names[-1])
    program.graph.lint()
    program.recompile()
    program.meta[RECOMPUTED_KEY] = names
    return program
