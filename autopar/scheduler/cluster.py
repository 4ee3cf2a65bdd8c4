"""GPU placement on a cluster of nodes: which node's GPUs a job of ``n`` GPUs gets.

A job that fits in one node goes to the node with the fewest free GPUs that still holds it
(best fit, so whole nodes stay free for large jobs); otherwise it takes GPUs from the emptiest
nodes first and spans them, and then pays the inter-node link in its plan (the throughput
table's ``spans_nodes`` rows). Jobs whose GPU count did not change keep their GPUs: the
simulator places only the jobs it resized, started or resumed, which is the
migration-minimising reorder of ONES (section IV of the paper) applied to every policy alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import AutoparError

__all__ = ["Cluster", "Placement", "PlacementError"]

Placement = tuple[tuple[int, int], ...]  # (node index, GPUs on it), one entry per node used


class PlacementError(AutoparError, RuntimeError):
    """More GPUs asked for than are free."""


@dataclass
class Cluster:
    """Free GPUs per node; mutable, owned by one simulation."""

    n_nodes: int
    devices_per_node: int = 8
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.free:
            self.free = [self.devices_per_node] * self.n_nodes

    @classmethod
    def with_gpus(cls, gpus: int, devices_per_node: int = 8) -> "Cluster":
        if gpus < 1 or gpus % devices_per_node and gpus > devices_per_node:
            raise PlacementError(f"a cluster of {gpus} GPUs is not whole nodes of {devices_per_node}; "
                                 f"pick a multiple of {devices_per_node}")
        return cls(max(1, gpus // devices_per_node), min(gpus, devices_per_node))

    @property
    def total(self) -> int:
        return self.n_nodes * self.devices_per_node

    @property
    def n_free(self) -> int:
        return sum(self.free)

    def place(self, gpus: int) -> Placement:
        if gpus > self.n_free:
            raise PlacementError(f"asked for {gpus} GPUs with {self.n_free} free")
        fits = [i for i, f in enumerate(self.free) if f >= gpus]
        if gpus <= self.devices_per_node and fits:
            node = min(fits, key=lambda i: (self.free[i], i))
            self.free[node] -= gpus
            return ((node, gpus),)
        out, need = [], gpus
        for node in sorted(range(self.n_nodes), key=lambda i: (-self.free[i], i)):
            take = min(self.free[node], need)
            if take:
                self.free[node] -= take
                out.append((node, take))
                need -= take
            if not need:
                break
        return tuple(out)

    def release(self, placement: Placement) -> None:
        for node, count in placement:
            self.free[node] += count
