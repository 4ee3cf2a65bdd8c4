"""Peak live tensor bytes on a CPU rank: what torch's CUDA allocator stats would say on a GPU.

torch keeps no allocator statistics on CPU, and the process RSS high-water mark mixes in the
libraries, the full model every rank builds before sharding it, and memory glibc never hands
back, so it cannot tell a sharded method from a replicated one. This tracker instead counts
the bytes of every tensor *storage* a training step touches, from the moment it is first
seen until it is freed, and keeps the peak of that sum:

* at :meth:`LiveBytes.track`, the storages of the given tensors (parameters, gradients,
  optimizer state) are counted, so persistent state counts even before an op reads it;
* under the mode, every op's inputs and outputs are counted (a storage once, however many
  views of it exist); a weak reference on the storage takes its bytes off when it is freed.

It measures the same thing for every method (autopar, DDP, FSDP2, DTensor TP): parameters,
gradients, optimizer state, activations, communication buffers the step reads or writes, and
temporaries. Storages held across steps but never touched by a step (a module's unused copy
of the full weights, say) are not counted. Tensor subclasses (DTensor, FSDP2's parameters) are
counted through their inner tensors; ops a subclass runs inside its own dispatch are not seen
one by one (their outputs are), so short-lived temporaries inside DTensor ops are missed.
The mode costs Python work per op: run it on untimed steps.

Host memory (ZeRO-Offload, ``runtime/offload.py``): storages named by :meth:`LiveBytes.host`
are counted apart, in ``host_bytes`` / ``host_peak_bytes``, never in the device's
``live_bytes`` / ``peak_bytes``; on a CPU-only machine both are the same memory, and this is
how the measurement keeps them separate.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "optimizer_tensors", "bucket_buffers", "plain_tensors"]


def plain_tensors(t: torch.Tensor) -> Iterable[torch.Tensor]:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):
                yield from plain_tensors(inner)
    else:
        yield t


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes() as mem: mem.track(tensors); step()`` then ``mem.peak_bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        # id(storage) -> (weak ref whose callback takes the bytes off, bytes counted now)
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._resize = None
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self._host: dict[int, torch.UntypedStorage] = {}  # id -> storage (kept alive: ids stay unique)

    def _freed(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[1]

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._host:
            return
        entry = self._storages.get(key)
        nbytes = storage.nbytes()
        if entry is None:
            ref = weakref.ref(storage, lambda _, key=key: self._freed(key))
            self.live_bytes += nbytes
        else:
            ref, counted = entry
            if counted == nbytes:
                return
            self.live_bytes += nbytes - counted
        self._storages[key] = (ref, nbytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _see(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            for plain in plain_tensors(t):
                if plain.device.type != "meta":
                    self._count(plain.untyped_storage())

    def track(self, tensors: Iterable[Any]) -> None:
        """Count these tensors from now on (persistent state the step may touch late)."""
        for t in tensors:
            self._see(t)

    def host(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count these tensors as host memory (offloaded state), never as the device's."""
        for t in tensors:
            for plain in plain_tensors(t):
                storage = plain.untyped_storage()
                key = id(storage)
                if key in self._host:
                    continue
                entry = self._storages.pop(key, None)
                if entry is not None:
                    self.live_bytes -= entry[1]
                self._host[key] = storage
                self.host_bytes += storage.nbytes()
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def is_host(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage was named host memory (:meth:`host`)."""
        return id(t.untyped_storage()) in self._host

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self):
        # FSDP2 frees and re-allocates unsharded parameters by resizing their storage in
        # place (``UntypedStorage.resize_``, not a dispatched op): follow those resizes too.
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._count(storage)
            return out

        self._resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            self._see(t)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            self._see(t)
        return out


def optimizer_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters, their gradients and the optimizer's state tensors."""
    out: list[torch.Tensor] = []
    for p in module.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def bucket_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """autopar's gradient buckets (``runtime/grad_buckets.py``): flat buffers allocated in the
    first backward and kept, as DDP's; alive all step, though a step touches them only late."""
    out: list[torch.Tensor] = []
    for m in module.modules():
        for b in getattr(getattr(m, "grad_buckets", None), "buckets", ()):
            if isinstance(b.flat, torch.Tensor):
                out.append(b.flat)
    return out
