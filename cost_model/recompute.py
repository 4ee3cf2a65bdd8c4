"""Activation recompute (checkpointing) of repeated blocks: what it saves, what it costs.

A run of repeated blocks (``blocks.0``, ``blocks.1``, ...: ``cost_model.blocks``) is either kept
(every activation stays alive until its backward, as ``cost_model.costs`` prices it) or
recomputed: the runtime wraps each block's lowered region in a non-reentrant
``torch.utils.checkpoint`` (``passes/recompute_regions.py``), so a block keeps only its input
and re-runs its forward, collectives included, when its backward needs the activations (the
full recompute of Megatron-LM, arXiv 2205.05198, and torchtitan's per-block ``apply_ac``).

Priced as a decision of the strategy ILP (``cost_model.ilp``: one binary per block run, joint
with every layout and ZeRO choice), on the existing memory model (every activation kept for
backward is summed):

* memory: the decisions whose output leaves its block (the residual stream the next block
  reads) keep their activation in every copy; every other activation of the block, and every
  gathered panel a contraction in it keeps (``EdgeTerm.memory``), is alive for one block at a
  time, during that block's backward: it counts once instead of ``count`` times;
* time: each copy runs the forward of its ops again (the nodes' and their followers' forward
  compute), the forward collectives of the reshards into its ops and of its runtime algorithms
  (ring attention, SUMMA, the sharded layer norm).

Selective recompute (``"selective"``; Megatron-LM's selective recompute of the attention core,
arXiv 2205.05198, taken here as each block's attention submodule: projections, attention, output
projection) is the same term over the ops of one segment per block: the segment keeps its inputs
(the normalized residual stream) and its output, and recomputes the rest. Pinned
(``"selective"``), or one of the ILP's choices under ``"auto"``: per run, keep, recompute the
attention segment, or recompute the whole block (at most one term of a run chosen); not offered
under pipeline stages yet (their stages pin full or none: ``autopar.pipeline_search``).

A ZeRO-3 weight gathered inside a recomputed block is gathered again by the recompute instead
of ``runtime.fsdp``'s backward re-gather (``evaluate`` counts one, not both). Not yet priced: the
forward collectives of reshards folded into followers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from autopar.strategy import Layout, Strategy

from .blocks import attention_segment_of, block_of, split_recompute_entry
from .comm import bytes_sent_per_rank
from .costs import RECOMPUTE_MODES, TrainingSpec, compute_seconds
from .hardware import Hardware
from .reshard import CommStep, reshard_steps, steps_seconds

__all__ = ["RECOMPUTE_MODES", "RecomputeTerm", "add_recompute", "recompute_effect", "chosen_recompute",
           "recomputed_keys", "recompute_transient_bytes"]


@dataclass
class RecomputeTerm:
    """Recompute of one run of repeated blocks (``prefix``), chosen by ``choice[key]`` (0 or 1)."""

    key: str
    prefix: str
    pinned: bool | None  # True: always recompute; None: the ILP chooses
    # decision key -> per option (extra seconds, activation bytes saved, forward algorithm steps per copy)
    decisions: dict[str, list[tuple[float, float, list[CommStep]]]] = field(default_factory=dict)
    # edge index -> (producer layout, consumer layout) -> (extra seconds, bytes saved, forward steps per copy)
    edges: dict[int, dict[tuple[Layout, Layout], tuple[float, float, list[CommStep]]]] = field(default_factory=dict)
    boundary: frozenset[str] = frozenset()  # decision keys whose output leaves the block (kept)
    keys: frozenset[str] = frozenset()  # every decision of the block's ops


def _boundary_keys(problem, keys: set[str], home_of: Callable[[fx.Node], object] = block_of) -> frozenset[str]:
    """Decisions of ``keys`` whose node (or a follower folded into it) is read outside its block."""
    nodes = {n.name: n for d in problem.decisions.values() for n in d.node.graph.nodes} if problem.decisions else {}
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for key in keys:
        members[key].append(problem.decisions[key].node)
    for name, (root, _) in problem.followers.items():
        if root in keys and name in nodes:
            members[root].append(nodes[name])
    out = set()
    for key, ns in members.items():
        home = home_of(problem.decisions[key].node)
        if any(home_of(u) != home for n in ns for u in n.users):
            out.add(key)
    return frozenset(out)


def _segment_home(node: fx.Node) -> tuple:
    return block_of(node), attention_segment_of(node)


def add_recompute(problem, hw: Hardware, train: TrainingSpec,
                  forward_algorithm_steps: Callable[[fx.Node, Strategy], list[CommStep]]) -> None:
    """Attach the recompute terms ``train.recompute`` asks for to ``problem`` (``Problem.recompute``):
    ``"none"`` none, ``"full"`` every block run recomputed, ``"auto"`` the ILP chooses,
    ``"selective"`` the attention segment of every block recomputed (term prefix ``blocks:attn``).
    ``forward_algorithm_steps`` gives the forward collectives of a node's runtime algorithm."""
    mode = train.recompute
    problem.recompute = []
    if mode == "none":
        return
    mesh = problem.mesh
    groups: dict[str, set[str]] = defaultdict(set)
    for key, d in problem.decisions.items():
        b = block_of(d.node)
        if b is None or d.is_param or d.node.op != "call_function":
            continue
        if mode in ("selective", "auto"):
            segment = attention_segment_of(d.node)
            if segment is not None:
                groups[f"{b[0]}:{segment}"].add(key)
        if mode != "selective":
            groups[b[0]].add(key)
    nodes = {n.name: n for n in next(iter(problem.decisions.values())).node.graph.nodes} if problem.decisions else {}
    followers_of: dict[str, list[str]] = defaultdict(list)
    for name, (root, _) in problem.followers.items():
        followers_of[root].append(name)
    edge_pairs: dict[int, dict] = {}  # edge index -> its pairs (the same in every term)
    forward: dict[tuple, tuple] = {}  # (id(a), id(b), bytes, grad) -> (forward steps, seconds)
    for prefix, keys in sorted(groups.items()):
        if mode == "auto" and max(problem.decisions[k].count for k in keys) < 2:
            continue  # one block: recompute would hold as much at its backward as keeping does
        # "auto" offers each run both ways, full and selective, at most one of them chosen
        # (``cost_model.ilp``: row ``recompute_one``)
        home_of = _segment_home if split_recompute_entry(prefix)[1] else block_of
        term = RecomputeTerm(f"recompute[{prefix}]", prefix, True if mode in ("full", "selective") else None,
                             boundary=_boundary_keys(problem, keys, home_of), keys=frozenset(keys))
        for key in sorted(keys):
            d = problem.decisions[key]
            keep = key in term.boundary
            per_option = []
            for i, (st, _) in enumerate(d.options):
                fwd = compute_seconds(d.node, st, mesh, hw, train, problem.needs_grad.get(d.node.name, False))[0]
                for f in followers_of.get(key, ()):
                    if f in nodes:
                        fst = problem.followers[f][1][i]
                        fwd += compute_seconds(nodes[f], fst, mesh, hw, train, problem.needs_grad.get(f, False))[0]
                saved = 0.0 if keep else d.memory_bytes[i] * (d.count - 1) / d.count
                steps = forward_algorithm_steps(d.node, st)
                extra = (fwd + (steps_seconds(steps, mesh) if steps else 0.0)) * d.count
                per_option.append((extra, saved, steps))
            term.decisions[key] = per_option
        for idx, e in enumerate(problem.edges):
            if e.consumer not in keys:
                continue
            pairs = edge_pairs.get(idx)
            if pairs is None:  # an edge in a block run and its attention segment: the same pairs
                pairs = edge_pairs[idx] = _edge_pairs(e, problem.decisions[e.consumer].count, mesh, forward)
            if pairs:
                term.edges[idx] = pairs.copy()
        problem.recompute.append(term)


def _edge_pairs(e, c: int, mesh, forward: dict[tuple, tuple]) -> dict:
    """(producer layout, consumer layout) -> (extra seconds, bytes saved, forward steps) of edge
    ``e`` into a recomputed block whose consumer has ``c`` copies; pairs with neither are left
    out. ``forward`` memoizes each reshard's forward steps and their seconds by the layouts'
    identities (the edges' layout lists share their Layout objects)."""
    pairs = {}
    for (a, b) in e.seconds:
        fkey = (id(a), id(b), e.total_bytes, e.needs_grad)
        hit = forward.get(fkey)
        if hit is None:
            fwd, _ = reshard_steps(a, b, e.total_bytes, mesh, e.needs_grad)
            hit = forward[fkey] = (fwd, steps_seconds(fwd, mesh) if fwd else 0.0, a, b)  # a, b keep their ids
        fwd, sec = hit[0], hit[1]
        extra = sec * e.count if fwd else 0.0
        saved = e.memory.get((a, b), 0.0) * (c - 1) / c if e.memory else 0.0  # no pair's hash where none keeps
        if extra or saved:
            pairs[(a, b)] = (extra, saved, fwd)
    return pairs


def chosen_recompute(problem, choice: dict) -> tuple[str, ...]:
    """The block runs (prefixes) a solved choice recomputes."""
    return tuple(t.prefix for t in getattr(problem, "recompute", ()) if t.pinned or choice.get(t.key, 0))


def recomputed_keys(problem, choice: dict) -> frozenset[str]:
    """The decisions whose ops a solved choice recomputes."""
    chosen = set(chosen_recompute(problem, choice))
    return frozenset(k for t in getattr(problem, "recompute", ()) if t.prefix in chosen for k in t.keys)


def recompute_effect(problem, choice: dict, shared: dict[int, int]) -> tuple[float, float, float, dict[str, float]]:
    """(extra compute seconds, extra communication seconds, activation bytes saved, extra bytes
    sent per collective) of the recompute ``choice`` makes; ``shared`` as ``evaluate.shared_reshards``."""
    mesh = problem.mesh
    compute_s = comm_s = saved_b = 0.0
    sent: dict[str, float] = defaultdict(float)
    chosen = set(chosen_recompute(problem, choice))
    for term in getattr(problem, "recompute", ()):
        if term.prefix not in chosen:
            continue
        for key, per_option in term.decisions.items():
            extra, saved, steps = per_option[choice[key]]
            count = problem.decisions[key].count
            step_s = steps_seconds(steps, mesh) * count if steps else 0.0
            compute_s += extra - step_s
            comm_s += step_s
            saved_b += saved
            for step in steps:
                sent[step.collective] += bytes_sent_per_rank(step.collective, step.nbytes, mesh.sizes[step.axis]) * count
        for idx, pairs in term.edges.items():
            e = problem.edges[idx]
            hit = pairs.get((e.producer_layouts[choice[e.producer]], e.consumer_layouts[choice[e.consumer]]))
            copies = e.count - shared.get(idx, 0)
            if hit is None or not copies:
                continue
            extra, saved, steps = hit
            comm_s += extra * copies / e.count
            saved_b += saved * copies / e.count
            for step in steps:
                sent[step.collective] += bytes_sent_per_rank(step.collective, step.nbytes,
                                                             mesh.sizes[step.axis]) * copies
    return compute_s, comm_s, saved_b, dict(sent)


def recompute_transient_bytes(problem, choice: dict) -> float:
    """Activation bytes of one copy of each recomputed block's ops (its non-boundary decisions and
    kept panels): alive only while that block's backward runs. A pipeline stage holds them once,
    however many micro-batches are in flight (``autopar.pipeline_search``)."""
    chosen = set(chosen_recompute(problem, choice))
    total = 0.0
    for term in getattr(problem, "recompute", ()):
        if term.prefix not in chosen:
            continue
        for key in term.keys - term.boundary:
            d = problem.decisions[key]
            total += d.memory_bytes[choice[key]] / d.count
        for idx, e in enumerate(problem.edges):
            if e.consumer in term.keys and e.memory:
                pair = (e.producer_layouts[choice[e.producer]], e.consumer_layouts[choice[e.consumer]])
                total += e.memory.get(pair, 0.0) / problem.decisions[e.consumer].count
    return total
