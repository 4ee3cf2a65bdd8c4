"""Ring attention: exact softmax attention with the sequence split over one mesh axis.

Layout. The ``n`` ranks of an axis group each hold one contiguous block of the sequence for
Q, K and V (``[batch, heads, seq_local, head_dim]``); rank ``i`` holds block ``i``. The output
is rank ``i``'s block of ``scaled_dot_product_attention`` over the whole sequence.

Forward. Queries never move; the K/V blocks walk around the ring. At step ``t`` (``0 .. n-1``)
rank ``i`` holds the block that started on rank ``src = (i - t) mod n``; before computing with it,
it posts the send of that block to ``i + 1`` and the receive of the next one from ``i - 1``, so
the transfer overlaps the block's compute; after ``n - 1`` steps every rank has seen every block.
The softmax is assembled online (as in FlashAttention): per query row a running maximum ``m``,
a running sum ``l`` of ``exp(score - m)`` and an unnormalized output ``acc``. A new block with
row maximum ``m_b`` rescales the old state by ``exp(m - max(m, m_b))`` before adding its own
terms, so no row ever sees more than one block of scores and nothing overflows. At the end
``out = acc / l`` and ``lse = m + log l`` (the log-sum-exp of the row), kept for the backward.
Scores, sums and products are in fp32 (fp64 for fp64 inputs) whatever the input dtype.

Causal masking is by block: for queries of block ``i`` a key block ``src < i`` lies wholly in
the past (no mask), ``src == i`` needs the triangle, and ``src > i`` lies wholly in the future
and is skipped - but still forwarded, since the ring is the same for everyone. (The work is
therefore unbalanced: rank ``i`` computes ``i + 1`` blocks. Zig-zag layouts fix that by giving
every rank one early and one late chunk; this module keeps the plain contiguous layout.)

Backward (a hand-written autograd rule, the FlashAttention backward applied per block). With
``P = exp(S - lse)`` recomputed from the saved log-sum-exp and ``D = rowsum(dO * O)``:
``dV += P^T dO``, ``dS = P * (dO V^T - D)``, ``dQ += dS K * scale``, ``dK += dS^T Q * scale``.
dQ stays on the rank. dK and dV belong to the block's owner but receive a contribution from
every rank the block visits, so they travel with it: K/V walk the ring again (``n - 1`` sends,
prefetched as in the forward) and each rank adds its share to the dK/dV accumulator that
arrives with the block and passes it on; after its last visit (on rank ``src - 1``) the
accumulator takes one more hop home, ``n`` sends in all. Accumulators travel in the
accumulation dtype (fp32, or fp64), never rounded to bf16/fp16 on the way.

Communication per rank (``E`` = element size, ``A = max(E, 4)`` the accumulator's, ``B = b h s d``
elements of one K or V block): forward ``(n - 1) * 2 B E``; backward ``(n - 1) * 2 B E +
n * 2 B A``. K and V go in one message, as do dK and dV. :func:`ring_attention_bytes` and
:func:`ring_attention_seconds` are these formulas; the runtime counts every send in
:data:`~autopar.runtime.collectives.COUNTER` under ``"p2p"``.

Peers. The group is usually one axis of a larger mesh, so the ring neighbours' group indices
are turned into global ranks (``dist.get_global_rank``) before ``isend``/``irecv``, which
address global ranks on every torch from 2.11 on. A group of size 1 communicates nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from autopar.cost_model.comm import p2p_s
from autopar.mesh import Link

from .collectives import COUNTER, AxisGroup

__all__ = ["ring_attention", "ring_attention_bytes", "ring_attention_seconds"]

# Distinct tags per stream, so a K/V message can never be matched with a dK/dV receive.
_TAG_KV, _TAG_DKV = 17, 18


def ring_attention_bytes(b: int, h: int, s_local: int, d: int, elem_size: int, n: int,
                         backward: bool = True) -> float:
    """Bytes one rank sends for one ring attention call (forward, plus backward if asked)."""
    if n == 1:
        return 0.0
    block_elems = b * h * s_local * d
    kv_bytes = 2 * block_elems * elem_size
    dkv_bytes = 2 * block_elems * max(elem_size, 4)  # accumulators travel in fp32 (or fp64)
    total = (n - 1) * kv_bytes
    if backward:
        total += (n - 1) * kv_bytes + n * dkv_bytes
    return float(total)


def ring_attention_seconds(b: int, h: int, s_local: int, d: int, elem_size: int, n: int, link: Link,
                           backward: bool = True) -> float:
    """Communication time of one call, one ``p2p_s`` per ring step (a step's sends go together).

    Forward: ``n - 1`` steps each moving K/V. Backward: ``n - 1`` steps moving K/V and dK/dV, and
    a last step moving dK/dV home. The overlap with compute is not subtracted here.
    """
    if n == 1:
        return 0.0
    block_elems = b * h * s_local * d
    kv_bytes = 2 * block_elems * elem_size
    dkv_bytes = 2 * block_elems * max(elem_size, 4)
    seconds = (n - 1) * p2p_s(kv_bytes, link)
    if backward:
        seconds += (n - 1) * p2p_s(kv_bytes + dkv_bytes, link) + p2p_s(dkv_bytes, link)
    return seconds


class _Ring:
    """This rank's neighbours on the ring of one axis group, as global ranks."""

    def __init__(self, g: AxisGroup) -> None:
        self.g = g
        group = g.group if g.group is not None else dist.group.WORLD
        self.group = group
        self.next = dist.get_global_rank(group, (g.rank + 1) % g.size)
        self.prev = dist.get_global_rank(group, (g.rank - 1) % g.size)

    def shift(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Post the send of ``send`` to the next rank and the receive of its twin from the previous one."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        COUNTER.add("p2p", send.numel() * send.element_size(), self.g.size)
        # Receive first: with both posted asynchronously the order does not matter for
        # correctness, but it lets the transport land the message straight into ``recv``.
        works = [dist.irecv(recv, src=self.prev, group=self.group, tag=tag),
                 dist.isend(send, dst=self.next, group=self.group, tag=tag)]
        return recv, works


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    """``q k^T * scale`` for one block pair, with the causal triangle masked on the diagonal block."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _visible(src: int, rank: int, causal: bool) -> bool:
    return not causal or src <= rank


def _forward(q, k, v, ring: _Ring | None, rank: int, n: int, causal: bool, scale: float):
    acc_t = _acc_dtype(q.dtype)
    q32 = q.to(acc_t)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=acc_t, device=q.device)  # running row max
    l = torch.zeros(q.shape[:-1], dtype=acc_t, device=q.device)  # running sum of exp(s - m)
    acc = torch.zeros(q.shape, dtype=acc_t, device=q.device)  # running unnormalized output
    kv = torch.stack([k, v])
    for t in range(n):
        src = (rank - t) % n
        pending = None
        if t < n - 1:
            next_kv, pending = ring.shift(kv, _TAG_KV)  # overlaps the compute below
        if _visible(src, rank, causal):
            k32, v32 = kv[0].to(acc_t), kv[1].to(acc_t)
            s = _scores(q32, k32, scale, causal and src == rank)
            m_new = torch.maximum(m, s.amax(dim=-1))
            rescale = torch.exp(m - m_new)  # 0 on the first visible block (m = -inf)
            p = torch.exp(s - m_new.unsqueeze(-1))
            l = l * rescale + p.sum(dim=-1)
            acc = acc * rescale.unsqueeze(-1) + torch.matmul(p, v32)
            m = m_new
        if pending is not None:
            _wait(pending)
            kv = next_kv
    out = acc / l.unsqueeze(-1)
    lse = m + torch.log(l)
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, ring: _Ring | None, rank: int, n: int, causal: bool, scale: float):
    acc_t = lse.dtype
    q32, do32 = q.to(acc_t), dout.to(acc_t)
    delta = (do32 * out.to(acc_t)).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=acc_t, device=q.device)
    kv = torch.stack([k, v])
    dkv_in, dkv_pending = None, None  # the accumulator that travels with the current block
    for t in range(n):
        src = (rank - t) % n
        kv_pending = None
        if t < n - 1:
            next_kv, kv_pending = ring.shift(kv, _TAG_KV)
        dkv = torch.zeros(kv.shape, dtype=acc_t, device=q.device)  # this rank's share for block src
        if _visible(src, rank, causal):
            k32, v32 = kv[0].to(acc_t), kv[1].to(acc_t)
            p = torch.exp(_scores(q32, k32, scale, causal and src == rank) - lse.unsqueeze(-1))
            dkv[1] = torch.matmul(p.transpose(-2, -1), do32)
            ds = p * (torch.matmul(do32, v32.transpose(-2, -1)) - delta)
            dq += torch.matmul(ds, k32) * scale
            dkv[0] = torch.matmul(ds.transpose(-2, -1), q32) * scale
        if dkv_pending is not None:
            _wait(dkv_pending)
            dkv += dkv_in
        if n > 1:  # pass the accumulator on; after the last step it goes home to rank + 1
            dkv_in, dkv_pending = ring.shift(dkv, _TAG_DKV)
        if kv_pending is not None:
            _wait(kv_pending)
            kv = next_kv
    if dkv_pending is not None:
        _wait(dkv_pending)
        dkv = dkv_in  # our own block's gradient, back from its last visit on rank - 1
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g: AxisGroup, causal: bool, scale: float):
        ring = _Ring(g) if g.size > 1 else None
        out, lse = _forward(q, k, v, ring, g.rank, g.size, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.rank, ctx.n, ctx.causal, ctx.scale = ring, g.rank, g.size, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.ring, ctx.rank, ctx.n, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: AxisGroup, causal: bool = False,
                   scale: float | None = None) -> torch.Tensor:
    """This rank's block of ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``
    over the sequence split on axis group ``g``.

    ``q``, ``k``, ``v``: ``[batch, heads, seq_local, head_dim]``, rank ``i`` holding the ``i``-th
    contiguous sequence block; every rank's blocks have the same shape. ``scale`` defaults to
    ``1 / sqrt(head_dim)``. Differentiable once in q, k and v.
    """
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"ring_attention wants q, k, v of one shape [batch, heads, seq_local, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (grouped K/V heads: repeat them first)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(q, k, v, g, causal, scale)
