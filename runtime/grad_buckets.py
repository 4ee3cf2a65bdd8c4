"""Bucketed, overlapped gradient all-reduce for replicated parameters (what DDP's reducer does).

The lowering (``passes/defer_sync.py``) takes a parameter's gradient all-reduce out of the
program where that is exact: every gradient contribution to the parameter passes through the
same ``grad_sync`` steps and nothing else. Such a parameter's sync is run here instead:

* a hook on the parameter receives its whole fresh gradient (all uses summed, before it is
  accumulated into ``.grad``) and copies it into its slot of a flat bucket;
* buckets (``bucket_bytes``, the first one ``first_bucket_bytes``, as DDP sizes them) are
  filled in reverse order of the parameters (the order backward produces their gradients) and
  launched as asynchronous all-reduces strictly in bucket order, so every rank issues the
  same collectives in the same order whatever order the hooks fire in;
* an autograd-engine callback at the end of backward waits for them all (running the further
  axes of a parameter synced over several mesh axes) and makes ``.grad`` the parameter's slot
  of the bucket, which now holds the sum (DDP's ``gradient_as_bucket_view``: no copy out of
  the bucket; the gradient autograd made is dropped), so a plain ``loss.backward();
  opt.step()`` sees synchronized gradients. The next backward overwrites the slot: a gradient
  kept across steps must be cloned (``ParallelModule.full_grads`` does);
* a bucket of one parameter (the first, small bucket holds a large one alone: the GPT's head)
  needs no flat buffer: once AccumulateGrad has made the fresh gradient ``.grad`` (a
  post-accumulate hook), that tensor itself is all-reduced in place, with no copy at all.

Accumulation across backward calls stays exact: when ``.grad`` already holds a value the hook
sets it aside (a copy, if it is the slot itself) and the callback adds it to the sum.

Mixed precision: with ``reduce_dtype`` (bf16), a bucket holds and sends gradients in that dtype
(FSDP2's ``reduce_dtype``); the sums are cast back into the fp32 ``.grad`` (a copy: the slot
cannot be the gradient; with ``.grad`` already set, zeros accumulate and the sum is added). The fresh gradient
of a parameter read through a bf16 cast is an exact fp32 image of a bf16 value, so this sends
what an all-reduce of the bf16 gradient in the program would, at the bytes the plan prices.

Bytes: each parameter adds the bytes of its own all-reduce per axis to the byte counter, so
the counts equal the per-tensor all-reduces the plan predicts; a bucket is one call of the
summed size, which sends the same bytes in fewer calls.

Written by hand: DDP's reducer works on a whole module over one process group; here each
parameter may be synced over its own mesh axes, and only the parameters the plan leaves
replicated there take part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from autopar.cost_model.buckets import FIRST_GRAD_BUCKET_BYTES, GRAD_BUCKET_BYTES

from .collectives import COUNTER, AxisGroup

__all__ = ["GradBuckets", "DEFAULT_BUCKET_BYTES", "DEFAULT_FIRST_BUCKET_BYTES"]

# DDP's sizes (bucket_cap_mb; a small first bucket starts communication early); the cost
# model prices buckets of this size (cost_model/buckets.py).
DEFAULT_BUCKET_BYTES = GRAD_BUCKET_BYTES
DEFAULT_FIRST_BUCKET_BYTES = FIRST_GRAD_BUCKET_BYTES


@dataclass
class _Bucket:
    axes: tuple[AxisGroup, ...]
    dtype: torch.dtype
    device: torch.device
    params: list[torch.nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # per parameter: the bytes of its own all-reduce
    numel: int = 0
    flat: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)  # per parameter: its slot, shaped like it
    ready: dict[int, torch.Tensor | None] = field(default_factory=dict)  # index -> the .grad it had, or None
    work: object = None
    launched: bool = False
    alone: torch.Tensor | None = None  # this step's buffer when it is the one parameter's own .grad
    pending: bool = False  # that parameter's fresh gradient is on its way to .grad (no reference
    # held here meanwhile: AccumulateGrad takes a tensor nobody else holds without copying it)

    @property
    def buffer(self) -> torch.Tensor:
        return self.flat if self.alone is None else self.alone

    def allocate(self) -> None:
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.views = [self.flat[off:off + p.numel()].view_as(p) for p, off in zip(self.params, self.offsets)]


class GradBuckets:
    """Hooks on ``params`` (forward order), each synced over its ``axes`` (see module doc)."""

    def __init__(self, params: Sequence[tuple[torch.nn.Parameter, tuple[AxisGroup, ...]]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 reduce_dtype: torch.dtype | None = None):
        self.reduce_dtype = reduce_dtype  # None: each gradient's own dtype
        self.buckets: list[_Bucket] = []
        self.slot: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, index in bucket)
        open_by_key: dict[tuple, int] = {}
        for p, axes in reversed(list(params)):
            if id(p) in self.slot:
                continue
            key = (tuple(g.name for g in axes), self._wire_dtype(p), p.device)
            b = open_by_key.get(key)
            if b is None:
                b = open_by_key[key] = len(self.buckets)
                self.buckets.append(_Bucket(tuple(axes), self._wire_dtype(p), p.device))
            bucket = self.buckets[b]
            self.slot[id(p)] = (b, len(bucket.params))
            bucket.params.append(p)
            bucket.offsets.append(bucket.numel)
            bucket.sent.append(p.numel() * self._wire_bytes(p))
            bucket.numel += p.numel()
            cap = first_bucket_bytes if b == 0 else bucket_bytes
            if bucket.numel * self._wire_bytes(p) >= cap:
                del open_by_key[key]  # full: the next parameter of this kind opens a new bucket
        self._next = 0  # buckets launch in index order
        self._armed = False
        # Buckets of the last backward launched from a hook, i.e. while backward still ran
        # (the rest launch in the end-of-backward callback): how much communication overlaps.
        self.launched_during_backward = 0
        self._early = 0
        unique = {id(p): p for p, _ in params}
        self.handles = [p.register_hook(self._hook(p, *self.slot[id(p)])) for p in unique.values()]
        for p in unique.values():  # a bucket of one parameter: its .grad is all-reduced in place
            b, _ = self.slot[id(p)]
            if len(self.buckets[b].params) == 1 and self.buckets[b].dtype == p.dtype:
                self.handles.append(p.register_post_accumulate_grad_hook(self._alone_hook(b)))

    def _wire_dtype(self, p: torch.Tensor) -> torch.dtype:
        return p.dtype if self.reduce_dtype is None or not p.is_floating_point() else self.reduce_dtype

    def _wire_bytes(self, p: torch.Tensor) -> int:
        return torch.empty((), dtype=self._wire_dtype(p)).element_size()

    def _hook(self, p: torch.nn.Parameter, b: int, i: int):
        bucket = self.buckets[b]
        as_view = bucket.dtype == p.dtype  # .grad can be the bucket's slot itself (no copy out)
        alone = as_view and len(bucket.params) == 1

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self._armed:
                self._armed = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if alone and p.grad is None:  # no copy: AccumulateGrad makes it .grad, then _alone_hook sends it
                bucket.pending = True
                return grad
            if bucket.flat is None:
                bucket.allocate()
            view = bucket.views[i]
            before = p.grad
            if before is not None and as_view:
                # accumulating onto an earlier sum: keep it apart (its slot gets the fresh
                # gradient) and let AccumulateGrad take the fresh one; _finish adds them
                p.grad = None
                if before is view:
                    before = before.clone()
            view.copy_(grad)
            bucket.ready[i] = before
            if len(bucket.ready) == len(bucket.params) and b == self._next:
                self._launch_ready()
            # The synchronized gradient lands in .grad at the end of backward (_finish).
            return grad if before is None or as_view else torch.zeros_like(grad)
        return hook

    def _alone_hook(self, b: int):
        bucket = self.buckets[b]

        def hook(p: torch.nn.Parameter) -> None:
            if not bucket.pending:  # it went through the flat buffer (hook above)
                return
            bucket.pending = False
            if p.grad.is_contiguous():
                bucket.alone = p.grad
            else:  # AccumulateGrad laid it out otherwise: through the flat buffer after all
                if bucket.flat is None:
                    bucket.allocate()
                bucket.views[0].copy_(p.grad)
            bucket.ready[0] = None
            if b == self._next:
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
                self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1
            self._early += 1

    @staticmethod
    def _launch(bucket: _Bucket) -> None:
        bucket.work = dist.all_reduce(bucket.buffer, group=bucket.axes[0].group, async_op=True)
        bucket.launched = True

    @staticmethod
    def _count(bucket: _Bucket) -> None:
        """Each parameter's own all-reduce, per axis, on the byte counter (module doc)."""
        for g in bucket.axes:
            for i in bucket.ready:
                COUNTER.add("all_reduce", bucket.sent[i], g.size)

    def _finish(self) -> None:
        self._armed = False
        try:
            for bucket in self.buckets[self._next:]:
                if len(bucket.ready) == len(bucket.params):
                    self._launch(bucket)
                elif bucket.ready:  # some parameters got no gradient this time: their slots are not sent
                    for i in sorted(bucket.ready):
                        dist.all_reduce(bucket.views[i], group=bucket.axes[0].group)
            for bucket in self.buckets:
                if not bucket.ready:
                    continue
                self._count(bucket)
                if bucket.launched:
                    bucket.work.wait()
                for g in bucket.axes[1:]:  # further mesh axes of the same sum, after the first
                    if len(bucket.ready) == len(bucket.params):
                        dist.all_reduce(bucket.buffer, group=g.group)
                        continue
                    for i in sorted(bucket.ready):
                        dist.all_reduce(bucket.views[i], group=g.group)
                if bucket.alone is not None:  # the sum is in .grad already
                    continue
                for i, before in bucket.ready.items():
                    p, summed = bucket.params[i], bucket.views[i]
                    if summed.dtype == p.dtype:
                        # .grad is the slot (as DDP's gradient_as_bucket_view): the next backward
                        # overwrites it, so a copy kept across steps must be cloned
                        if before is not None:
                            summed.add_(before)
                        p.grad = summed
                    elif before is None:
                        p.grad.copy_(summed)
                    else:
                        p.grad.add_(summed)
        finally:
            self.launched_during_backward, self._early = self._early, 0
            self._next = 0
            for bucket in self.buckets:
                bucket.ready, bucket.work, bucket.launched, bucket.alone, bucket.pending = {}, None, False, None, False

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
