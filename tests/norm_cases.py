"""Cases of tests/test_sharded_norm.py (one case of tests/launcher.py): layer norm with the hidden
dim split over one axis (runtime.sharded_norm) on 4 gloo ranks, over the world and both axes of a 2x2 mesh; each rank
returns its output and gradient pieces next to the single-process reference's."""

from __future__ import annotations

import torch
import torch.distributed as dist

CASES = [("world", (3, 5, 16), True), ("inner", (4, 8), True), ("outer", (2, 3, 8), False), ("inner", (6, 12), False)]


def all_cases(rank: int, world: int) -> list:
    """Every case on this rank (run by tests/launcher.py): [each rank's records]."""
    from autopar.runtime.collectives import count_bytes
    from autopar.runtime.sharded_norm import sharded_layer_norm

    from axis_groups import world_and_2x2_groups

    groups = world_and_2x2_groups(rank, world)
    results = []
    for i, (axis, shape, affine) in enumerate(CASES):
        g = groups[axis]
        gen = torch.Generator().manual_seed(100 + i)  # the same full tensors on every rank
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1
        w = torch.randn(shape[-1], generator=gen, dtype=torch.float64) if affine else None
        b = torch.randn(shape[-1], generator=gen, dtype=torch.float64) if affine else None
        dy = torch.randn(shape, generator=gen, dtype=torch.float64)
        ref_in = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
        ref = torch.nn.functional.layer_norm(ref_in[0], (shape[-1],), *(ref_in[1:] if affine else (None, None)), 1e-5)
        ref.backward(dy)
        piece = lambda t: t.chunk(g.size, dim=-1)[g.rank].clone()
        mine = [piece(t).requires_grad_() for t in (x, w, b) if t is not None]
        with count_bytes() as sent:
            out = sharded_layer_norm(mine[0], [shape[-1]], *(mine[1:] if affine else (None, None)), 1e-5, g)
            out.backward(piece(dy))
        results.append(dict(
            out_err=(out - piece(ref.detach())).abs().max().item(),
            grad_err=max((m.grad - piece(r.grad)).abs().max().item() for m, r in zip(mine, ref_in)),
            sent=dict(sent), rows=x.numel() // shape[-1], n=g.size))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered
