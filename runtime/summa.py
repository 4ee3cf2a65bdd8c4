"""SUMMA: a matmul over a 2-axis process grid that moves one K panel at a time.

van de Geijn & Watts, "SUMMA: Scalable Universal Matrix Multiplication Algorithm",
Concurrency: Practice and Experience 9(4), 1997.

Layout. The grid has ``q_r x q_c`` ranks. ``row`` is the mesh axis whose coordinate ``r``
numbers block rows (``q_r`` of them); its process group is the ``q_r`` ranks that share ``c``
(one grid column). ``col`` is the axis with coordinate ``c`` (``q_c`` block columns); its
group is the ``q_c`` ranks that share ``r`` (one grid row). For ``C[M, N] = A[M, K] @ B[K, N]``
rank ``(r, c)`` holds::

    A_rc = A[block r of M (q_r blocks), block c of K (q_c blocks)]
    B_rc = B[block r of K (q_r blocks), block c of N (q_c blocks)]

and computes ``C_rc = C[block r of M, block c of N]``. ``a`` may carry leading dims: they are
all rows of M (the caller cut one of them ``q_r`` ways), and ``C_rc`` keeps them.

Panels and owners. K is cut ``q_c`` ways for A and ``q_r`` ways for B, so the loop runs over
panels of ``p`` columns of K, where ``p`` divides ``K / lcm(q_r, q_c)``: then no panel
straddles a block of either cut. Panel ``t`` covers ``K[t p : (t + 1) p]``; with
``Ka = K / q_c`` and ``Kb = K / q_r`` (the local K extents of A and B), its A part lives on
grid column ``t p // Ka`` (at local column ``t p mod Ka``) of every grid row, and its B part on
grid row ``t p // Kb`` (at local row ``t p mod Kb``) of every grid column. Any ``q_r, q_c``
work; the local shapes must agree on K (``Ka q_c == Kb q_r``).

Forward, for each panel: the A-owner of each grid row broadcasts ``A[block r, panel]`` over the
``col`` group, the B-owner of each grid column broadcasts ``B[panel, block c]`` over the
``row`` group, and every rank adds ``A_panel @ B_panel`` to ``C_rc``.

Backward saves only ``A_rc`` and ``B_rc``. With upstream ``dC_rc``, for each panel:

* ``dA[block r, panel] = sum_c dC_rc @ B[panel, block c]^T``: broadcast the B panel over the
  ``row`` group again, form this rank's term, and sum-reduce it over the ``col`` group onto the
  panel's A-owner ``(r, t p // Ka)``;
* ``dB[panel, block c] = sum_r A[block r, panel]^T @ dC_rc``: broadcast the A panel over the
  ``col`` group again, form the term, and sum-reduce it over the ``row`` group onto the B-owner
  ``(t p // Kb, c)``.

Every rank owns ``Ka / p`` A panels and ``Kb / p`` B panels, so each local gradient is written
whole. An axis of size 1 moves nothing: its panels are local views.

Memory against communication. The plain 2-D approach all-gathers the whole row panel
``A[block r, :]`` (``M/q_r x K``) and column panel ``B[:, block c]`` (``K x N/q_c``), and for
backward keeps them or gathers them again before reduce-scattering the gradients. SUMMA holds
one ``M/q_r x p`` and one ``p x N/q_c`` buffer instead (:func:`summa_peak_extra_bytes`), a
factor ``K / p`` less. Over a group of ``n`` ranks it moves the same total: a pipelined ring
broadcast or reduce of ``S`` has ``n - 1`` senders of ``S``, an all-gather or reduce-scatter
``n`` senders of ``S (n - 1)/n``, and the panels add up to the gathered sizes. The price is
latency, ``K / p`` collectives of ``(n - 1)`` hops each per step instead of one, and the
backward's second round of broadcasts, against a plain approach that keeps its gathered
panels. The ring model of ``cost_model.comm`` books a broadcast as ``S`` for every rank (the
busiest one), so :func:`summa_bytes` is ``n/(n-1)`` times the plain approach's (with its
re-gather) per axis: twice at ``n = 2``.

Every broadcast is added to ``collectives.COUNTER`` as ``broadcast`` (``S`` per rank, as
``cost_model.comm.bytes_sent_per_rank`` prices it); every reduce as ``reduce`` with the same
``S`` (a pipelined ring reduce mirrors the broadcast), which has no entry in that table, so it
is added directly. :func:`summa_bytes` gives the same figures in closed form, for a backward
that needs both gradients. Collectives are blocking and run in the same order on every rank:
all ranks of the grid must call the op with matching shapes and ``requires_grad`` flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.cost_model.comm import broadcast_s
from autopar.mesh import Link

from .collectives import COUNTER, AxisGroup

__all__ = ["summa_matmul", "summa_bytes", "summa_seconds", "summa_peak_extra_bytes"]


def _panel_size(K: int, q_r: int, q_c: int, panel_size: int | None) -> int:
    """The K width of one panel: ``K / lcm(q_r, q_c)`` unless a divisor of it is asked for."""
    finest = K // math.lcm(q_r, q_c)
    if panel_size is None:
        return finest
    if not isinstance(panel_size, int) or panel_size < 1 or finest % panel_size:
        raise ValueError(f"panel_size={panel_size!r} must be a positive divisor of K / lcm(q_r, q_c) = "
                         f"{K} / {math.lcm(q_r, q_c)} = {finest}, so that no panel straddles a block of A or B")
    return panel_size


# --- collectives over one axis ------------------------------------------------------------------


def _global_rank(g: AxisGroup, index: int) -> int:
    # dist.broadcast/reduce take the *global* rank as src/dst (group_src/group_dst are newer).
    return dist.get_global_rank(g.group if g.group is not None else dist.group.WORLD, index)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fetch(local: torch.Tensor, owner: int, g: AxisGroup, buf: torch.Tensor) -> torch.Tensor:
    """The panel ``local`` of rank ``owner`` on every rank of ``g``, in ``buf`` (reused)."""
    if g.size == 1:
        return local
    if g.rank == owner:
        buf.copy_(local)
    dist.broadcast(buf, src=_global_rank(g, owner), group=g.group)
    COUNTER.add("broadcast", _nbytes(buf), g.size)
    return buf


def _reduce_onto(part: torch.Tensor, owner: int, g: AxisGroup) -> None:
    """Sum ``part`` over ``g`` into ``part`` on rank ``owner`` (other ranks' copies are scratch)."""
    if g.size == 1:
        return
    dist.reduce(part, dst=_global_rank(g, owner), op=dist.ReduceOp.SUM, group=g.group)
    COUNTER.add("reduce", _nbytes(part), g.size)  # S per rank, like the broadcast


# --- the op ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Panels:
    """Where panel ``t`` of K lives: the A-owner column and offset, the B-owner row and offset.
    ``ka``/``kb``: the local K extents of A and B blocks; ``p``: the panel width."""

    ka: int
    kb: int
    p: int

    def owners(self, t: int) -> tuple[int, slice, int, slice]:
        k0 = t * self.p
        a_owner, a_off = divmod(k0, self.ka)
        b_owner, b_off = divmod(k0, self.kb)
        return a_owner, slice(a_off, a_off + self.p), b_owner, slice(b_off, b_off + self.p)


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, row, col, p, n_panels):
        a2 = a.reshape(-1, a.shape[-1])
        panels = _Panels(a.shape[-1], b.shape[0], p)
        a_buf = a2.new_empty(a2.shape[0], p) if col.size > 1 else None
        b_buf = b.new_empty(p, b.shape[1]) if row.size > 1 else None
        c = a2.new_zeros(a2.shape[0], b.shape[1])
        for t in range(n_panels):
            a_owner, a_cols, b_owner, b_rows = panels.owners(t)
            a_pan = _fetch(a2[:, a_cols], a_owner, col, a_buf)
            b_pan = _fetch(b[b_rows], b_owner, row, b_buf)
            c.addmm_(a_pan, b_pan)
        ctx.save_for_backward(a, b)
        ctx.row, ctx.col, ctx.p, ctx.n_panels = row, col, p, n_panels
        return c.view(*a.shape[:-1], b.shape[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        row, col, p = ctx.row, ctx.col, ctx.p
        need_a, need_b = ctx.needs_input_grad[:2]
        a2 = a.reshape(-1, a.shape[-1])
        g2 = grad.reshape(-1, b.shape[1]).contiguous()
        panels = _Panels(a.shape[-1], b.shape[0], p)
        da = torch.empty_like(a2) if need_a else None
        db = torch.empty_like(b) if need_b else None
        a_buf = a2.new_empty(a2.shape[0], p) if need_b and col.size > 1 else None
        b_buf = b.new_empty(p, b.shape[1]) if need_a and row.size > 1 else None
        da_part = a2.new_empty(a2.shape[0], p) if need_a else None
        db_part = b.new_empty(p, b.shape[1]) if need_b else None
        for t in range(ctx.n_panels):
            a_owner, a_cols, b_owner, b_rows = panels.owners(t)
            if need_a:  # dA[r, t] = sum over the grid row of dC_rc @ B[t, c]^T
                b_pan = _fetch(b[b_rows], b_owner, row, b_buf)
                torch.mm(g2, b_pan.t(), out=da_part)
                _reduce_onto(da_part, a_owner, col)
                if col.rank == a_owner:
                    da[:, a_cols] = da_part
            if need_b:  # dB[t, c] = sum over the grid column of A[r, t]^T @ dC_rc
                a_pan = _fetch(a2[:, a_cols], a_owner, col, a_buf)
                torch.mm(a_pan.t(), g2, out=db_part)
                _reduce_onto(db_part, b_owner, row)
                if row.rank == b_owner:
                    db[b_rows] = db_part
        return (da.view(a.shape) if need_a else None), db, None, None, None, None


def summa_matmul(a: torch.Tensor, b: torch.Tensor, row: AxisGroup, col: AxisGroup,
                 panel_size: int | None = None) -> torch.Tensor:
    """This rank's block of ``A @ B`` by SUMMA (see the module doc for the layout).

    ``a``: ``A_rc``, shape ``(..., K / q_c)`` (leading dims are rows of M); ``b``: ``B_rc``,
    shape ``(K / q_r, N / q_c)``; ``row``/``col``: the axes with coordinates ``r`` and ``c``
    (AxisGroups). Returns ``C_rc`` of shape ``(..., N / q_c)``. ``panel_size``
    (default ``K / lcm(q_r, q_c)``) is the K width moved per collective: smaller holds less
    and sends more messages.
    """
    if a.dim() < 2 or b.dim() != 2:
        raise ValueError(f"summa_matmul needs a of shape (..., K/q_c) with at least 2 dims and b of shape "
                         f"(K/q_r, N/q_c); got a {tuple(a.shape)}, b {tuple(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must share dtype and device; got {a.dtype}/{a.device} and {b.dtype}/{b.device}")
    ka, kb = a.shape[-1], b.shape[0]
    if ka * col.size != kb * row.size:
        raise ValueError(f"the blocks disagree on K: a's last dim {ka} x q_c={col.size} = {ka * col.size}, but b's "
                         f"first dim {kb} x q_r={row.size} = {kb * row.size}; give A blocks of K/q_c columns and B "
                         f"blocks of K/q_r rows of the same K")
    K = ka * col.size
    p = _panel_size(K, row.size, col.size, panel_size)
    return _Summa.apply(a, b, row, col, p, K // p)


# --- the cost model's view ------------------------------------------------------------------------


def _panel_bytes(M: int, K: int, N: int, q_r: int, q_c: int, elem_size: int, p: int) -> tuple[float, float]:
    """Bytes of one A panel (``M/q_r x p``) and one B panel (``p x N/q_c``)."""
    return M / q_r * p * elem_size, p * N / q_c * elem_size


def summa_bytes(M: int, K: int, N: int, q_r: int, q_c: int, elem_size: int,
                backward: bool = True) -> dict[str, float]:
    """Bytes one rank sends in :func:`summa_matmul`, by collective (``broadcast``, ``reduce``).

    Forward: the A panels add up to ``M/q_r x K`` broadcast over the ``col`` axis and the B
    panels to ``K x N/q_c`` over the ``row`` axis, each booked as ``S`` per rank. Backward (both
    gradients): the same broadcasts again, and reduces of the same sizes (dA's over ``col``,
    dB's over ``row``). An axis of size 1 moves nothing. Independent of the panel width.
    Zero entries are left out, as ``collectives.count_bytes`` leaves them out.
    """
    a_total = M / q_r * K * elem_size if q_c > 1 else 0.0
    b_total = K * N / q_c * elem_size if q_r > 1 else 0.0
    rounds = 2 if backward else 1
    sent = {"broadcast": rounds * (a_total + b_total), "reduce": (a_total + b_total) if backward else 0.0}
    return {k: v for k, v in sent.items() if v}


def _reduce_s(nbytes: float, n: int, link: Link) -> float:
    """Pipelined ring reduce: the broadcast's stream run backwards, ``S/B + (n-1) a``."""
    return broadcast_s(nbytes, n, link)


def summa_seconds(M: int, K: int, N: int, q_r: int, q_c: int, elem_size: int, row_link: Link, col_link: Link,
                  panel_size: int | None = None, backward: bool = True) -> float:
    """Communication seconds of :func:`summa_matmul`, forward plus (by default) backward.

    ``row_link`` is the link of the ``row`` axis (B panels move over it), ``col_link`` that of
    the ``col`` axis (A panels). Per panel the forward broadcasts one A and one B panel; the
    backward broadcasts both again and reduces one dA and one dB panel. Collectives run one
    after another (no overlap with each other or with compute is assumed). There are
    ``K / panel_size`` panels, ``lcm(q_r, q_c)`` by default.
    """
    p = _panel_size(K, q_r, q_c, panel_size) if panel_size is not None else K / math.lcm(q_r, q_c)
    n_panels = K / p
    a_panel, b_panel = _panel_bytes(M, K, N, q_r, q_c, elem_size, p)
    bcast = broadcast_s(a_panel, q_c, col_link) + broadcast_s(b_panel, q_r, row_link)
    seconds = bcast
    if backward:
        seconds += bcast + _reduce_s(a_panel, q_c, col_link) + _reduce_s(b_panel, q_r, row_link)
    return n_panels * seconds


def summa_peak_extra_bytes(M: int, K: int, N: int, q_r: int, q_c: int, elem_size: int,
                           panel_size: int | None = None) -> dict[str, float]:
    """Extra bytes a rank holds to multiply, beyond its blocks of A, B and C.

    ``summa``: one A panel (``M/q_r x p``) and one B panel (``p x N/q_c``) buffer.
    ``all_gather``: the plain approach's gathered row panel of A (``M/q_r x K``) and column
    panel of B (``K x N/q_c``). An axis of size 1 needs neither. The backward of SUMMA holds
    the same two panels plus one gradient term of each size; the plain approach keeps (or
    re-gathers) its panels and forms whole ``M/q_r x K`` and ``K x N/q_c`` gradient terms.
    """
    p = _panel_size(K, q_r, q_c, panel_size) if panel_size is not None else K / math.lcm(q_r, q_c)
    a_panel, b_panel = _panel_bytes(M, K, N, q_r, q_c, elem_size, p)
    a_row, b_col = _panel_bytes(M, K, N, q_r, q_c, elem_size, K)
    return {"summa": (a_panel if q_c > 1 else 0.0) + (b_panel if q_r > 1 else 0.0),
            "all_gather": (a_row if q_c > 1 else 0.0) + (b_col if q_r > 1 else 0.0)}
