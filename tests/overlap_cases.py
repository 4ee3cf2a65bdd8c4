"""Cases of tests/test_overlap.py (run by tests/launcher.py): bucketed overlapped gradient sync and
ZeRO-3 free-and-regather, checked against a single-process run on every rank.
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


def _grad_layout(buckets) -> dict:
    """After a backward from empty gradients: how many .grad tensors are their bucket's slot
    (no copy out), and how many one-parameter buckets sent the .grad itself (no flat buffer)."""
    slots = alone = 0
    for b in buckets.buckets:
        if len(b.params) == 1 and b.flat is None:
            alone += b.params[0].grad is not None
            continue
        lo, hi = b.flat.data_ptr(), b.flat.data_ptr() + b.flat.numel() * b.flat.element_size()
        slots += sum(p.grad is not None and lo <= p.grad.data_ptr() < hi for p in b.params)
    return dict(slots=slots, alone=alone, single=sum(len(b.params) == 1 for b in buckets.buckets),
                params=sum(len(b.params) for b in buckets.buckets))


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
        if batch is inputs:
            layout = _grad_layout(buckets)
    grads = pm.full_grads()
    return dict(deferred=len(deferred), code_syncs=pm.program.code.count("grad_sync("), grads=grads, layout=layout,
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


def case(rank: int, world: int, what: str, name: str | None = None) -> dict:
    """``accumulate`` on model ``name``, or ``zero3-memory``, on this rank (run by tests/launcher.py)."""
    return accumulate(name) if what == "accumulate" else zero3_memory()
