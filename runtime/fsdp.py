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

Units, as FSDP2 groups a module's parameters: the lowering tags each gather with its
parameter's *unit* (``unit_key``: the repeated block it sits in, e.g. ``blocks.3``, else its
own module). Gathers of one unit that ran one after another in the previous forward of the
same program are one flat all-gather (each rank's shards concatenated; every weight copied
out of the buffer), their gradients one flat reduce-scatter once the unit's last gradient
arrives, and the saved weights of one unit backward unpacks one re-gather. The bytes are the
per-parameter ones (the ring formulas are linear in the payload); the number of collectives
drops from one per parameter to one per unit. On a latency-bound link (gloo on CPU: every
collective waits for all ranks to be scheduled) that is most of ZeRO-3's cost.

Overlap, as FSDP2 does it: in forward each unit's gather launches the next unit's (in the
order the previous forward of the program ran them); in backward each re-gather launches the
one of the unit saved before it; a unit's gradient reduce-scatter is launched asynchronously
and lands in ``.grad`` later (at most two in flight, the rest at the end of backward). Only a
parameter whose shard is the parameter itself up to a transpose joins a unit; any other
gather runs alone, blocking, with its reduce-scatter through autograd.

All of it - live gathers, prefetch schedules, gradients in flight - is one model's
:class:`FsdpState`: the lowering gives each model its own (``passes/lower.py`` reads it into
the program as ``self.autopar_fsdp``), so two parallelized models in one process share none.

Written by hand: FSDP2 does this per module over one data mesh; here a parameter may also be
cut by other mesh axes, and the units come from the plan's ZeRO-3 layouts and the program's
order of use, not from module wrapping.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Sequence

import torch

import torch.distributed as dist

from autopar.cost_model.blocks import unit_key  # noqa: F401 (public here too: the lowering and tests read it)

from .collectives import COUNTER, AxisGroup

__all__ = ["FsdpState", "fsdp_gather", "regather_saved_weights", "unit_key"]


# torch 2.13 renamed these; 2.11 has only the old names. Looked up at each call (not bound at
# import), so whatever wraps torch.distributed (a profiler, the tests' byte spy) sees the call.
def _all_gather_single(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class _Flat:
    """One all-gather of several weights along the same axis, launched now (asynchronously):
    each rank's pieces (``dim`` outermost) concatenated, the whole weights copied out of the
    gathered buffer when it lands. One member: the buffer is the weight (a linear weight's
    transposed shard gathers with no copy). Also collects the members' gradients for the
    unit's one reduce-scatter (``FsdpState.unit_grad``)."""

    def __init__(self, members: Sequence[tuple[torch.Tensor, int]], g: AxisGroup, params: Sequence = ()):
        fronts = [t.detach().movedim(d, 0).contiguous() for t, d in members]
        self.shapes = [f.shape for f in fronts]
        self.dims = [d for _, d in members]
        self.params = list(params)  # the leaf of each member (unit gathers) or empty
        self.g = g
        flat = fronts[0].reshape(-1) if len(fronts) == 1 else torch.cat([f.reshape(-1) for f in fronts])
        self.out = flat.new_empty(flat.numel() * g.size)
        self.work = _all_gather_single(self.out, flat, group=g.group, async_op=True)
        COUNTER.add("all_gather", self.out.numel() * self.out.element_size(), g.size)
        self.fulls: list | None = None
        self.taken: list[int] = []
        self.grads: list = [None] * len(members)

    def _land(self) -> None:
        self.work.wait()
        self.work = None  # the work holds its tensors; this object lives on in autograd's ctx until backward
        n = self.g.size
        if len(self.shapes) == 1:
            s = self.shapes[0]
            self.fulls = [self.out.view(s[0] * n, *s[1:])]
        else:
            sizes = [s.numel() for s in self.shapes]
            pieces = self.out.view(n, -1).split(sizes, dim=1)
            self.fulls = [p.contiguous().view(s[0] * n, *s[1:]) for p, s in zip(pieces, self.shapes)]
        self.out = None

    def take(self, k: int) -> torch.Tensor:
        """Member ``k``'s whole weight, its cut dim back in place."""
        if self.fulls is None:
            self._land()
        full, self.fulls[k] = self.fulls[k], None
        self.taken.append(k)
        return full.movedim(0, self.dims[k])

    def finish(self) -> None:
        """Wait for the gather and drop what no one took."""
        if self.fulls is None:
            self._land()
        self.fulls = None


def _gather(shard: torch.Tensor, dim: int, g: AxisGroup) -> torch.Tensor:
    return _Flat([(shard, dim)], g).take(0)


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


def _runs(keys: Sequence) -> list[tuple[int, int]]:
    """Per position, the (start, stop) of the run of equal consecutive keys holding it; a None
    key is a run of its own."""
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] is None or keys[i] != keys[start]:
            spans += [(start, i)] * (i - start)
            start = i
    return spans


# --- forward: the order of gathers in the previous forward of the same program is the schedule;
# a unit's gather launches the next unit's (one unit ahead, as FSDP2 prefetches one module ahead).
# Every rank runs the same program, so every rank launches the same collectives in the same order.

# Gradient reduce-scatters in flight at once: each keeps its whole input gradient alive until it
# is done, the oldest finished first (FSDP2 likewise bounds what it keeps in flight).
IN_FLIGHT = 2


class _Schedule:
    def __init__(self) -> None:
        self.last: list = []  # (param, dim, group, unit) or None, per gather of the previous forward
        self.spans: list[tuple[int, int]] = []  # per gather of ``last``: its unit's (start, stop)
        self.now: list = []
        self.pending: dict[int, _Flat] = {}  # unit start -> its launched gather

    def _launch(self, start: int) -> _Flat:
        if start not in self.pending:
            stop = self.spans[start][1]
            members = self.last[start:stop]
            self.pending[start] = _Flat([(p, d) for p, d, *_ in members], members[0][2], [m[0] for m in members])
        return self.pending[start]

    def gather(self, shard: torch.Tensor, dim: int, g: AxisGroup, unit: str | None):
        """(whole weights, the unit gather they came from or None, member index)."""
        i = len(self.now)
        param = _param_of(shard, dim)
        entry = (param, dim, g, unit) if param is not None else None
        self.now.append(entry)
        prev = self.last[i] if i < len(self.last) else None
        if entry is None or prev is None or not (prev[0] is param and prev[1] == dim and prev[2] is g
                                                 and prev[3] == unit):
            return _gather(shard, dim, g), None, 0  # off the schedule (or the first forward)
        start, stop = self.spans[i]
        launch = self._launch(start)
        if stop < len(self.last) and self.last[stop] is not None:
            self._launch(self.spans[stop][0])  # prefetch the next unit
        return launch.take(i - start), launch, i - start

    def end(self) -> None:
        for launch in self.pending.values():
            launch.finish()
        self.pending.clear()
        self.last, self.now = self.now, []
        keys = [None if e is None or e[3] is None else (id(e[2]), e[3]) for e in self.last]
        self.spans = _runs(keys)


# --- backward: saved gathered weights come back unit by unit --------------------------------


class _Packed:
    """The saved gathered weights of one forward, in order: backward unpacks them about in
    reverse; unpacking one re-gathers its unit's (the run of saved weights of one unit) and
    launches the re-gather of the unit saved before it.

    It holds its items weakly (autograd's saved tensors own them) and their unit keys: a strong
    list made a reference cycle (item -> this -> item) that outlived the backward until the
    garbage collector ran, and with it every item's shard. Where the shard is not the stored
    parameter (a 2D head weight gathered on another axis first) that kept 4 MiB of the bench
    GPT alive into the next step (bench/memwhere.py: ``?:clone.default``)."""

    def __init__(self) -> None:
        self.items: list[weakref.ref] = []
        self.keys: list = []  # per item: its unit key (``_runs``), or None
        self.spans: list[tuple[int, int]] | None = None

    def add(self, x: "_Regather") -> int:
        self.items.append(weakref.ref(x))
        self.keys.append(None if x.param is None or x.unit is None else (id(x.group), x.unit))
        return len(self.items) - 1

    def launch(self, index: int) -> None:
        """Re-gather (asynchronously) the unit holding item ``index``: its items not yet used."""
        if self.spans is None or len(self.spans) != len(self.items):
            self.spans = _runs(self.keys)
        start, stop = self.spans[index]
        alive = [ref() for ref in self.items[start:stop]]
        todo = [x for x in alive if x is not None and x.launch is None and not x.used and x.param is not None]
        if todo:
            flat = _Flat([(x.param, x.dim) for x in todo], todo[0].group)
            for k, x in enumerate(todo):
                x.launch = (flat, k)


class _Regather:
    """A saved view of a gathered weight, held as its shard: gathered again on unpack."""

    __slots__ = ("shard", "dim", "group", "unit", "size", "stride", "offset", "param", "packed", "index", "launch",
                 "used", "__weakref__")

    def __init__(self, shard, dim, group, unit, t: torch.Tensor, packed: _Packed):
        self.shard, self.dim, self.group, self.unit = shard, dim, group, unit
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.param = _param_of(shard, dim)
        self.packed, self.launch, self.used = packed, None, False
        self.index = packed.add(self)


def _land(landings, work) -> None:
    work.wait()
    for param, grad in landings:
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)


class FsdpState:
    """One model's ZeRO-3 run-time state (module doc): its live gathered weights, the prefetch
    schedule of each of its programs, the saved-weight records of the forwards running, and
    the gradient reduce-scatters collecting or in flight."""

    def __init__(self) -> None:
        # storage address of a live gathered weight -> (weak ref to its base tensor, shard, dim, group, unit)
        self.gathered: dict[int, tuple] = {}
        self.schedules: "weakref.WeakKeyDictionary[object, _Schedule]" = weakref.WeakKeyDictionary()
        self.active: list[_Schedule] = []
        self.packed: list[_Packed] = []
        self.collecting: list[_Flat] = []  # units with some of their gradients in
        self.grads: list[tuple] = []  # (landings [(param, grad)], work, input kept alive)
        self.callback = False  # the end-of-backward flush is queued

    def __repr__(self) -> str:
        return f"FsdpState(live gathers={len(self.gathered)}, grads in flight={len(self.grads)})"

    # --- gradients: reduce-scatters launched in backward, waited for at its end -----------------
    def finish_grads(self) -> None:
        self.callback = False
        for unit in list(self.collecting):  # a member without a gradient this backward
            self._launch_unit(unit)
        pending = list(self.grads)
        self.grads.clear()
        for landings, work, _ in pending:
            _land(landings, work)

    def _queue_finish(self) -> None:
        if not self.callback:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grads)
            self.callback = True

    def _in_flight(self, landings, work, keep) -> None:
        self.grads.append((landings, work, keep))
        while len(self.grads) > IN_FLIGHT:
            _land(*self.grads.pop(0)[:2])

    def unit_grad(self, unit: _Flat, k: int, grad: torch.Tensor) -> None:
        """Member ``k``'s whole gradient; the unit's reduce-scatter starts when all taken members'
        are in (or at the end of backward), and lands in the members' ``.grad``."""
        self._queue_finish()
        if all(x is None for x in unit.grads):
            self.collecting.append(unit)
        unit.grads[k] = grad
        if all(unit.grads[j] is not None for j in unit.taken):
            self._launch_unit(unit)

    def _launch_unit(self, unit: _Flat) -> None:
        self.collecting.remove(unit)
        ks = [k for k, gr in enumerate(unit.grads) if gr is not None]
        n = unit.g.size
        fronts = [unit.grads[k].movedim(unit.dims[k], 0).reshape(n, -1) for k in ks]
        unit.grads = [None] * len(unit.grads)
        inp = fronts[0].contiguous() if len(fronts) == 1 else torch.cat(fronts, dim=1)
        COUNTER.add("reduce_scatter", inp.numel() * inp.element_size(), n)
        out = inp.new_empty(inp.numel() // n)
        work = _reduce_scatter_single(out, inp.view(-1), group=unit.g.group, async_op=True)
        pieces = out.split([unit.shapes[k].numel() for k in ks])
        landings = [(unit.params[k], p.view(unit.params[k].shape)) for k, p in zip(ks, pieces)]
        self._in_flight(landings, work, inp)

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
        self._queue_finish()
        self._in_flight([(param, out)], _reduce_scatter_single(out, front, group=g.group, async_op=True), front)
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
        ref, shard, dim, group, unit = entry
        root = ref()
        if root is None:
            del self.gathered[ptr]  # freed; the address now belongs to another tensor
            return t
        if not (t is root or t._base is root):
            return t
        return _Regather(shard, dim, group, unit, t, self.packed[-1])

    @staticmethod
    def unpack(x):
        if not isinstance(x, _Regather):
            return x
        if x.launch is None and not x.used:
            x.packed.launch(x.index)
        launch, x.launch, x.used = x.launch, None, True
        full = launch[0].take(launch[1]) if launch is not None else _gather(x.shard, x.dim, x.group)
        start = x.packed.spans[x.index][0] if x.packed.spans is not None else x.index
        if start > 0:  # the unit backward likely needs next
            x.packed.launch(start - 1)
        return full.as_strided(x.size, x.stride, x.offset)


class _FsdpGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, dim, g, unit, state):
        ctx.dim, ctx.g, ctx.state = dim, g, state
        if state.active:
            full, ctx.unit, ctx.k = state.active[-1].gather(shard, dim, g, unit)
        else:
            full, ctx.unit, ctx.k = _gather(shard, dim, g), None, 0
        ctx.param = _param_of(shard, dim)
        return full

    @staticmethod
    def backward(ctx, grad):
        if ctx.unit is not None:
            ctx.state.unit_grad(ctx.unit, ctx.k, grad)
            return None, None, None, None, None
        return ctx.state.reduce_scatter(grad, ctx.dim, ctx.g, ctx.param), None, None, None, None


def fsdp_gather(shard, dim: int, g: AxisGroup, state: FsdpState, unit: str | None = None):
    """The whole weights on the axis of ``g`` from this rank's ``shard`` (cut on ``dim``);
    backward reduce-scatters the gradient (summed over the axis) onto the shard. ``state`` is
    the model's, ``unit`` the parameter's ZeRO-3 unit (module doc; None: a unit of its own)."""
    full = _FsdpGather.apply(shard, dim, g, unit, state)
    if torch.is_grad_enabled() and full.requires_grad:
        # Keyed by storage, checked by the base tensor: the program may drop ``full`` itself
        # and pass on only views of it (a gradient sync on another axis, a transpose), and a
        # view keeps its base alive.
        root = full if full._base is None else full._base
        state.gathered[full.untyped_storage().data_ptr()] = (weakref.ref(root), shard, dim, g, unit)
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
