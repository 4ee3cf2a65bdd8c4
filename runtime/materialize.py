"""Where each rank's shards come from: the user's tensors, a checkpoint, or initialization.

``parallelize`` asks a :class:`ShardSource` for this rank's piece of every parameter and
buffer, in graph order, one tensor at a time:

* ``weights=PATH`` (a ``.safetensors`` file, or a directory from Hugging Face
  ``save_pretrained``, sharded ``model.safetensors.index.json`` included): each rank reads only
  its slice of each tensor (safetensors ``get_slice``); the whole tensor is never read;
* a parameter or buffer on the ``meta`` device that the checkpoint does not hold is
  initialized on this rank only: its owning module is built on CPU alone (one module at a
  time), initialized by the Hugging Face model's ``_init_weights`` or the module's own
  ``reset_parameters()``, cut to this rank's piece and dropped. Each module's RNG is seeded from
  ``(seed, module name)``, so the values depend on the seed only, not on the world size or the
  plan: the gathered model equals ``init_full(model, seed)`` on one process (it is not the
  stream ``torch.manual_seed(seed); Model()`` would draw, which depends on construction order);
* otherwise (a model on CPU): rank 0's tensor is broadcast and each rank keeps its piece.

A rank holds at most its shards plus one whole module's tensors (initialization) or one whole
tensor (the broadcast path); with ``weights=`` only its slices.
"""

from __future__ import annotations

import copy
import json
import os
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError
from autopar.strategy import Layout
from autopar.trace import trace

__all__ = ["WeightsError", "ShardSource", "chunk_slices", "local_shard", "adopt", "has_meta", "trace_meta",
           "init_full", "module_seed"]


class WeightsError(AutoparError, ValueError):
    """A checkpoint that cannot be read, or that does not fit the model."""


def chunk_slices(shape: Sequence[int], layout: Layout, coords: Sequence[int],
                 sizes: Sequence[int]) -> tuple[slice, ...]:
    """This rank's piece of a tensor of ``shape`` in ``layout`` as slices: a dim cut by several
    mesh axes is cut outer axis first, each cut with ``torch.chunk`` semantics (DTensor's Shard)."""
    bounds = [(0, int(s)) for s in shape]
    for code, size, c in zip(layout.codes, sizes, coords):
        if code >= 0:
            lo, hi = bounds[code]
            step = -(-(hi - lo) // size)
            bounds[code] = (min(lo + c * step, hi), min(lo + (c + 1) * step, hi))
    return tuple(slice(lo, hi) for lo, hi in bounds)


def local_shard(full: torch.Tensor, layout: Layout, coords: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """This rank's piece of ``full`` in ``layout`` (a dim cut by several axes, outer axis first)."""
    t = full
    for code, size, c in zip(layout.codes, sizes, coords):
        if code >= 0:
            t = t.chunk(size, dim=code)[c]
    t = t.contiguous()
    # A piece cut on dim 0 is already contiguous: a view that would keep the whole tensor's
    # storage alive on every rank. Copy it out.
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def adopt(param: nn.Parameter, local: torch.Tensor) -> nn.Parameter:
    """Make the user's own Parameter object hold ``local`` (an optimizer built on it before
    planning then steps the shard). A meta Parameter cannot take a CPU tensor as ``.data``:
    its whole tensor is swapped (torch.utils.swap_tensors)."""
    try:
        param.data = local
    except RuntimeError:
        torch.utils.swap_tensors(param, nn.Parameter(local, requires_grad=param.requires_grad))
    return param


def has_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def trace_meta(model: nn.Module, args: Sequence[Any], kwargs: dict | None, device: str) -> fx.GraphModule:
    """Trace a model built on the meta device: a copy of it (the user's own Parameters stay
    free of the tracer's references, so they can become shards in place) on meta inputs; then
    the device the graph's factory calls name (``meta``) becomes the device the ranks run on."""
    to_meta = lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x  # noqa: E731
    shadow = copy.deepcopy(model)
    gm = trace(shadow, tuple(to_meta(a) for a in args), {k: to_meta(v) for k, v in (kwargs or {}).items()})
    run = torch.device(device)
    fix = lambda v: run if isinstance(v, torch.device) and v.type == "meta" else v  # noqa: E731
    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, fix)
        node.kwargs = fx.node.map_aggregate(node.kwargs, fix)
    gm.recompile()
    return gm


def module_seed(seed: int, module_name: str) -> int:
    """The RNG seed of one module's initialization: a function of the seed and its name only."""
    return (int(seed) * 1_000_003 + zlib.crc32(module_name.encode())) % (2**63 - 1)


def _init_module(root: nn.Module, name: str, seed: int) -> dict[str, torch.Tensor]:
    """One module's own parameters and buffers, built on CPU and initialized (module doc);
    the module itself is left as it was."""
    mod = root.get_submodule(name) if name else root
    saved_p, saved_b = dict(mod._parameters), dict(mod._buffers)
    try:
        for n, p in saved_p.items():
            if p is not None:
                mod._parameters[n] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for n, b in saved_b.items():
            if b is not None:
                mod._buffers[n] = torch.zeros(b.shape, dtype=b.dtype) if b.device.type == "meta" else b.clone()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, name))
            if callable(getattr(root, "_init_weights", None)):  # a Hugging Face PreTrainedModel
                root._init_weights(mod)
            elif callable(getattr(mod, "reset_parameters", None)):
                mod.reset_parameters()
            elif any(p is not None for p in saved_p.values()):
                raise WeightsError(
                    f"cannot initialize {type(mod).__name__} {name or '(root)'} on the meta device: it has no "
                    f"reset_parameters(); give weights=PATH (safetensors) or build the model on CPU")
        return {n: t.detach() for n, t in (*mod._parameters.items(), *mod._buffers.items()) if t is not None}
    finally:
        mod._parameters.update(saved_p)
        mod._buffers.update(saved_b)


def init_full(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole state a meta model gets on one process from the per-module initialization
    ``parallelize`` runs on shards (module doc): for checks, and for single-device runs."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if any(True for _ in mod.parameters(recurse=False)) or any(True for _ in mod.buffers(recurse=False)):
            for k, v in _init_module(model, name, seed).items():
                out[f"{name}.{k}" if name else k] = v
    return out


class _Checkpoint:
    """Tensor name -> safetensors file of a file or a save_pretrained directory; slices only."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self._open = safe_open
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.isfile(index):
                with open(index, encoding="utf-8") as fh:
                    self.files = {k: os.path.join(path, v) for k, v in json.load(fh)["weight_map"].items()}
            elif os.path.isfile(single):
                self.files = self._keys(single)
            else:
                raise WeightsError(f"weights={path!r}: the directory holds neither model.safetensors nor "
                                   f"model.safetensors.index.json; save it with save_pretrained(dir) (safetensors)")
        elif os.path.isfile(path):
            self.files = self._keys(path)
        else:
            raise WeightsError(f"weights={path!r} does not exist; give a .safetensors file or a "
                               f"save_pretrained directory")
        self._handles: dict[str, Any] = {}

    def _keys(self, file: str) -> dict[str, str]:
        try:
            with self._open(file, framework="pt") as f:
                return {k: file for k in f.keys()}
        except Exception as exc:
            raise WeightsError(f"cannot read {file!r} as safetensors: {exc}") from None

    def read(self, name: str, slices: tuple[slice, ...], shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(file, framework="pt")
        view = self._handles[file].get_slice(name)
        if tuple(view.get_shape()) != tuple(shape):
            raise WeightsError(f"checkpoint tensor {name!r} has shape {tuple(view.get_shape())} but the model's is "
                               f"{tuple(shape)}; was it saved from another configuration?")
        piece = view[slices].to(dtype).contiguous()
        # a piece may share the storage safetensors mapped for the whole tensor or file: copy it out
        return piece.clone() if piece.untyped_storage().nbytes() > piece.nbytes else piece


class ShardSource:
    """This rank's piece of each parameter and buffer (module doc). ``peak_bytes`` is the most
    bytes of tensors it held at once (its pieces so far plus the temporaries of the one being made)."""

    def __init__(self, model: nn.Module, coords: Sequence[int], sizes: Sequence[int], weights: str | None = None,
                 seed: int = 0) -> None:
        self.model, self.coords, self.sizes, self.seed = model, tuple(coords), tuple(sizes), seed
        self.checkpoint = _Checkpoint(weights) if weights is not None else None
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._aliases = {n: names for names in aliases.values() for n in names}
        self._module: tuple[str | None, dict[str, torch.Tensor]] = (None, {})
        self.kept_bytes = 0
        self.peak_bytes = 0

    def _saved_name(self, target: str) -> str | None:
        if self.checkpoint is None:
            return None
        for name in self._aliases.get(target, [target]):
            if name in self.checkpoint.files:
                return name
        return None

    def _note(self, temporary_bytes: int, local: torch.Tensor) -> None:
        held = local.untyped_storage().nbytes()  # the storage it keeps alive, not only its own elements
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes + temporary_bytes + held)
        self.kept_bytes += held

    def piece(self, target: str, tensor: torch.Tensor, layout: Layout, is_param: bool) -> torch.Tensor:
        """This rank's piece of ``target`` (``tensor``: the model's own, possibly meta)."""
        saved = self._saved_name(target)
        if saved is not None:
            sl = chunk_slices(tensor.shape, layout, self.coords, self.sizes)
            local = self.checkpoint.read(saved, sl, tensor.shape, tensor.dtype)
            self._note(0, local)
            return local
        if tensor.device.type == "meta":
            module, _, attr = target.rpartition(".")
            if self._module[0] != module:
                self._module = (None, {})  # drop the last module before building the next
                self._module = (module, _init_module(self.model, module, self.seed))
            full = self._module[1][attr]
            local = local_shard(full, layout, self.coords, self.sizes)
            self._note(sum(t.nbytes for t in self._module[1].values()), local)
            return local
        full = tensor.detach().clone()
        if is_param:
            dist.broadcast(full, src=0)  # every rank starts from rank 0's weights
        local = local_shard(full, layout, self.coords, self.sizes)
        self._note(full.nbytes, local)
        return local

    def replaced(self, piece: torch.Tensor, kept: torch.Tensor) -> None:
        """``piece`` (made by :meth:`piece`) is dropped for ``kept`` (ZeRO-2's flat part of it):
        from now on the rank holds that instead; the moment both exist counts in the peak."""
        before, after = piece.untyped_storage().nbytes(), kept.untyped_storage().nbytes()
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes + after)
        self.kept_bytes += after - before

    def done(self) -> None:
        """Drop the cached module and close the checkpoint's files."""
        self._module = (None, {})
        if self.checkpoint is not None:
            self.checkpoint._handles.clear()
