"""The decision problem the ILP solves: one :class:`Decision` per node that chooses a layout,
reshard costs between them (:class:`EdgeTerm`), gradient all-reduces (:class:`SyncTerm`), and the
:class:`Problem` that holds them. ``cost_model.problem`` builds it from an annotated graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.mesh import MeshSpec
from autopar.strategy import Layout, Strategy

from .reshard import CommStep

__all__ = ["Decision", "EdgeTerm", "SyncTerm", "Problem"]


@dataclass
class Decision:
    """One choice among ``options`` (strategy, zero-axes); costs already multiplied by ``count``."""

    key: str
    node: fx.Node
    options: list[tuple[Strategy, tuple[int, ...]]]
    seconds: list[float]
    memory_bytes: list[float]
    count: int = 1
    is_param: bool = False
    # Reshards folded in from followers, per option: their seconds and their collectives.
    comm_seconds: list[float] = field(default_factory=list)
    comm_steps: list[list[tuple[CommStep, int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.comm_seconds:
            self.comm_seconds = [0.0] * len(self.options)
            self.comm_steps = [[] for _ in self.options]


@dataclass
class EdgeTerm:
    """Reshard cost between a producer's output layout and a consumer's input layout.

    ``producer_layouts[i]`` is the layout the tensor has under option i of the producer's
    decision (a follower's output is a function of its root's option); ``consumer_layouts[j]``
    the layout option j of the consumer needs."""

    producer: str
    consumer: str
    producer_layouts: list[Layout]
    consumer_layouts: list[Layout]
    seconds: dict[tuple[Layout, Layout], float]
    count: int = 1
    total_bytes: float = 0.0
    needs_grad: bool = False
    tensor: str = ""  # the tensor moved, as SyncTerm.tensor names it (ZeRO-3 pricing: cost_model/fsdp_pricing.py)
    input_index: int = -1  # which tensor input of the consumer it is
    sources: list[str] = field(default_factory=list)  # the actual tensor behind each of the ``count`` copies
    targets: list[fx.Node] = field(default_factory=list)  # the actual consumer node of each copy
    # Per (producer layout, consumer layout): bytes of the moved tensor the consumer keeps for its
    # backward (a contraction saving its gathered activation panel), over the copies whose op keeps it.
    memory: dict[tuple[Layout, Layout], float] = field(default_factory=dict)


@dataclass
class SyncTerm:
    """One gradient all-reduce of ``tensor`` on ``axis``, paid if any trigger option is chosen."""

    tensor: str
    axis: int
    seconds: float
    triggers: list[tuple[str, int]]  # (decision key, option index)
    nbytes: float = 0.0  # per-rank bytes of the all-reduce, per copy
    count: int = 1
    # The parameter decision whose gradient this is (the tensor is the parameter or a follower
    # of it), or "": a ZeRO-2 option of that parameter on ``axis`` reduce-scatters it instead.
    param: str = ""
    layout: Layout | None = None  # the consumer's layout of the tensor (replicated on ``axis``)
    # consumer decision key -> the actual tensors whose all-reduce it triggers (``count`` is all of
    # them: the ILP's estimate; ``active_count`` the exact number under a choice)
    sources: dict[str, set[str]] = field(default_factory=dict)

    def active_count(self, choice: dict[str, int]) -> int:
        """How many actual tensors' all-reduces the chosen options trigger (0: none)."""
        active = {k for k, i in self.triggers if choice[k] == i}
        if not active:
            return 0
        if not self.sources:
            return self.count
        return len(set().union(*(self.sources.get(k, set()) for k in active))) or self.count


@dataclass
class Problem:
    mesh: MeshSpec
    decisions: dict[str, Decision]
    edges: list[EdgeTerm]
    syncs: list[SyncTerm]
    rep_of: dict[str, str]  # every node name -> the decision key it shares
    counts: dict[str, int] = field(default_factory=dict)
    # Followers: node name -> (root decision key, per root option: (strategy of the node, its output layouts))
    followers: dict[str, tuple[str, list[Strategy]]] = field(default_factory=dict)
    needs_grad: dict[str, bool] = field(default_factory=dict)  # node name -> it needs a gradient
    optimizer: str = "adamw"  # TrainingSpec.optimizer: LAMB/LARS add norm all-reduces (optimizer_norms.py)
    # Activation recompute of repeated blocks the ILP may choose (cost_model/recompute.py)
    recompute: list = field(default_factory=list)
    host: Any = None  # ZeRO-Offload: host bytes per parameter option (cost_model/offload.HostMemory)
    comm_overlap: float = 0.0  # Hardware.comm_overlap: asynchronous collectives hidden (cost_model/overlap.py)
    # efficiency x memory bandwidth: a pipeline stage's gradient accumulation (autopar/pipeline_parts.py)
    stream_bytes_per_s: float = 0.0
    train: Any = None  # the TrainingSpec it was priced for (cost_model/liveness.py reads it)
    # parameter decision key -> its share of its ZeRO unit's elements (``cost_model.blocks.unit_key``):
    # the share of a unit collective's latency it pays (``comm.unit_collective_s``)
    unit_shares: dict[str, float] = field(default_factory=dict)
    stage: Any = None  # a pipeline stage's StageWeights: what its ILP weighs (cost_model/stage_weights.py)

    def strategy_of(self, name: str, choice: dict[str, int]) -> Strategy:
        """The strategy node ``name`` runs under a solved ``choice``."""
        key = self.rep_of[name]
        if key in self.followers:
            root, per_option = self.followers[key]
            return per_option[choice[root]]
        return self.decisions[key].options[choice[key]][0]

    def n_variables(self) -> int:
        n = sum(len(d.options) for d in self.decisions.values())
        n += sum(len(e.seconds) for e in self.edges)
        return n + len(self.syncs)
