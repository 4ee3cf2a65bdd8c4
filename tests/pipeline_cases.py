"""Multi-process pipeline cases, run by tests/test_pipeline.py in one launch per world size (gloo).

Each rank runs every case: pipeline a freshly seeded 4-layer tiny GPT over ``pp`` stages (each
planned and lowered on its sub-mesh), train a few AdamW steps with a torch.distributed.pipelining
schedule, and record per rank: the losses, the gathered gradients of the first step, the gathered
parameters after the last, the bytes each rank's collectives sent per step against the stage
plan's prediction, and the peak bytes of activations held for backward. Rank 0 returns them all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

STEPS = 3
LR = 1e-3
EPS = 1e-6  # as tests/dist_cases.py: well above fp32 noise
BATCH, SEQ, LAYERS = 16, 16, 4


def build():
    from autopar.models import gpt

    torch.manual_seed(0)
    return gpt("gpt-tiny", batch_size=BATCH, seq_len=SEQ, n_layer=LAYERS)


def run_case(pp: int, stage_mesh: str | None, schedule: str, m: int, options: dict) -> dict:
    from autopar.cost_model.pipeline import activations_in_flight
    from autopar.runtime import count_bytes
    from autopar.runtime.pipeline import parallelize_pipeline, saved_activation_bytes

    options = dict(options)
    v = int(options.pop("virtual_stages", 1))
    model, inputs = build()
    if options.pop("api", None):  # the user's entry point: parallelize() plans the pipeline itself
        from autopar.runtime.parallel_module import parallelize

        pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False, **options)
        v = len(pm.stage_ids)  # model chunks on this rank
        pp, m, schedule = len(pm._pp_ranks), pm.n_microbatches, pm.schedule_name
    else:
        pm = parallelize_pipeline(model, inputs, pp=pp, n_microbatches=m, schedule=schedule, stage_mesh=stage_mesh,
                                  virtual_stages=v, hardware="a100-80gb", mixed_precision=False, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses, sent, grads, peak = [], [], None, 0
    weights = list(pm.parameters())
    for step in range(STEPS):
        with count_bytes() as counted, saved_activation_bytes(weights) as mem:
            loss = pm.step(*inputs)
        if step == 0:
            grads = pm.full_grads()
            peak = mem["peak"]
        losses.append(loss.item())
        sent.append(dict(counted))
        opt.step()
        opt.zero_grad()
    predicted: dict[str, float] = {}
    for s in pm.stage_ids:  # the stage program runs once per micro-batch
        for k, b in pm.plans[s].comm_bytes.items():
            predicted[k] = predicted.get(k, 0.0) + m * b
    for k, b in pm.deferred_sync_bytes().items():  # ... but its parameter syncs once per step
        predicted[k] -= (m - 1) * b
    in_flight = [activations_in_flight(schedule, pp, m, s % pp, v) for s in pm.stage_ids]
    predicted_activations = sum(n * pm.plans[s].activation_bytes for n, s in zip(in_flight, pm.stage_ids))
    mine = dict(rank=dist.get_rank(), stages=pm.stage_ids, sent=sent, predicted=predicted,
                deferred=pm.deferred_sync_bytes(), peak_activation_bytes=peak,
                predicted_activation_bytes=predicted_activations, losses=losses)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), ranks=per_rank, pp=pp, schedule=schedule,
                n_microbatches=m,
                meshes=[str(p.mesh) for p in pm.plans], stage_blocks=pm.stage_blocks)


def case_key(case) -> str:
    pp, stage_mesh, schedule, m, options = case
    extra = "".join(f"/{k}={v}" for k, v in options.items())
    return f"pp={pp}/{stage_mesh}/{schedule}/m={m}{extra}"


def case(rank: int, world: int, spec: tuple) -> dict:
    """One (pp, stage mesh, schedule, micro-batches, options) case on this rank (run by tests/launcher.py)."""
    return run_case(*spec)
