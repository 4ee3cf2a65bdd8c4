"""ZeRO-3 / FSDP-style parameters: gather for use, free after use, gather again for backward,
reduce-scatter the gradient.

``fsdp_gather`` all-gathers a parameter stored sharded on one mesh axis; its backward
reduce-scatters the (whole) gradient onto this rank's shard: the sum over the axis followed
by the slice, in one collective of half an all-reduce's bytes (ZeRO paper, 3 Psi (N-1)/N per
step with the all-gathers; FACTS.md).

An op that uses the gathered weight would normally save it for its backward, keeping every
layer's whole weights alive from forward to backward. ``regather_saved_weights(state)`` (a
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

All of it - live gathers, prefetch schedules, gradients in flight - is one model's
:class:`FsdpState`: the lowering gives each model its own (``passes/lower.py`` reads it into
the program as ``self.autopar_fsdp``), so two parallelized models in one process share none.

Written by hand: FSDP2 does this per module over one data mesh; here a parameter may also be
cut by other mesh axes, and the unit is the single parameter the plan put in ZeRO-3 layout.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

import torch.distributed as dist

from .collectives import COUNTER, AxisGroup

__all__ = ["FsdpState", "fsdp_gather", "regather_saved_weights"]


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
# Gradient reduce-scatters in flight at once: each keeps its whole input gradient alive until it
# is done, the oldest finished first (FSDP2 likewise bounds what it keeps in flight).
IN_FLIGHT = 2


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


def _land(param: torch.Tensor, out: torch.Tensor, work) -> None:
    work.wait()
    if param.grad is None:
        param.grad = out
    else:
        param.grad.add_(out)


class FsdpState:
    """One model's ZeRO-3 run-time state (module doc): its live gathered weights, the prefetch
    schedule of each of its programs, the saved-weight records of the forwards running, and
    the gradient reduce-scatters in flight."""

    def __init__(self) -> None:
        # storage address of a live gathered weight -> (weak ref to its base tensor, shard, dim, group)
        self.gathered: dict[int, tuple] = {}
        self.schedules: "weakref.WeakKeyDictionary[object, _Schedule]" = weakref.WeakKeyDictionary()
        self.active: list[_Schedule] = []
        self.packed: list[_Packed] = []
        self.grads: list[tuple] = []  # (param, output buffer, work, input kept alive)

    def __repr__(self) -> str:
        return f"FsdpState(live gathers={len(self.gathered)}, grads in flight={len(self.grads)})"

    # --- gradients: reduce-scatters launched in backward, waited for at its end -----------------
    def finish_grads(self) -> None:
        pending = list(self.grads)
        self.grads.clear()
        for param, out, work, _ in pending:
            _land(param, out, work)

    def reduce_scatter(self, grad: torch.Tensor, dim: int, g: AxisGroup, param: torch.Tensor | None = None):
        """Sum over the axis, keep this rank's piece along ``dim`` (one buffer, ``dim`` outermost).
        With ``param`` (whose layout the piece has), launched asynchronously: the sum lands in
        ``param.grad`` at the end of backward and None is returned."""
        COUNTER.add("reduce_scatter", grad.numel() * grad.element_size(), g.size)
        front = grad.movedim(dim, 0).contiguous()
        out = front.new_empty((front.shape[0] // g.size, *front.shape[1:]))
        if param is None:
            _reduce_scatter_single(out, front, group=g.group)
            return out.movedim(0, dim)
        if not self.grads:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grads)
        self.grads.append((param, out, _reduce_scatter_single(out, front, group=g.group, async_op=True), front))
        while len(self.grads) > IN_FLIGHT:
            param, out, work, _ = self.grads.pop(0)
            _land(param, out, work)
        return None

    # --- saved-tensor hooks: a saved gathered weight is kept as its shard ----------------------
    def pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            return t
        entry = self.gathered.get(ptr)
        if entry is None:
            return t
        ref, shard, dim, group = entry
        root = ref()
        if root is None:
            del self.gathered[ptr]  # freed; the address now belongs to another tensor
            return t
        if not (t is root or t._base is root):
            return t
        return _Regather(shard, dim, group, t, self.packed[-1])

    @staticmethod
    def unpack(x):
        if not isinstance(x, _Regather):
            return x
        launch, x.launch, x.used = x.launch, None, True
        full = launch.result() if launch is not None else _gather(x.shard, x.dim, x.group)
        for j in range(x.index - 1, max(x.index - 1 - PREFETCH, -1), -1):  # the ones backward likely needs next
            prev = x.packed.items[j]
            if prev.launch is None and not prev.used and prev.param is not None:
                prev.launch = _Gather(prev.param.movedim(0, prev.dim), prev.dim, prev.group)
        return full.as_strided(x.size, x.stride, x.offset)


class _FsdpGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, dim, g, state):
        ctx.dim, ctx.g, ctx.state = dim, g, state
        ctx.param = _param_of(shard, dim)
        return state.active[-1].gather(shard, dim, g) if state.active else _gather(shard, dim, g)

    @staticmethod
    def backward(ctx, grad):
        return ctx.state.reduce_scatter(grad, ctx.dim, ctx.g, ctx.param), None, None, None


def fsdp_gather(shard, dim: int, g: AxisGroup, state: FsdpState):
    """The whole weights on the axis of ``g`` from this rank's ``shard`` (cut on ``dim``);
    backward reduce-scatters the gradient (summed over the axis) onto the shard. ``state`` is
    the model's (module doc)."""
    full = _FsdpGather.apply(shard, dim, g, state)
    if torch.is_grad_enabled() and full.requires_grad:
        # Keyed by storage, checked by the base tensor: the program may drop ``full`` itself
        # and pass on only views of it (a gradient sync on another axis, a transpose), and a
        # view keeps its base alive.
        root = full if full._base is None else full._base
        state.gathered[full.untyped_storage().data_ptr()] = (weakref.ref(root), shard, dim, g)
    return full


@contextlib.contextmanager
def regather_saved_weights(state: FsdpState, program: object = None) -> Iterator[None]:
    """Inside: ops save the model's gathered ZeRO-3 weights as their shards, and gathers are
    prefetched in the order of the previous run of the same ``program`` (see module doc)."""
    schedule = _Schedule() if program is None else state.schedules.setdefault(program, _Schedule())
    state.active.append(schedule)
    state.packed.append(_Packed())
    with torch.autograd.graph.saved_tensors_hooks(state.pack, state.unpack):
        try:
            yield
        finally:
            state.active.pop()
            state.packed.pop()
            schedule.end()
            for ptr in [p for p, (ref, *_) in state.gathered.items() if ref() is None]:
                del state.gathered[ptr]
