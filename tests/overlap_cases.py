"""Ranks of tests/test_overlap.py (one gloo launch): bucketed overlapped gradient sync and
ZeRO-3 free-and-regather, checked against a single-process run on every rank.

Run: ``python tests/overlap_cases.py WORLD PORT OUT.pt``; rank 0 saves a dict of results.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def wide_mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Weights much larger than activations: where keeping gathered weights shows."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.GELU())], nn.Linear(256, 1))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(x).square().mean()

    return Loss(), (torch.randn(8, 256),)


def accumulate(name: str) -> dict:
    """DP with the gradient sync out of the program: two backward passes, no zero_grad between
    (the second adds to synchronized gradients), then an optimizer step."""
    from dist_cases import build

    from autopar.passes.lower import DEFERRED_KEY
    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize
    from autopar.runtime.grad_buckets import GradBuckets

    model, inputs = build(name)
    pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False, strategy="dp",
                     baselines=False)
    deferred = dict(pm.program.meta[DEFERRED_KEY])
    # Small buckets, so that some launch while backward still runs.
    pm.grad_buckets.remove()
    buckets = GradBuckets([(pm.program.get_parameter(t), axes) for t, axes in deferred.items()],
                          bucket_bytes=64 * 1024, first_bucket_bytes=16 * 1024)
    half = [x.flip(0) for x in inputs]  # a second batch: the same samples in another order per rank
    sent = []
    for batch in (inputs, half):
        with count_bytes() as s:
            pm(*batch).backward()
        sent.append(dict(s))
    grads = pm.full_grads()
    return dict(deferred=len(deferred), code_syncs=pm.program.code.count("grad_sync("), grads=grads,
                n_buckets=len(buckets.buckets), early=buckets.launched_during_backward, sent=sent,
                predicted=dict(pm.plan.comm_bytes), n_params=len(list(pm.parameters())))


def zero3_memory() -> dict:
    """ZeRO-3 peak live bytes with the gathered weights freed after use (the module's forward)
    and kept for backward (the bare lowered program), same numerics."""
    from bench.memtrack import LiveBytes

    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize

    model, inputs = wide_mlp()
    pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False,
                     strategy="zero3", baselines=False)
    out = {}
    for how, run in (("regather", pm), ("keep", pm.program)):
        pm.zero_grad(set_to_none=True)
        with LiveBytes() as mem, count_bytes() as sent:
            mem.track(pm.parameters())
            loss = run(*inputs)
            loss.backward()
        out[how] = dict(peak=mem.peak_bytes, loss=loss.item(), sent=dict(sent),
                        grads={k: v.clone() for k, v in pm.full_grads().items()})
    out["predicted"] = dict(pm.plan.comm_bytes)
    out["param_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    return out


def main(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for key, fn in (("accumulate/gpt-tiny", lambda: accumulate("gpt-tiny")),
                        ("accumulate/mlp", lambda: accumulate("mlp")), ("zero3-memory", zero3_memory)):
            try:
                results[key] = fn()
            except Exception as exc:  # reported per case by the test
                import traceback

                results[key] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            dist.barrier()
    finally:
        if rank == 0:
            torch.save(results, out_path)
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(main, args=(world, port, out_path), nprocs=world)
