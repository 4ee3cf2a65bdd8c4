"""Cases of tests/test_summa.py (one case of tests/launcher.py): SUMMA matmul on several process grids.

Each case builds the global A, B and an upstream gradient dC from a fixed seed (the same on
every rank and in the test), gives each rank of a ``q_r x q_c`` grid its blocks, runs
``summa_matmul`` forward and backward, and records the output block, the gradient blocks and
the bytes sent. Rank 0 returns every rank's record; the test assembles the blocks and compares
them with a single-process ``A @ B``.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Case:
    name: str
    grid: tuple[int, int]  # (q_r, q_c)
    a_shape: tuple[int, ...]  # global A: (..., K); dim 0 is cut q_r ways
    n: int
    dtype: torch.dtype = torch.float32
    panel_size: int | None = None


CASES = [
    Case("2x2 square", (2, 2), (8, 8), 8),
    Case("2x2 non-square", (2, 2), (6, 12), 10),
    Case("2x2 3-D a", (2, 2), (4, 3, 8), 6),
    Case("2x2 fp64 narrow panels", (2, 2), (6, 16), 4, torch.float64, panel_size=2),
    Case("1x4", (1, 4), (5, 8), 12),
    Case("4x1", (4, 1), (8, 12), 3),
    Case("2x3", (2, 3), (4, 12), 9),  # neither axis divides the other: panels of K / 6
    Case("3x2 fp64", (3, 2), (6, 6), 4, torch.float64),
]
MEMORY_CASE = Case("memory", (2, 2), (64, 256), 64)


def global_tensors(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A, B and dC of ``case``, the same wherever they are built."""
    gen = torch.Generator().manual_seed(CASES.index(case) if case in CASES else 99)
    k = case.a_shape[-1]
    a = torch.randn(case.a_shape, generator=gen, dtype=case.dtype)
    b = torch.randn(k, case.n, generator=gen, dtype=case.dtype)
    dc = torch.randn(*case.a_shape[:-1], case.n, generator=gen, dtype=case.dtype)
    return a, b, dc


def block(t: torch.Tensor, r: int, c: int, q_r: int, q_c: int) -> torch.Tensor:
    """Block (r, c) of ``t``: dim 0 cut ``q_r`` ways, the last dim ``q_c`` ways."""
    return t.chunk(q_r, dim=0)[r].chunk(q_c, dim=-1)[c].contiguous()


def grid_axes(q_r: int, q_c: int):
    """The ``row`` (coordinate r) and ``col`` (coordinate c) axes of a grid over the first
    ``q_r q_c`` ranks, rank ``r q_c + c`` at (r, c); ``None`` on ranks outside it. Every rank
    creates every group (``new_group`` is collective over the world)."""
    from autopar.runtime.collectives import AxisGroup

    me = dist.get_rank()
    row = col = None
    for c in range(q_c):  # one row-axis group per grid column
        ranks = [r * q_c + c for r in range(q_r)]
        group = dist.new_group(ranks)
        if me in ranks:
            row = AxisGroup("row", group, q_r, ranks.index(me))
    for r in range(q_r):  # one col-axis group per grid row
        ranks = [r * q_c + c for c in range(q_c)]
        group = dist.new_group(ranks)
        if me in ranks:
            col = AxisGroup("col", group, q_c, ranks.index(me))
    return row, col


def run_case(case: Case, row, col) -> dict:
    from autopar.runtime import count_bytes
    from autopar.runtime.summa import summa_matmul

    q_r, q_c = case.grid
    a, b, dc = global_tensors(case)
    a_blk = block(a, row.rank, col.rank, q_r, q_c).requires_grad_()
    b_blk = block(b, row.rank, col.rank, q_r, q_c).requires_grad_()
    with count_bytes() as sent:
        c_blk = summa_matmul(a_blk, b_blk, row, col, case.panel_size)
        c_blk.backward(block(dc, row.rank, col.rank, q_r, q_c))
    return dict(coord=(row.rank, col.rank), c=c_blk.detach(), da=a_blk.grad, db=b_blk.grad, sent=dict(sent))


def measure_memory(case: Case, row, col) -> dict:
    """Peak live bytes of a forward by SUMMA and by the plain all-gather approach, less the
    blocks of A, B and C: the buffers each needs to multiply."""
    from bench.memtrack import LiveBytes

    from autopar.runtime.collectives import all_gather
    from autopar.runtime.summa import summa_matmul

    q_r, q_c = case.grid
    a, b, _ = global_tensors(case)
    a_blk, b_blk = (block(t, row.rank, col.rank, q_r, q_c) for t in (a, b))
    out = {}
    for how in ("summa", "all_gather"):
        with torch.no_grad(), LiveBytes() as mem:
            mem.track([a_blk, b_blk])
            if how == "summa":
                c_blk = summa_matmul(a_blk, b_blk, row, col)
            else:
                c_blk = all_gather(a_blk, -1, col) @ all_gather(b_blk, 0, row)
        blocks = sum(t.numel() * t.element_size() for t in (a_blk, b_blk, c_blk))
        out[how] = mem.peak_bytes - blocks
    return out


def all_cases(rank: int, world: int) -> dict:
    """Every case on this rank (run by tests/launcher.py on 6 or more ranks; grids use the first
    ranks): {case name: [the record of each rank in its grid]}."""
    results: dict = {}
    axes = {grid: grid_axes(*grid) for grid in sorted({c.grid for c in CASES + [MEMORY_CASE]})}
    jobs = [(c.name, c, run_case) for c in CASES] + [("memory", MEMORY_CASE, measure_memory)]
    for key, case, fn in jobs:
        row, col = axes[case.grid]
        record = None
        if row is not None:
            try:
                record = fn(case, row, col)
            except Exception as exc:  # reported per case by the test
                record = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        gathered = [None] * world
        dist.all_gather_object(gathered, record)
        results[key] = [r for r in gathered if r is not None]
    return results
