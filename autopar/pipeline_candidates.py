"""The candidates the pipeline search (``autopar.pipeline_search``) enumerates besides the stage
count: the sub-meshes inside a stage and the micro-batch counts, and the global batch they split."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.cost_model.hardware import Hardware
from autopar.mesh import MeshSpec

__all__ = ["sub_meshes", "global_batch", "microbatch_counts"]


def sub_meshes(n_sub: int, hw: Hardware) -> list[MeshSpec]:
    """1- and 2-axis sub-meshes: a data-like axis and an inner axis inside a node."""
    out = [hw.mesh_spec(("dp",), (n_sub,))]
    t = 2
    while t <= min(n_sub, hw.devices_per_node):
        if n_sub % t == 0:
            out.append(hw.mesh_spec(("dp", "tp"), (n_sub // t, t)) if n_sub > t else hw.mesh_spec(("tp",), (t,)))
        t *= 2
    return out


def global_batch(gm: fx.GraphModule) -> int:
    sizes = [n.meta["val"].shape[0] for n in gm.graph.nodes if n.op == "placeholder"
             and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0]
    return int(sizes[0]) if sizes else 1


def microbatch_counts(batch: int, p: int, mesh: MeshSpec) -> list[int]:
    """Micro-batch counts that split the batch evenly and leave each micro-batch divisible by
    the sub-mesh's data axis: p, 2p, 4p, ... (fewer than p leaves most of the pipeline idle)."""
    data = mesh.sizes[0] if mesh.axes[0] == "dp" else 1
    out, m = [], p
    while m <= batch:
        if batch % m == 0 and (batch // m) % data == 0:
            out.append(m)
        m *= 2
    if not out and batch % data == 0:
        out = [d for d in range(1, batch + 1) if batch % d == 0 and (batch // d) % data == 0][-1:]
    return out
