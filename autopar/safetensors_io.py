"""Whole, unsharded weights as Hugging Face safetensors, written and read from the shards.

    autopar.safetensors_io.export_safetensors("out", model)   # every rank; out/model-0000k-of-0000n.safetensors
    autopar.safetensors_io.import_safetensors("out", model)   # every rank; each reads only its pieces

Export goes through DCP's Hugging Face writer: every rank writes its own pieces (replicated ones
once) as sharded safetensors under ``out/sharded``, then the output files are consolidated with
each rank assembling a share of them (``consolidate_safetensors_files_on_every_rank``), so no
rank holds the whole model; files are cut at ``max_shard_bytes`` and indexed by
``model.safetensors.index.json`` as ``save_pretrained`` does. Where that DCP helper is missing
(older torch), rank 0 consolidates. Import reads the safetensors headers (no pickle) and each
rank reads the slices that overlap its pieces, whatever plan it runs.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from autopar.errors import AutoparError
from autopar.runtime.dtensor_view import empty_dtensor, shard_views, to_dtensor, to_local_piece

__all__ = ["export_safetensors", "import_safetensors"]


def _file_index(sizes: dict[str, int], max_shard_bytes: int) -> dict[str, int]:
    """Tensor name -> output file number (1-based), filling files in name order up to the limit."""
    index, used, out = 1, 0, {}
    for name in sorted(sizes):
        if used and used + sizes[name] > max_shard_bytes:
            index, used = index + 1, 0
        out[name] = index
        used += sizes[name]
    return out


def _all_sizes(model: nn.Module) -> dict[str, int]:
    mine = {v.name: v.info.tensor.element_size() * int(torch.Size(v.info.global_shape).numel())
            for v in shard_views(model) if v.info.is_param}
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    return {k: v for d in box for k, v in d.items()}


def export_safetensors(path: str | os.PathLike, model: nn.Module, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write the model's parameters, unsharded, as Hugging Face safetensors in ``path``."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    path = str(path)
    sharded = os.path.join(path, "sharded")
    mapping = _file_index(_all_sizes(model), max_shard_bytes)
    state = {v.name: to_dtensor(v, v.info.tensor) for v in shard_views(model) if v.info.is_param}
    try:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files_on_every_rank)
    except ImportError:  # older torch: DCP's writer consolidates on rank 0
        consolidate_safetensors_files_on_every_rank = None
    writer = HuggingFaceStorageWriter(sharded, fqn_to_index_mapping=mapping, save_distributed=True,
                                      enable_consolidation=consolidate_safetensors_files_on_every_rank is None)
    dcp.save(state, storage_writer=writer)
    if consolidate_safetensors_files_on_every_rank is not None:
        consolidate_safetensors_files_on_every_rank(sharded, path, mapping)
    else:
        dist.barrier()
        if dist.get_rank() == 0:
            for f in os.listdir(os.path.join(sharded, "consolidated")):
                os.replace(os.path.join(sharded, "consolidated", f), os.path.join(path, f))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(sharded)
    dist.barrier()


def import_safetensors(path: str | os.PathLike, model: nn.Module) -> None:
    """Load unsharded safetensors weights (``export_safetensors``' or a ``save_pretrained``
    directory with these parameter names) into the model's shards."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = str(path)
    views = [v for v in shard_views(model) if v.info.is_param]
    state = {v.name: empty_dtensor(v, v.info.tensor.dtype) for v in views}
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(path))
    except Exception as exc:  # noqa: BLE001 - DCP gathers per-rank failures; name the directory
        raise AutoparError(f"loading safetensors weights from {path!r} failed: {exc}; the directory must hold "
                           f"*.safetensors files with this model's parameter names and shapes") from exc
    with torch.no_grad():
        for v in views:
            v.info.tensor.copy_(to_local_piece(v, state[v.name]))
