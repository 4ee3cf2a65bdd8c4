"""Multi-process pipeline cases, run by tests/test_pipeline.py in one launch per world size (gloo).

Each rank runs every case: pipeline a freshly seeded 4-layer tiny GPT over ``pp`` stages (each
planned and lowered on its sub-mesh), train a few AdamW steps with a torch.distributed.pipelining
schedule, and record per rank: the losses, the gathered gradients of the first step, the gathered
parameters after the last, the bytes each rank's collectives sent per step against the stage
plan's prediction, and the peak bytes of activations held for backward. Rank 0 returns them all.

Cases with ``tied`` run a tiny Hugging Face GPT-2 (embedding tied to the head, 4 layers) through
``parallelize(mesh="pp=...", ...)``, and also count every byte that reaches torch.distributed
with the independent spy (tests/byte_spy.py): sends between stages, the stages' collectives,
the tied-gradient all-reduce and the loss broadcast, against the plan's own prediction
(``PipelineInfo.predicted_bytes``, from the cost model and the stage plans).
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


TIED_BATCH = 8


def build_tied():
    from autopar.models.hf import hf_gpt2

    torch.manual_seed(0)
    return hf_gpt2(n_layer=LAYERS, n_embd=32, n_head=2, vocab_size=64, n_positions=SEQ, batch_size=TIED_BATCH,
                   seq_len=SEQ)


def run_case(pp: int, stage_mesh: str | None, schedule: str, m: int, options: dict) -> dict:
    from autopar.cost_model.pipeline import activations_in_flight
    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize_pipeline
    from autopar.runtime.pipeline import saved_activation_bytes

    from byte_spy import ByteSpy

    options = dict(options)
    v = int(options.pop("virtual_stages", 1))
    tied = options.pop("tied", None)
    model, inputs = build_tied() if tied else build()
    if tied:  # the user's entry point with the pipeline pinned on the mesh
        from autopar.runtime.parallel_module import parallelize

        mesh = f"pp={pp}" + (f",{stage_mesh}" if stage_mesh else "")
        pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False, mesh=mesh,
                         n_microbatches=m, schedule=schedule, **options)
    elif options.pop("api", None):  # the user's entry point: parallelize() plans the pipeline itself
        from autopar.runtime.parallel_module import parallelize

        pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False, **options)
        v = len(pm.stage_ids)  # model chunks on this rank
        pp, m, schedule = len(pm._pp_ranks), pm.n_microbatches, pm.schedule_name
    else:
        pm = parallelize_pipeline(model, inputs, pp=pp, n_microbatches=m, schedule=schedule, stage_mesh=stage_mesh,
                                  virtual_stages=v, hardware="a100-80gb", mixed_precision=False, **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses, sent, spied, grads, peak = [], [], [], None, 0
    weights = list(pm.parameters())
    for step in range(STEPS):
        with count_bytes() as counted, saved_activation_bytes(weights) as mem, ByteSpy() as spy:
            loss = pm.step(*inputs)
        spied.append(spy.sent)
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
    position = dist.get_rank() // (dist.get_world_size() // pp)
    for t in pm.info.tied:  # ... and the all-reduce of a weight tied across stages once per step
        if position in t.positions:
            predicted["all_reduce"] = predicted.get("all_reduce", 0.0) + t.bytes_per_rank
    in_flight = [activations_in_flight(schedule, pp, m, s % pp, v) for s in pm.stage_ids]
    predicted_activations = sum(n * pm.plans[s].activation_bytes for n, s in zip(in_flight, pm.stage_ids))
    held = {name: tuple(p.shape) for s in pm.stages for name, p in s.program.named_parameters()}
    mine = dict(rank=dist.get_rank(), stages=pm.stage_ids, sent=sent, predicted=predicted, spied=spied,
                spy_predicted=pm.info.predicted_bytes(position), tied=[t.to_dict() for t in pm.info.tied], held=held,
                deferred=pm.deferred_sync_bytes(), peak_activation_bytes=peak,
                predicted_activation_bytes=predicted_activations, losses=losses)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), ranks=per_rank, pp=pp, schedule=schedule,
                n_microbatches=m,
                meshes=[str(p.mesh) for p in pm.plans], stage_blocks=pm.stage_blocks)


def reference(tied: bool = False):
    """The single-process run: losses, first-step gradients, parameters after STEPS AdamW steps."""
    from dist_cases import train_single

    return train_single(*(build_tied() if tied else build()), steps=STEPS, lr=LR, eps=EPS, every_name=True)


def case_key(case) -> str:
    pp, stage_mesh, schedule, m, options = case
    extra = "".join(f"/{k}={v}" for k, v in options.items())
    return f"pp={pp}/{stage_mesh}/{schedule}/m={m}{extra}"


def case(rank: int, world: int, spec: tuple) -> dict:
    """One (pp, stage mesh, schedule, micro-batches, options) case on this rank (run by tests/launcher.py)."""
    return run_case(*spec)
