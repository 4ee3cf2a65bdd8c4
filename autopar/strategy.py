"""The sharding vocabulary: layouts of torch's own placements, costs, and strategies.

A *layout* is one placement per mesh axis (torch's ``Shard(dim)``, ``Replicate()``,
``Partial(op)``), so plans stay interoperable with DTensor, FSDP2 and DCP. A *strategy* is,
for one graph node, the layout each tensor input must have, the layout of each output,
and the cost of running the node that way.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .mesh import MeshSpec

__all__ = ["Layout", "Cost", "Strategy", "placement_str", "Placement", "Shard", "Replicate", "Partial"]


def placement_str(p: Placement) -> str:
    """``S(0)``, ``R``, ``P`` (sum) or ``P(avg)``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    if isinstance(p, Replicate):
        return "R"
    return str(p)


# Placement codes: a Shard is its dim (>= 0); the rest are negative. Layout logic runs on
# these ints because torch's placements are C++ objects whose isinstance/hash calls dominated
# the planner's profile.
REPLICATE_CODE, PARTIAL_SUM_CODE, PARTIAL_AVG_CODE, OTHER_CODE = -1, -2, -3, -4


def placement_code(p: Placement) -> int:
    if isinstance(p, Shard):
        return p.dim
    if isinstance(p, Replicate):
        return REPLICATE_CODE
    if isinstance(p, Partial):
        return PARTIAL_SUM_CODE if p.reduce_op == "sum" else PARTIAL_AVG_CODE if p.reduce_op == "avg" else OTHER_CODE
    return OTHER_CODE


_INTERNED: dict[tuple[int, ...], "Layout"] = {}


@dataclass(frozen=True, eq=False)
class Layout:
    """One placement per mesh axis, outermost axis first. ``str`` is e.g. ``S(0)R``."""

    placements: tuple[Placement, ...]

    @functools.cached_property
    def codes(self) -> tuple[int, ...]:
        """The placements as ints: the Shard dim, or a negative code (see ``placement_code``)."""
        return tuple(placement_code(p) for p in self.placements)

    @classmethod
    def interned(cls, placements: tuple[Placement, ...], codes: tuple[int, ...] | None = None) -> "Layout":
        """The one shared Layout of ``placements`` (``codes`` given saves recomputing them).

        The planner makes hundreds of thousands of layouts out of a few hundred distinct
        ones; sharing them keeps each one's codes computed once."""
        if codes is None:
            codes = tuple(placement_code(p) for p in placements)
        layout = _INTERNED.get(codes)
        if layout is None:
            layout = cls(tuple(placements))
            layout.__dict__["codes"] = codes
            if OTHER_CODE not in codes:  # "other" Partial ops share a code: never merge those
                _INTERNED[codes] = layout
        return layout

    @staticmethod
    def interned_by_codes(codes: tuple[int, ...]) -> "Layout | None":
        """The shared Layout of ``codes`` if one was made already (a lookup, no placements needed)."""
        return _INTERNED.get(codes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.codes == other.codes

    def __hash__(self) -> int:
        return hash(self.codes)

    @classmethod
    def replicated(cls, ndim: int) -> "Layout":
        return cls.interned(tuple(Replicate() for _ in range(ndim)))

    def shard_counts(self, mesh: MeshSpec, tensor_ndim: int) -> tuple[int, ...]:
        """How many pieces each tensor dim is cut into on ``mesh``."""
        counts = [1] * tensor_ndim
        for c, size in zip(self.codes, mesh.sizes):
            if c >= 0:
                counts[c % tensor_ndim] *= size
        return tuple(counts)

    def local_shape(self, mesh: MeshSpec, shape: Sequence[int]) -> tuple[int, ...]:
        """The per-device shape of a tensor of ``shape`` in this layout (dims divide evenly)."""
        counts = self.shard_counts(mesh, len(shape))
        return tuple(s // c for s, c in zip(shape, counts))

    def divides(self, mesh: MeshSpec, shape: Sequence[int]) -> bool:
        """True when every sharded dim splits evenly across the axes that shard it."""
        if not shape:
            return not any(c >= 0 for c in self.codes)
        counts = self.shard_counts(mesh, len(shape))
        return all(s % c == 0 for s, c in zip(shape, counts))

    def local_fraction(self, mesh: MeshSpec) -> float:
        """The fraction of the full tensor each device holds (Partial holds a full-size piece)."""
        return 1.0 / math.prod(s for c, s in zip(self.codes, mesh.sizes) if c >= 0)

    @property
    def is_replicated(self) -> bool:
        return all(c == REPLICATE_CODE for c in self.codes)

    @functools.cached_property
    def has_partial(self) -> bool:  # cached: the planner asks it of every strategy's inputs on every mesh
        return any(c in (PARTIAL_SUM_CODE, PARTIAL_AVG_CODE, OTHER_CODE) for c in self.codes)

    @functools.cached_property
    def text(self) -> str:
        """``str(layout)``, made once: a plan names every node's layouts (~10^5 per pipeline search)."""
        return "".join(placement_str(p) for p in self.placements)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Layout({', '.join(repr(p) for p in self.placements)})"


@dataclass(frozen=True)
class Cost:
    """Cost of one strategy on one device. Filled by the cost model; zero until priced."""

    fwd_compute_s: float = 0.0
    bwd_compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s + self.comm_s

    def __str__(self) -> str:
        return (
            f"fwd {self.fwd_compute_s * 1e3:.3g} ms, bwd {self.bwd_compute_s * 1e3:.3g} ms, "
            f"comm {self.comm_s * 1e3:.3g} ms, mem {self.memory_bytes / 2**20:.3g} MiB"
        )


@dataclass(frozen=True)
class Strategy:
    """How one node runs: a layout per tensor input (in argument order), one per output.

    ``inputs`` lines up with the node's tensor arguments as ``passes.rules.tensor_args``
    lists them (positional then keyword, nested lists flattened, repeats kept).
    ``technique``: the name of the registered technique (``autopar.techniques``) that runs the
    node this way (ring attention, SUMMA, ...), or None for the op itself plus reshards.
    """

    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]
    cost: Cost = field(default_factory=Cost, compare=False)
    technique: str | None = field(default=None, compare=False)

    @property
    def output(self) -> Layout:
        """The layout of the single output (most ops have exactly one)."""
        return self.outputs[0]

    def with_cost(self, cost: Cost) -> "Strategy":
        return Strategy(self.inputs, self.outputs, cost, self.technique)

    def with_technique(self, technique: str | None) -> "Strategy":
        return Strategy(self.inputs, self.outputs, self.cost, technique)

    def __str__(self) -> str:
        ins = ", ".join(l.text for l in self.inputs)
        outs = ", ".join(l.text for l in self.outputs)
        return f"{ins} -> {outs}" if ins else f"-> {outs}"
