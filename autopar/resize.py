"""Changing a job's number of devices (migration), and what it costs: for a scheduler to price it.

A job cannot change its world size in place (torch.distributed groups are fixed), so a resize is:
save at the old size (``autopar.checkpoint.save``), restart with the new number of ranks,
``parallelize`` (re-plans for the new world size) and ``resize(path, model, optimizer)`` here,
which loads with reshard-on-load and returns the measured cost. ``predict_bytes_read`` gives a
rank's bytes to read from the checkpoint's metadata alone, before loading: DCP reads every saved
chunk that overlaps a rank's piece whole, so the prediction is the sum of those chunks' stored
bytes, equal to what ``resize`` then measures.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from torch import nn

from autopar.checkpoint import EXTRA_PREFIX, MODEL_PREFIX, OPTIM_PREFIX, load, read_metadata
from autopar.runtime.dtensor_view import ShardView, shard_views

__all__ = ["MigrationCost", "resize", "predict_bytes_read"]


@dataclass(frozen=True)
class MigrationCost:
    """What loading a checkpoint into a new plan cost."""

    bytes_read_per_rank: tuple[int, ...]
    seconds: float

    def __str__(self) -> str:
        return (f"read {max(self.bytes_read_per_rank) / 1e6:.1f} MB on the busiest rank "
                f"({sum(self.bytes_read_per_rank) / 1e6:.1f} MB in all) in {self.seconds:.2f} s")


def resize(path: str | os.PathLike, model: nn.Module, optimizer=None) -> tuple[dict, MigrationCost]:
    """Load the checkpoint at ``path`` into ``model`` (parallelized for the new world size) and
    ``optimizer``; returns the checkpoint's ``extra`` and the measured cost. Every rank calls it."""
    stats: dict = {}
    extra = load(path, model, optimizer, stats=stats)
    return extra, MigrationCost(tuple(stats["bytes_read_per_rank"]), stats["seconds"])


def _box(view: ShardView) -> tuple[list[int], list[int]]:
    """Offsets and sizes of this rank's cut piece in the whole tensor (torch.chunk, outer axis first)."""
    offsets, sizes = [0] * len(view.info.global_shape), list(view.info.global_shape)
    coords, mesh_sizes = view.mesh.get_coordinate(), view.mesh.shape
    for axis, dim in view.info.dim_axes:
        step = math.ceil(sizes[dim] / mesh_sizes[axis]) if sizes[dim] else 0
        lo = coords[axis] * step
        offsets[dim] += min(lo, sizes[dim])
        sizes[dim] = max(0, min(step, sizes[dim] - lo))
    return offsets, sizes


def _overlaps(a_off, a_size, b_off, b_size) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size))


def predict_bytes_read(path: str | os.PathLike, model: nn.Module, optimizer=None) -> int:
    """Bytes this rank will read when ``resize``/``load`` loads ``path`` into ``model`` (and an
    optimizer, when ``optimizer`` is given), from the checkpoint's metadata; reads no tensor data.
    (The small JSON record ``load`` reads first is not counted, as in ``load``'s stats.)"""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata = read_metadata(path)
    views = {v.name: v for v in shard_views(model)}
    total = 0
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        if fqn.startswith(MODEL_PREFIX):
            view = views.get(fqn[len(MODEL_PREFIX):])
            if view is None:
                continue
        elif fqn.startswith(OPTIM_PREFIX):
            view = views.get(fqn[len(OPTIM_PREFIX):].rsplit("/", 1)[0])
            if optimizer is None or view is None:
                continue
            if tuple(md.size) != tuple(view.info.global_shape) or not md.size:  # scalar state: read whole
                view = None
        elif fqn.startswith(EXTRA_PREFIX):
            view = None
        else:  # the record, read separately
            continue
        box = _box(view) if view is not None else None
        for chunk in md.chunks:
            if box is None or _overlaps(box[0], box[1], chunk.offsets, chunk.sizes):
                total += metadata.storage_data[MetadataIndex(fqn, chunk.offsets)].length
    return total
