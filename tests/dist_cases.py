"""Multi-process runtime cases, run by tests/test_runtime.py in one launch (gloo on CPU).

Each rank runs every case: parallelize a freshly seeded model under a plan family, train 3
AdamW steps, and record losses, the gathered gradients of the first step, the gathered
parameters after the last step, and the bytes sent per collective per step. Rank 0 saves
them; the test compares them with a single-process run of the same model.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

STEPS = 3
LR = 1e-3
# eps well above fp32 noise: with the default 1e-8, a gradient that is ~0 up to rounding turns
# into a full-size update whose sign is the rounding noise, in the single-device run as well.
EPS = 1e-6


def build(name: str):
    from autopar.models import get_model

    torch.manual_seed(0)
    if name == "mlp":
        from autopar.models import MLPConfig, mlp

        return mlp(MLPConfig(in_features=32, hidden=64, out_features=8, depth=2), batch_size=16)
    return get_model(name, batch_size=8, seq_len=16)


def run_case(name: str, family: str, mesh: str | None):
    from autopar.runtime import count_bytes, parallelize

    model, inputs = build(name)
    pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False,
                     strategy=family, mesh=mesh, baselines=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses, sent_per_step, grads = [], [], None
    for step in range(STEPS):
        with count_bytes() as sent:
            loss = pm(*inputs)
            loss.backward()
        if step == 0:
            grads = pm.full_grads()
        losses.append(loss.item())
        sent_per_step.append(dict(sent))
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), sent=sent_per_step,
                predicted=dict(pm.plan.comm_bytes), mesh=str(pm.plan.mesh),
                strategies={n.name: n.strategy for n in pm.plan.nodes})


def main(rank: int, world: int, port: int, cases: list, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, family, mesh in cases:
            key = f"{name}/{family}/{mesh}"
            try:
                results[key] = run_case(name, family, mesh)
            except Exception as exc:  # reported per case by the test
                results[key] = {"error": f"{type(exc).__name__}: {exc}"}
            dist.barrier()
    finally:
        if rank == 0:
            torch.save(results, out_path)
        dist.destroy_process_group()


if __name__ == "__main__":
    import json

    import torch.multiprocessing as mp

    world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cases = json.loads(sys.argv[4])
    mp.spawn(main, args=(world, port, cases, out_path), nprocs=world)
