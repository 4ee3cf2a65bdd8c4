"""split_stages: a traced graph -> one GraphModule per pipeline stage, cut at block boundaries.

Blocks are the entries of the model's repeated container (``blocks.0``, ``blocks.1``, ... as
``nn_module_stack`` in ``node.meta`` names them, the same blocks the cost model shares decisions
over). ``stage_blocks`` says how many consecutive blocks each stage holds; nodes before the first
block (embeddings) join stage 0, nodes after the last block (head, loss) join the last stage.

The stages form a chain, as ``torch.distributed.pipelining`` runs them: stage 0 takes the
model's inputs, stage k > 0 takes exactly what stage k - 1 returns, and every value a later
stage needs is threaded through the stages in between (the targets of a loss, a residual that
skips a stage). ``torch.fx.passes.split_module`` hands each piece the values it uses from any
earlier piece, which is not a chain; this pass writes the threading itself.

A weight used by several stages (an embedding tied to the head, as GPT-2, OPT, BERT and T5
do) goes into each of them: every holding stage keeps a copy, and ``StageGraphs.tied`` names
the stages per weight, for the once-per-step all-reduce of its gradient between them
(Megatron-LM and DeepSpeed keep the first and last stage's copies in sync the same way).

Written to ``node.meta`` of each stage graph: ``node.meta["autopar_requires_grad"]``
(:data:`REQUIRES_GRAD_KEY`) is ``True`` on a floating-point stage input that comes from an
earlier stage, so the cost model and the lowering treat its gradient like an activation's
(it is sent back to the previous stage).
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from autopar.cost_model.blocks import block_of
from autopar.errors import AutoparError

__all__ = ["split_stages", "block_count", "block_container", "even_stage_blocks", "REQUIRES_GRAD_KEY", "StageGraphs"]

REQUIRES_GRAD_KEY = "autopar_requires_grad"


def block_container(gm: fx.GraphModule) -> tuple[str, list[int]]:
    """The repeated-block container with the most blocks and its block indices."""
    seen: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            b = block_of(n)
            if b is not None:
                seen.setdefault(b[0], set()).add(b[1])
    if not seen:
        raise AutoparError("pipeline stages are cut at repeated blocks (an nn.ModuleList such as "
                           "`blocks.0`, `blocks.1`, ...) and this model has none; use a model with a "
                           "ModuleList of layers, or plan without pipeline stages (strategy other than 'pp')")
    prefix = max(seen, key=lambda p: len(seen[p]))
    return prefix, sorted(seen[prefix])


def block_count(gm: fx.GraphModule) -> int:
    """How many repeated blocks a pipeline can be cut between."""
    return len(block_container(gm)[1])


def even_stage_blocks(n_blocks: int, n_stages: int) -> tuple[int, ...]:
    """Blocks per stage, as even as they divide (earlier stages get the remainder)."""
    if not 1 <= n_stages <= n_blocks:
        raise AutoparError(f"{n_stages} pipeline stages need at least as many blocks, and the model has "
                           f"{n_blocks}; use pp <= {n_blocks}")
    q, r = divmod(n_blocks, n_stages)
    return tuple(q + (1 if k < r else 0) for k in range(n_stages))


class StageGraphs(list):
    """The stage GraphModules, in order; ``.inputs[k]`` / ``.outputs[k]`` name the values each
    stage takes and returns (original node names); ``.tied`` maps a weight used by several
    stages (its target) to those stages."""

    inputs: list[list[str]]
    outputs: list[list[str]]
    tied: dict[str, tuple[int, ...]]


def _assign(gm: fx.GraphModule, stage_blocks: tuple[int, ...]) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    prefix, indices = block_container(gm)
    if sum(stage_blocks) != len(indices) or min(stage_blocks) < 1:
        raise AutoparError(f"stage_blocks {tuple(stage_blocks)} must be positive and add up to the model's "
                           f"{len(indices)} blocks (`{prefix}.*`)")
    stage_of_block, k = {}, 0
    for s, count in enumerate(stage_blocks):
        for _ in range(count):
            stage_of_block[indices[k]] = s
            k += 1
    stage: dict[str, int] = {}
    current = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        b = block_of(n)
        if b is not None and b[0] == prefix:
            current = max(current, stage_of_block[b[1]])  # stages only move forward
        stage[n.name] = current
    holders: dict[str, tuple[int, ...]] = {}  # a weight joins the stages of its users
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            used = sorted({stage[u.name] for u in n.users if u.name in stage}) or [0]
            stage[n.name] = used[0]
            holders[n.name] = tuple(used)
    return stage, holders


def _check_tied_names(gm: fx.GraphModule, nodes: list[fx.Node], holders: dict[str, tuple[int, ...]]) -> None:
    """One tensor under several names (tied weights the trace kept apart): the stages that use it
    must all use one of its names, which the runtime syncs; else refuse (the search skips it)."""
    by_tensor: dict[int, dict[str, set[int]]] = {}
    for n in nodes:
        if n.op == "get_attr":
            try:
                tensor = functools.reduce(getattr, str(n.target).split("."), gm)
            except AttributeError:
                continue
            by_tensor.setdefault(id(tensor), {}).setdefault(str(n.target), set()).update(holders[n.name])
    for names in by_tensor.values():
        stages = set().union(*names.values())
        if len(stages) > 1 and not any(s == stages for s in names.values()):
            raise AutoparError(f"weights {sorted(names)} are one tensor used by pipeline stages {sorted(stages)} under "
                               f"different names; pipeline stages sync a tied weight under one name only. Tie them "
                               f"to one module attribute, or plan without pipeline stages")


def split_stages(gm: fx.GraphModule, stage_blocks: tuple[int, ...]) -> StageGraphs:
    """The stage graphs of ``gm`` (see module doc). Each keeps the original node names and
    ``meta`` (shapes, module stacks), so a plan for a stage names the same nodes."""
    stage, holders = _assign(gm, tuple(stage_blocks))
    n_stages = len(stage_blocks)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    last_use: dict[str, int] = {}  # value -> the last stage that reads it
    for n in nodes:
        if n.op == "output":
            for x in n.all_input_nodes:
                last_use[x.name] = n_stages - 1
        elif n.name in stage:
            for x in n.all_input_nodes:
                last_use[x.name] = max(last_use.get(x.name, -1), stage[n.name])
    defined = {n.name: (-1 if n.op == "placeholder" else stage[n.name]) for n in nodes if n.op != "output"}
    order = {n.name: i for i, n in enumerate(nodes)}

    def live_into(k: int) -> list[str]:  # values made before stage k and read at k or later
        names = [v for v, d in defined.items()
                 if d < k and last_use.get(v, -1) >= k and nodes[order[v]].op != "get_attr"]
        return sorted(names, key=order.get)

    out = StageGraphs()
    out.inputs, out.outputs = [], []
    out.tied = {}
    for n in nodes:
        if n.op == "get_attr" and len(holders[n.name]) > 1:
            target = str(n.target)
            out.tied[target] = tuple(sorted(set(out.tied.get(target, ())) | set(holders[n.name])))
    _check_tied_names(gm, nodes, holders)
    for k in range(n_stages):
        ins = [p.name for p in placeholders] if k == 0 else live_into(k)
        outs = live_into(k + 1) if k < n_stages - 1 else None
        g = fx.Graph()
        env: dict[str, fx.Node] = {}
        for name in ins:
            src = nodes[order[name]]
            p = g.placeholder(name)
            p.meta = dict(src.meta)
            val = src.meta.get("val")
            if k > 0 and isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                p.meta[REQUIRES_GRAD_KEY] = True
            env[name] = p
        for n in nodes:
            if (n.op == "get_attr" and k in holders[n.name]) or (n.op == "call_function" and stage[n.name] == k):
                env[n.name] = g.node_copy(n, lambda x: env[x.name])
        if outs is None:
            g.output(torch.fx.node.map_arg(out_node.args[0], lambda x: env[x.name]))
        else:
            g.output(tuple(env[v] for v in outs))
        g.lint()
        out.append(fx.GraphModule(gm, g, class_name=f"Stage{k}"))
        out.inputs.append(ins)
        out.outputs.append(outs if outs is not None else [x.name for x in out_node.all_input_nodes])
    return out
