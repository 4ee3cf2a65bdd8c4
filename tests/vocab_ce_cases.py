"""Cases of tests/test_vocab_parallel_ce.py (one case of tests/launcher.py): cross-entropy over
logits split on the class dim (runtime.vocab_parallel_ce) on 4 gloo ranks, over the world and
both axes of a 2x2 mesh; each rank returns the error of its loss and logits' gradient piece
against torch's cross-entropy on the whole logits, and the bytes it sent."""

from __future__ import annotations

import torch
import torch.distributed as dist

# (axis, rows, classes, reduction (aten's 0/1/2), ignore_index, dtype)
CASES = [("world", 12, 16, 1, -100, torch.float64), ("inner", 7, 10, 2, -100, torch.float64),
         ("outer", 9, 6, 0, -100, torch.float64), ("world", 10, 8, 1, 3, torch.float64),
         ("inner", 16, 12, 1, -100, torch.bfloat16)]


def all_cases(rank: int, world: int) -> list:
    """Every case on this rank (run by tests/launcher.py): [each rank's records]."""
    from autopar.runtime.collectives import count_bytes
    from autopar.runtime.vocab_parallel_ce import vocab_parallel_cross_entropy

    from axis_groups import world_and_2x2_groups

    groups = world_and_2x2_groups(rank, world)
    results = []
    for i, (axis, rows, classes, reduction, ignore, dtype) in enumerate(CASES):
        g = groups[axis]
        gen = torch.Generator().manual_seed(200 + i)  # the same whole tensors on every rank
        x = (torch.randn(rows, classes, generator=gen, dtype=torch.float64) * 3).to(dtype)
        target = torch.randint(0, classes, (rows,), generator=gen)
        target[1] = ignore  # a row the loss skips (a class index too when ignore_index is one)
        shape = (rows,) if reduction == 0 else ()
        dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        whole = x.double().clone().requires_grad_()  # the reference, in fp64 whatever the dtype
        ref = torch.nn.functional.cross_entropy(whole, target, reduction=["none", "mean", "sum"][reduction],
                                                ignore_index=ignore)
        ref.backward(dy.double())
        mine = x.chunk(g.size, dim=1)[g.rank].clone().requires_grad_()
        with count_bytes() as sent:
            out = vocab_parallel_cross_entropy(mine, target, reduction, ignore, g)
            out.backward(dy)
        results.append(dict(
            out_err=(out.double() - ref.detach()).abs().max().item(),
            grad_err=(mine.grad.double() - whole.grad.chunk(g.size, dim=1)[g.rank]).abs().max().item(),
            out_dtype=str(out.dtype), grad_dtype=str(mine.grad.dtype), sent=dict(sent), rows=rows, n=g.size))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    return gathered
