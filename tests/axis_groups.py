"""The AxisGroups a 4-rank algorithm case runs over (tests/norm_cases.py, tests/vocab_ce_cases.py):
the whole world, and each axis of a 2x2 mesh ("outer": ranks {0, 1} | {2, 3} differ on it,
"inner": {0, 2} | {1, 3})."""

from __future__ import annotations

import torch.distributed as dist


def world_and_2x2_groups(rank: int, world: int) -> dict:
    """{"world", "outer", "inner"} -> this rank's ``runtime.collectives.AxisGroup`` on each."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.collectives import AxisGroup

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    coords = {"outer": rank // 2, "inner": rank % 2}
    groups = {"world": AxisGroup("world", dist.group.WORLD, world, rank)}
    for name, dim in (("outer", 0), ("inner", 1)):
        groups[name] = AxisGroup(name, mesh.get_group(dim), 2, coords[name])
    return groups
