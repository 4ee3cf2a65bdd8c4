"""MeshSpec: the device mesh as pure data (axis names, sizes, and the link each axis crosses).

Planning needs no process group: a plan for 1024 devices is made on a laptop from a MeshSpec.
The real ``torch.distributed.device_mesh.DeviceMesh`` is built only by the runtime.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .errors import AutoparError

__all__ = ["Link", "MeshSpec", "MeshError"]


class MeshError(AutoparError, ValueError):
    """A mesh description that is malformed or does not match the device count."""


@dataclass(frozen=True)
class Link:
    """The interconnect one mesh axis runs over, priced with the alpha-beta model.

    ``bandwidth_bytes_per_s`` is the per-device bus bandwidth a ring collective sees;
    ``latency_s`` the per-hop latency (alpha).
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    # Measured rates of particular collectives on groups of particular sizes, where they differ
    # from the one (bandwidth, latency) pair: ``(collective, n_ranks, bandwidth, latency)`` rows,
    # each the pair that makes that collective's ring formula reproduce what ``autopar calibrate``
    # timed. gloo on CPU is the case: its reduce-scatter is not a ring reduce-scatter (it costs
    # ~1.5-2x an all-reduce of the same input, not half of one), its all-gather costs about an
    # all-reduce, and 2-rank groups are not 4-rank rings with fewer hops. Empty: the ring
    # formulas with one pair for everything (the built-in GPU profiles).
    per_collective: tuple[tuple[str, int, float, float], ...] = ()

    def rates(self, collective: str, n_ranks: int) -> tuple[float, float]:
        """(bandwidth, per-hop latency) to price ``collective`` on a group of ``n_ranks``: the
        measured row for exactly that collective and group size, else the link's own pair."""
        for kind, n, bandwidth, latency in self.per_collective:
            if kind == collective and n == n_ranks:
                return bandwidth, latency
        return self.bandwidth_bytes_per_s, self.latency_s

    def to_json(self) -> dict:
        out = {"name": self.name, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "latency_s": self.latency_s}
        if self.per_collective:
            out["per_collective"] = [list(row) for row in self.per_collective]
        return out

    @classmethod
    def from_json(cls, d: dict) -> "Link":
        rows = tuple((str(k), int(n), float(b), float(a)) for k, n, b, a in d.get("per_collective", ()))
        return cls(str(d["name"]), float(d["bandwidth_bytes_per_s"]), float(d["latency_s"]), rows)

    def __str__(self) -> str:
        extra = f", {len(self.per_collective)} measured collective rates" if self.per_collective else ""
        return f"{self.name}({self.bandwidth_bytes_per_s / 1e9:g} GB/s, {self.latency_s * 1e6:g} us{extra})"


# Used when a mesh is written without links (e.g. "dp=2,tp=4"); the planner replaces it
# with the hardware profile's links. Figure: A100 NVLink busBW ~200 GB/s (../FACTS, nccl-tests #149).
DEFAULT_LINK = Link("intra-node", 200e9, 8e-6)

_AXIS_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.]*)\s*[=:]\s*(\d+)\s*$")


@dataclass(frozen=True)
class MeshSpec:
    """Axis names and sizes of a device mesh, outermost axis first, and each axis's link."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    links: tuple[Link, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.sizes):
            raise MeshError(f"mesh has {len(self.axes)} axis names but {len(self.sizes)} sizes")
        if len(set(self.axes)) != len(self.axes):
            raise MeshError(f"mesh axis names must be unique, got {self.axes}")
        for name, size in zip(self.axes, self.sizes):
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers")
        if not self.links:
            object.__setattr__(self, "links", tuple(DEFAULT_LINK for _ in self.axes))
        elif len(self.links) != len(self.axes):
            raise MeshError(f"mesh has {len(self.axes)} axes but {len(self.links)} links")

    @classmethod
    def parse(cls, text: str, n_devices: int | None = None) -> "MeshSpec":
        """Parse ``"dp=2,tp=4"`` (or ``"dp:2 x tp:4"``); check against ``n_devices`` if given."""
        parts = [p for p in re.split(r"[,x*\s]+(?=[A-Za-z_])", text.strip()) if p.strip()]
        axes, sizes = [], []
        for part in parts:
            m = _AXIS_RE.match(part.strip().rstrip(","))
            if not m:
                raise MeshError(
                    f"cannot read mesh axis {part!r} in {text!r}; write axes as name=size, e.g. 'dp=2,tp=4'"
                )
            axes.append(m.group(1))
            sizes.append(int(m.group(2)))
        mesh = cls(tuple(axes), tuple(sizes))
        if n_devices is not None:
            mesh.check_devices(n_devices)
        return mesh

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def n_devices(self) -> int:
        return math.prod(self.sizes)

    def size(self, axis: str | int) -> int:
        return self.sizes[self.index(axis)]

    def index(self, axis: str | int) -> int:
        if isinstance(axis, int):
            return axis
        try:
            return self.axes.index(axis)
        except ValueError:
            raise MeshError(f"mesh {self} has no axis {axis!r}; its axes are {list(self.axes)}") from None

    def check_devices(self, n_devices: int) -> None:
        if self.n_devices != n_devices:
            product = " * ".join(f"{a}({s})" for a, s in zip(self.axes, self.sizes))
            raise MeshError(
                f"{product} = {self.n_devices} != {n_devices} devices; "
                f"pick a mesh whose sizes multiply to {n_devices}, e.g. {_example_mesh(n_devices)}"
            )

    def with_links(self, links: tuple[Link, ...]) -> "MeshSpec":
        return MeshSpec(self.axes, self.sizes, tuple(links))

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in zip(self.axes, self.sizes))


def _example_mesh(n: int) -> str:
    for tp in (8, 4, 2):
        if n % tp == 0 and n // tp > 1:
            return f"dp={n // tp},tp={tp}"
    return f"dp={n}"
