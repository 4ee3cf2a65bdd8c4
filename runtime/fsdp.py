"""ZeRO-3 / FSDP-style parameters: gather for use, free after use, gather again for backward,
reduce-scatter the gradient.

``fsdp_gather`` all-gathers a parameter stored sharded on one mesh axis; its backward
reduce-scatters the (whole) gradient onto this rank's shard: the sum over the axis followed
by the slice, in one collective of half an all-reduce's bytes (ZeRO paper, 3 Psi (N-1)/N per
step with the all-gathers; FACTS.md).

An op that uses the gathered weight would normally save it for its backward, keeping every
layer's whole weights alive from forward to backward. ``regather_saved_weights()`` (a
``torch.autograd.graph.saved_tensors_hooks`` context that ``ParallelModule.forward`` enters)
saves such a tensor as a reference to the shard plus its view geometry, and all-gathers it
again when backward unpacks it; the gathered copy is freed when the forward has used it.
The cost model prices the same: an all-gather in forward, one more in backward for each
op that saves the weight (``cost_model.saved_inputs``), and a reduce-scatter.

Overlap, as FSDP2 does it: in forward each gather launches the next one (in the order the
previous forward of the program ran them); in backward each re-gather launches the one saved
before it; a gradient's reduce-scatter is launched asynchronously and lands in ``.grad``
later (at most two in flight, the rest at the end of backward), for a parameter whose shard
is the parameter itself up to a transpose (otherwise it runs blocking, through autograd).

Written by hand: FSDP2 does this per module over one data mesh; here a parameter may also be
cut by other mesh axes, and the unit is the single parameter the plan put in ZeRO-3 layout.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

import torch.distributed as dist

from .collectives import COUNTER, AxisGroup, _g

__all__ = ["fsdp_gather", "regather_saved_weights"]

# storage address of a live gathered weight -> (weak ref to its base tensor, shard, dim, group)
_GATHERED: dict[int, tuple] = {}


# torch 2.13 renamed these; 2.11 has only the old names. Looked up at each call (not bound at
# import), so whatever wraps torch.distributed (a profiler, the tests' byte spy) sees the call.
def _all_gather_single(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class _Gather:
    """An all-gather along ``dim`` launched now (asynchronously), into one buffer laid out with
    ``dim`` outermost: a linear weight's transposed shard gathers with no copy, and the result
    is a view of the buffer."""

    def __init__(self, shard: torch.Tensor, dim: int, g: AxisGroup):
        self.front = shard.detach().movedim(dim, 0).contiguous()  # a view for a transposed contiguous shard
        self.out = self.front.new_empty((self.front.shape[0] * g.size, *self.front.shape[1:]))
        self.work = _all_gather_single(self.out, self.front, group=g.group, async_op=True)
        self.dim = dim
        COUNTER.add("all_gather", self.out.numel() * self.out.element_size(), g.size)

    def result(self) -> torch.Tensor:
        self.work.wait()
        self.front = None
        return self.out.movedim(0, self.dim)


def _gather(shard: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    return _Gather(shard, dim, g).result()


def _param_of(shard: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The parameter (a leaf) that ``shard`` is a view of with ``dim`` moved to the front, if
    so: then the gather can be launched from the parameter alone (prefetch), and the gradient
    of the shard is the parameter's."""
    base = shard if shard._base is None else shard._base
    front = shard.movedim(dim, 0)
    if (base.is_leaf and base.requires_grad and front.shape == base.shape and front.stride() == base.stride()
            and front.data_ptr() == base.data_ptr()):
        return base
    return None


# --- prefetch: the next gather starts while the current weight is in use ----------------------
# Forward: the order of gathers in the previous forward of the same program is the schedule;
# gather i launches gather i+1 (one weight ahead, as FSDP2 prefetches one module ahead). Every
# rank runs the same program, so every rank launches the same collectives in the same order.


PREFETCH = 1  # gathers launched ahead of the one in use (forward and backward; FSDP2 also prefetches one)


class _Schedule:
    def __init__(self) -> None:
        self.last: list = []  # (param, dim, group) or None, per gather of the previous forward
        self.now: list = []
        self.pending: dict[int, tuple] = {}  # index -> (param, dim, group, _Gather)

    def gather(self, shard: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
        i = len(self.now)
        param = _param_of(shard, dim)
        self.now.append((param, dim, g) if param is not None else None)
        hit = self.pending.pop(i, None)
        if hit is not None and hit[0] is param and hit[1] == dim and hit[2] is g:
            full = hit[3].result()
        else:
            if hit is not None:
                hit[3].result()  # launched on every rank: finish it, then do what the program asks
            full = _gather(shard, dim, g)
        for j in range(i + 1, min(i + 1 + PREFETCH, len(self.last))):
            nxt = self.last[j]
            if nxt is not None and j not in self.pending:
                p, d, grp = nxt
                self.pending[j] = (p, d, grp, _Gather(p.movedim(0, d), d, grp))
        return full

    def end(self) -> None:
        for *_, launch in self.pending.values():
            launch.result()
        self.pending.clear()
        self.last, self.now = self.now, []


_SCHEDULES: "weakref.WeakKeyDictionary[object, _Schedule]" = weakref.WeakKeyDictionary()
_ACTIVE: list[_Schedule] = []


# --- gradients: reduce-scatters launched in backward, waited for at its end ---------------------
# Each keeps its whole input gradient alive until it is done: at most _IN_FLIGHT at a time,
# the oldest finished first (FSDP2 likewise bounds what it keeps in flight).
_GRADS: list[tuple] = []  # (param, output buffer, work, input kept alive)
_IN_FLIGHT = 2


def _land(param: torch.Tensor, out: torch.Tensor, work) -> None:
    work.wait()
    if param.grad is None:
        param.grad = out
    else:
        param.grad.add_(out)


def _finish_grads() -> None:
    pending = list(_GRADS)
    _GRADS.clear()
    for param, out, work, _ in pending:
        _land(param, out, work)


def _reduce_scatter(grad: torch.Tensor, dim: int, g: AxisGroup, param: torch.Tensor | None = None):
    """Sum over the axis, keep this rank's piece along ``dim`` (one buffer, ``dim`` outermost).
    With ``param`` (whose layout the piece has), launched asynchronously: the sum lands in
    ``param.grad`` at the end of backward and None is returned."""
    COUNTER.add("reduce_scatter", grad.numel() * grad.element_size(), g.size)
    front = grad.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // g.size, *front.shape[1:]))
    if param is None:
        _reduce_scatter_single(out, front, group=g.group)
        return out.movedim(0, dim)
    if not _GRADS:
        torch.autograd.Variable._execution_engine.queue_callback(_finish_grads)
    _GRADS.append((param, out, _reduce_scatter_single(out, front, group=g.group, async_op=True), front))
    while len(_GRADS) > _IN_FLIGHT:
        param, out, work, _ = _GRADS.pop(0)
        _land(param, out, work)
    return None


class _FsdpGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, dim, g):
        ctx.dim, ctx.g = dim, g
        ctx.param = _param_of(shard, dim)
        return _ACTIVE[-1].gather(shard, dim, g) if _ACTIVE else _gather(shard, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.g, ctx.param), None, None


def fsdp_gather(shard, dim: int, g: AxisGroup | str):
    """The whole weights on the axis of ``g`` from this rank's ``shard`` (cut on ``dim``);
    backward reduce-scatters the gradient (summed over the axis) onto the shard."""
    group = _g(g)
    full = _FsdpGather.apply(shard, dim, group)
    if torch.is_grad_enabled() and full.requires_grad:
        # Keyed by storage, checked by the base tensor: the program may drop ``full`` itself
        # and pass on only views of it (a gradient sync on another axis, a transpose), and a
        # view keeps its base alive.
        root = full if full._base is None else full._base
        _GATHERED[full.untyped_storage().data_ptr()] = (weakref.ref(root), shard, dim, group)
    return full


class _Packed:
    """The saved gathered weights of one forward, in order: backward unpacks them about in
    reverse, and unpacking one launches the gather of the one before it."""

    def __init__(self) -> None:
        self.items: list["_Regather"] = []


class _Regather:
    """A saved view of a gathered weight, held as its shard: gathered again on unpack."""

    __slots__ = ("shard", "dim", "group", "size", "stride", "offset", "param", "packed", "index", "launch", "used")

    def __init__(self, shard, dim, group, t: torch.Tensor, packed: _Packed):
        self.shard, self.dim, self.group = shard, dim, group
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.param = _param_of(shard, dim)
        self.packed, self.index, self.launch, self.used = packed, len(packed.items), None, False
        packed.items.append(self)


_PACKED: list[_Packed] = []


def _pack(t: torch.Tensor):
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return t
    entry = _GATHERED.get(ptr)
    if entry is None:
        return t
    ref, shard, dim, group = entry
    root = ref()
    if root is None:
        del _GATHERED[ptr]  # freed; the address now belongs to another tensor
        return t
    if not (t is root or t._base is root):
        return t
    return _Regather(shard, dim, group, t, _PACKED[-1])


def _unpack(x):
    if not isinstance(x, _Regather):
        return x
    launch, x.launch, x.used = x.launch, None, True
    full = launch.result() if launch is not None else _gather(x.shard, x.dim, x.group)
    for j in range(x.index - 1, max(x.index - 1 - PREFETCH, -1), -1):  # the ones backward likely needs next
        prev = x.packed.items[j]
        if prev.launch is None and not prev.used and prev.param is not None:
            prev.launch = _Gather(prev.param.movedim(0, prev.dim), prev.dim, prev.group)
    return full.as_strided(x.size, x.stride, x.offset)


@contextlib.contextmanager
def regather_saved_weights(program: object = None) -> Iterator[None]:
    """Inside: ops save gathered ZeRO-3 weights as their shards, and gathers are prefetched
    in the order of the previous run of the same ``program`` (see module doc)."""
    schedule = _Schedule() if program is None else _SCHEDULES.setdefault(program, _Schedule())
    _ACTIVE.append(schedule)
    _PACKED.append(_Packed())
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        try:
            yield
        finally:
            _ACTIVE.pop()
            _PACKED.pop()
            schedule.end()
            for ptr in [p for p, (ref, *_) in _GATHERED.items() if ref() is None]:
                del _GATHERED[ptr]
