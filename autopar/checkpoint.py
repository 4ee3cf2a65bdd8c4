"""Sharded checkpoints of a parallelized model and its optimizer, on torch.distributed.checkpoint.

    autopar.checkpoint.save(path, model, optimizer, extra={"step": 10})   # every rank, collectively
    extra = autopar.checkpoint.load(path, model, optimizer)                # any plan, mesh, world size

Every rank writes only its own pieces (DCP writes each replicated chunk once): parameters and
buffers, optimizer state of a parameter's shape as that parameter's DTensor layout
(``runtime/dtensor_view.py``; ZeRO-2 flat pieces are unflattened first), scalar state (``step``)
and the optimizer's hyper-parameters as plain tensors, and a JSON record of the plan, its graph
fingerprint, the parameter names and shapes and the optimizer's groups. Loading into a model
parallelized with another plan, mesh or world size reshards on load: each rank reads only the
chunks that overlap its own pieces.

Safety: nothing in a checkpoint is unpickled as code. Tensors load with ``weights_only=True``
(DCP's reader); DCP's ``.metadata`` file is a pickle, so it is read with an unpickler that only
builds DCP's own metadata classes; our own records are JSON stored as uint8 tensors. A manifest
(``autopar_manifest.json``, written last: a checkpoint without it is incomplete) holds each file's
size and CRC-32; ``load`` checks them (each rank a share of the files) and checks that the
checkpoint was made for this model before it touches the model or the optimizer.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import AutoparError
from autopar.runtime.dtensor_view import ShardView, empty_dtensor, shard_views, to_dtensor, to_local_piece

__all__ = ["save", "load", "CheckpointError", "MANIFEST", "full_optimizer_state", "read_record", "read_metadata",
           "MODEL_PREFIX", "OPTIM_PREFIX", "EXTRA_PREFIX"]

FORMAT = "autopar-dcp-1"
MANIFEST = "autopar_manifest.json"
_META_KEY = "autopar/meta"
_MODEL, _OPTIM, _EXTRA = "model/", "optim/", "extra/"
# checkpoint keys: model/<name>, optim/<name>/<state key>, extra/<key>
MODEL_PREFIX, OPTIM_PREFIX, EXTRA_PREFIX = _MODEL, _OPTIM, _EXTRA


class CheckpointError(AutoparError):
    """A checkpoint that is missing, incomplete, corrupted, or made for another model."""


# --- safe reading of DCP's pickled metadata -------------------------------------------------

# Exact (module, name) pairs: a whole module would let a dotted name reach its imports (os.system).
_DCP_MD, _DCP_FS = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"
_ALLOWED = {(_DCP_MD, n) for n in ("Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
                                   "TensorProperties", "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")} | \
    {(_DCP_FS, "_StorageInfo"), (_DCP_FS, "_StoragePrefix"), ("collections", "OrderedDict"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath"), ("builtins", "set"), ("builtins", "frozenset")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses and torch's dtype/size/layout values, nothing else: no
    function that could run code is reachable (``torch.serialization._get_layout`` only looks a
    layout up by name, as ``torch.load(weights_only=True)`` allows)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or \
                (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader with a safe metadata unpickler; counts the bytes this rank reads."""

    bytes_read = 0

    def read_data(self, plan, planner):
        self.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = os.path.join(str(self.path), ".metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointError(f"{path} is not readable DCP metadata ({exc}); the checkpoint is corrupted "
                                  f"or was not written by torch.distributed.checkpoint") from exc
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | os.PathLike):
    """DCP's metadata of a checkpoint (tensor keys, chunks, where each is stored), read safely;
    not collective."""
    return _SafeReader(str(path)).read_metadata()


# --- the record: JSON carried as a uint8 tensor ---------------------------------------------

def _json_tensor(obj: Any) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8)


def _from_json_tensor(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.tolist()).decode())


def _plans(model: nn.Module) -> list:
    plans = getattr(model, "plans", None)
    return list(plans) if plans is not None else [model.plan]


def _model_name(model: nn.Module) -> str:
    return _plans(model)[0].model.split("/stage")[0]  # a pipeline's stage plans are named MODEL/stageK


def _model_record(model: nn.Module) -> dict:
    """The same JSON on every rank (DCP writes one copy): a pipeline's tensors of all its stages."""
    plans = _plans(model)
    return {"model": _model_name(model), "fingerprints": [p.graph_fingerprint for p in plans],
            "plans": [p.to_json() for p in plans], "world_size": dist.get_world_size(),
            "tensors": _all_tensors(model)}


def _all_tensors(model: nn.Module) -> dict[str, dict]:
    """Every rank's tensor names, shapes and dtypes (a pipeline rank holds only its stages)."""
    mine = {v.name: {"shape": list(v.info.global_shape), "dtype": str(v.info.tensor.dtype).removeprefix("torch."),
                     "param": v.info.is_param} for v in shard_views(model)}
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    return {k: v for d in box for k, v in d.items()}


# --- optimizer state ------------------------------------------------------------------------

def _param_names(views: list[ShardView], optimizer) -> dict[int, ShardView]:
    by_id = {id(v.info.tensor): v for v in views if v.info.is_param}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                                      f"the model's local shards; build it from model.parameters() of the "
                                      f"parallelized model")
    return by_id


def _is_sharded_state(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def _optimizer_record(views: list[ShardView], optimizer) -> tuple[dict, dict[str, Any]]:
    """Hyper-parameters and state layout (JSON), and the state tensors keyed for DCP."""
    by_id = _param_names(views, optimizer)
    groups, tensors, state_kinds = [], {}, {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [by_id[id(p)].name for p in group["params"]], "hyper": _jsonable(hyper)})
        for p in group["params"]:
            view = by_id[id(p)]
            kinds = state_kinds[view.name] = {}
            for key, value in optimizer.state.get(p, {}).items():
                if _is_sharded_state(value, p):
                    tensors[f"{_OPTIM}{view.name}/{key}"] = to_dtensor(view, value)
                    kinds[key] = "sharded"
                elif isinstance(value, torch.Tensor):  # step and other per-parameter scalars: equal on all ranks
                    tensors[f"{_OPTIM}{view.name}/{key}"] = value.detach()
                    kinds[key] = "replicated"
                else:
                    kinds[key] = {"value": _jsonable(value)}
    # The record must be the same on every rank: a pipeline rank's optimizer holds its stages only.
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, (groups, state_kinds))
    merged = [dict(g, params=[]) for g in groups]
    for other_groups, other_kinds in box:  # rank order: the same list on every rank
        for group, other in zip(merged, other_groups):
            group["params"] += [n for n in other["params"] if n not in group["params"]]
        state_kinds.update(other_kinds)
    return {"class": type(optimizer).__name__, "groups": merged, "state": state_kinds}, tensors


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot store {type(obj).__name__} value {obj!r} in a checkpoint record; "
                          f"use JSON values (numbers, strings, lists, dicts) or tensors")


def full_optimizer_state(model: nn.Module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state of every parameter unsharded, by parameter name, on every rank of its
    (stage) mesh: for checks against a single-device optimizer. Gathers everything: debugging only."""
    views = shard_views(model)
    by_id = _param_names(views, optimizer)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            view = by_id[id(p)]
            out[view.name] = {k: (to_dtensor(view, v).full_tensor().clone() if _is_sharded_state(v, p) else
                                  v.clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in optimizer.state.get(p, {}).items()}
    return out


# --- save -----------------------------------------------------------------------------------

def save(path: str | os.PathLike, model: nn.Module, optimizer=None, extra: dict | None = None) -> None:
    """Write ``model``'s shards (and ``optimizer``'s state, and ``extra``: JSON values or tensors equal
    on all ranks) to the directory ``path``. Every rank calls it; each writes only its own pieces."""
    path = str(path)
    views = shard_views(model)
    record = _model_record(model)
    state: dict[str, Any] = {f"{_MODEL}{v.name}": to_dtensor(v, v.info.tensor) for v in views}
    if optimizer is not None:
        record["optimizer"], optim_tensors = _optimizer_record(views, optimizer)
        state.update(optim_tensors)
    extra = dict(extra or {})
    record["extra_tensors"] = sorted(k for k, v in extra.items() if isinstance(v, torch.Tensor))
    record["extra"] = _jsonable({k: v for k, v in extra.items() if not isinstance(v, torch.Tensor)})
    state.update({f"{_EXTRA}{k}": extra[k].detach() for k in record["extra_tensors"]})
    record["format"] = FORMAT
    state[_META_KEY] = _json_tensor(record)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, MANIFEST)):  # overwriting: incomplete until the new manifest
            os.remove(os.path.join(path, MANIFEST))
    dist.barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    _write_manifest(path)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):  # 1 MiB at a time: checksumming adds no memory to speak of
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_manifest(path: str) -> None:
    """Each rank checksums the files it wrote; rank 0 adds the metadata and writes the manifest last."""
    rank = dist.get_rank()
    mine = {f: {"bytes": os.path.getsize(os.path.join(path, f)), "crc32": _crc32(os.path.join(path, f))}
            for f in sorted(os.listdir(path)) if f.startswith(f"__{rank}_") and f.endswith(".distcp")}
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, mine)
    if rank == 0:
        files = {k: v for d in box for k, v in d.items()}
        meta = os.path.join(path, ".metadata")
        files[".metadata"] = {"bytes": os.path.getsize(meta), "crc32": _crc32(meta)}
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "files": files}, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(path, MANIFEST))
    dist.barrier()


# --- load -----------------------------------------------------------------------------------

def _verify(path: str) -> None:
    """Missing, incomplete or corrupted files: a clear error on every rank, before anything is read."""
    manifest_path = os.path.join(path, MANIFEST)
    problem = None
    if not os.path.isdir(path):
        problem = f"no checkpoint directory {path!r}"
    elif not os.path.exists(manifest_path):
        problem = (f"{path!r} has no {MANIFEST}: not an autopar checkpoint, or its save did not finish "
                   f"(the manifest is written last); load an earlier checkpoint")
    else:
        try:
            with open(manifest_path) as f:
                files = json.load(f)["files"]
        except (ValueError, KeyError) as exc:
            problem = f"{manifest_path} is corrupted ({exc})"
    problems: list[Any] = [None] * dist.get_world_size()
    if problem is None:  # each rank checks a share of the files
        bad = []
        rank, world = dist.get_rank(), dist.get_world_size()
        for name in sorted(files)[rank::world]:
            file = os.path.join(path, name)
            if not os.path.exists(file):
                bad.append(f"{name} is missing")
            elif os.path.getsize(file) != files[name]["bytes"] or _crc32(file) != files[name]["crc32"]:
                bad.append(f"{name} does not match its checksum (size {os.path.getsize(file)}, "
                           f"expected {files[name]['bytes']})")
        problem = f"checkpoint {path!r} is corrupted: {'; '.join(bad)}" if bad else None
    dist.all_gather_object(problems, problem)
    found = list(dict.fromkeys(p for p in problems if p))
    if found:
        raise CheckpointError(found[0] + ("" if len(found) == 1 else f" (and {len(found) - 1} more reports)"))


def read_record(path: str | os.PathLike) -> tuple[dict, Any]:
    """The checkpoint's JSON record (model, plans, tensor shapes, optimizer groups, extra) and
    DCP's metadata. Collective (every rank calls it)."""
    path = str(path)
    _verify(path)
    reader = _SafeReader(path)
    metadata = reader.read_metadata()
    md = metadata.state_dict_metadata.get(_META_KEY)
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointError(f"{path!r} is a DCP checkpoint but not autopar's (no {_META_KEY!r} record); "
                              f"load it with torch.distributed.checkpoint directly")
    box = {_META_KEY: torch.empty(md.size, dtype=torch.uint8)}
    dcp.load(box, storage_reader=_SafeReader(path))
    record = _from_json_tensor(box[_META_KEY])
    if record.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} has format {record.get('format')!r}; this autopar reads {FORMAT!r}")
    return record, metadata


def _check_same_model(path: str, record: dict, model: nn.Module) -> None:
    mine = _all_tensors(model)
    saved = record["tensors"]
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    reshaped = sorted(n for n in set(mine) & set(saved) if list(mine[n]["shape"]) != saved[n]["shape"])
    if missing or unexpected or reshaped:
        detail = "; ".join(s for s in (
            f"missing in the checkpoint: {', '.join(missing[:3])}" if missing else "",
            f"not in this model: {', '.join(unexpected[:3])}" if unexpected else "",
            f"other shapes: " + ", ".join(f"{n} {saved[n]['shape']} vs {mine[n]['shape']}" for n in reshaped[:3])
            if reshaped else "") if s)
        raise CheckpointError(
            f"checkpoint {path!r} was saved from model {record['model']!r} (graph fingerprint "
            f"{record['fingerprints'][0]}), not this model {_model_name(model)!r} (graph fingerprint "
            f"{_plans(model)[0].graph_fingerprint}): {detail}; load a checkpoint of this model")


def _check_optimizer(path: str, record: dict, views: list[ShardView], optimizer) -> dict[int, ShardView]:
    saved = record.get("optimizer")
    if saved is None:
        raise CheckpointError(f"checkpoint {path!r} holds no optimizer state; call load(path, model) without one")
    by_id = _param_names(views, optimizer)
    mine = [[by_id[id(p)].name for p in g["params"]] for g in optimizer.param_groups]
    theirs = [g["params"] for g in saved["groups"]]
    # A pipeline rank's optimizer holds its own stages' parameters only: each of its groups must
    # be part of the saved group at the same index.
    if len(mine) != len(theirs) or any(not set(m) <= set(t) for m, t in zip(mine, theirs)):
        raise CheckpointError(f"checkpoint {path!r} holds a {saved['class']} with {len(theirs)} parameter "
                              f"groups that do not match this {type(optimizer).__name__}'s {len(mine)}; "
                              f"build the optimizer with the same parameter groups")
    if saved["class"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint {path!r} holds {saved['class']} state, not {type(optimizer).__name__}; "
                              f"use the same optimizer class or load without the optimizer")
    return by_id


def load(path: str | os.PathLike, model: nn.Module, optimizer=None, *, stats: dict | None = None) -> dict:
    """Load a checkpoint ``save`` wrote into ``model`` (parallelized with any plan, mesh or world
    size) and ``optimizer``; returns the ``extra`` it was saved with. Every rank calls it. A
    missing, corrupted or foreign checkpoint raises ``CheckpointError`` and leaves model and
    optimizer unchanged: checksums, model and optimizer are checked before anything is read.
    Then pieces are read straight into the model's tensors (and into optimizer state tensors
    that already exist), so a load holds the rank's state plus DCP's read buffer, not a second
    copy; only ZeRO-2 pieces (read as the cut piece, then split) and new optimizer state take
    fresh memory. (An I/O error in the middle of reading can leave the model partly loaded.)
    ``stats``, if given, receives what the load cost (the price of a migration to this plan):
    ``bytes_read`` by this rank, ``bytes_read_per_rank``, ``seconds``."""
    started = time.perf_counter()
    path = str(path)
    record, metadata = read_record(path)
    _check_same_model(path, record, model)
    views = shard_views(model)
    by_id = _check_optimizer(path, record, views, optimizer) if optimizer is not None else {}
    state: dict[str, Any] = {}
    for v in views:  # in place where the local tensor is the cut piece itself
        state[f"{_MODEL}{v.name}"] = empty_dtensor(v, v.info.tensor.dtype) if v.zero_groups else to_dtensor(v, v.info.tensor)
    opt_kinds = record["optimizer"]["state"] if optimizer is not None else {}
    for v in by_id.values():
        held = optimizer.state.get(v.info.tensor, {})
        for key, kind in opt_kinds.get(v.name, {}).items():
            k = f"{_OPTIM}{v.name}/{key}"
            md = metadata.state_dict_metadata[k] if kind in ("sharded", "replicated") else None
            mine = held.get(key)
            if kind == "sharded" and not v.zero_groups and isinstance(mine, torch.Tensor) and \
                    _is_sharded_state(mine, v.info.tensor) and mine.dtype == md.properties.dtype:
                state[k] = to_dtensor(v, mine)  # the optimizer's own tensor, in place
            elif kind == "sharded":
                state[k] = empty_dtensor(v, md.properties.dtype)
            elif kind == "replicated":
                state[k] = torch.empty(md.size, dtype=md.properties.dtype)
    for k in record["extra_tensors"]:
        md = metadata.state_dict_metadata[f"{_EXTRA}{k}"]
        state[f"{_EXTRA}{k}"] = torch.empty(md.size, dtype=md.properties.dtype)
    reader = _SafeReader(path)
    try:
        dcp.load(state, storage_reader=reader)
    except Exception as exc:  # noqa: BLE001 - DCP wraps per-rank failures; name the checkpoint
        raise CheckpointError(f"reading checkpoint {path!r} failed: {exc}") from exc
    with torch.no_grad():
        for v in views:
            if v.zero_groups:  # the others were read in place
                v.info.tensor.copy_(to_local_piece(v, state[f"{_MODEL}{v.name}"]))
    if optimizer is not None:
        _apply_optimizer(record["optimizer"], state, by_id, optimizer)
    if stats is not None:
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, reader.bytes_read)
        stats.update(bytes_read=reader.bytes_read, bytes_read_per_rank=per_rank,
                     seconds=time.perf_counter() - started)
    extra = dict(record["extra"])
    extra.update({k: state[f"{_EXTRA}{k}"] for k in record["extra_tensors"]})
    return extra


def _apply_optimizer(saved: dict, state: dict, by_id: dict[int, ShardView], optimizer) -> None:
    for group, saved_group in zip(optimizer.param_groups, saved["groups"]):
        for k, value in saved_group["hyper"].items():
            if isinstance(group.get(k), torch.Tensor):  # e.g. a tensor lr: keep the tensor
                group[k].fill_(value)
            else:
                group[k] = tuple(value) if isinstance(group.get(k), tuple) else value
    for group in optimizer.param_groups:
        for p in group["params"]:
            view = by_id[id(p)]
            new = {}
            for key, kind in saved["state"].get(view.name, {}).items():
                k = f"{_OPTIM}{view.name}/{key}"
                if kind == "sharded":
                    new[key] = to_local_piece(view, state[k]).to(p.device)
                elif kind == "replicated":
                    new[key] = state[k]
                else:
                    new[key] = kind["value"]
            if new:
                optimizer.state[p] = new
            else:
                optimizer.state.pop(p, None)
