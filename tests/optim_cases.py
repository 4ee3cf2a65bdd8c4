"""Worker for tests/test_optim_dist.py: LAMB and LARS on a parallelized tiny GPT, 4 gloo ranks,
one launch for every plan family. Per family the model is parallelized once; from the same
initial weights each optimizer trains STEPS steps twice: as shipped (trust-ratio norms reduced
over each parameter's split axes) and with every Parameter's ShardInfo removed (each rank's
norm of its own piece: what a per-rank optimizer from any library computes). Rank 0 returns the
gathered parameters of each run, the bytes the optimizer step sent, and whether every local
piece has the shape the plan's layout gives."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from dist_cases import shard_mismatches

STEPS = 5
TIGHT = {"memory_budget_bytes": 2e6}  # the planner's own choice shards the tiny GPT under it
FAMILIES = [("dp", None, {}), ("zero2", None, {}), ("zero3", None, {}), ("megatron", None, {}),
            ("megatron-dp", "dp=2,tp=2", {}), ("2d", None, {}), ("auto", None, TIGHT)]


def make_optimizer(kind: str, params):
    from autopar.optim import LAMB, LARS

    if kind == "lamb":
        return LAMB(params, lr=5e-3, weight_decay=0.01, eps=1e-6, max_trust_ratio=10.0)
    return LARS(params, lr=1.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02)


def build():
    from autopar.models import get_model

    torch.manual_seed(0)
    return get_model("gpt-tiny", batch_size=8, seq_len=16)


def train(model_or_pm, inputs, kind: str) -> dict:
    """STEPS steps; the bytes each optimizer step sent, and each whole step (forward, backward, optimizer)."""
    from autopar.runtime import count_bytes

    opt = make_optimizer(kind, model_or_pm.parameters())
    sent, step_sent = [], []
    for _ in range(STEPS):
        with count_bytes() as whole:
            loss = model_or_pm(*inputs)
            loss.backward()
            with count_bytes() as s:
                opt.step()
        sent.append(dict(s))
        step_sent.append(dict(whole))
        opt.zero_grad()
    return dict(sent=sent, step_sent=step_sent, loss=loss.item())


def run_family(family: str, mesh: str | None, options: dict) -> dict:
    from autopar.runtime.parallel_module import parallelize
    from autopar.runtime.shard_info import SHARD_ATTR, tag_parameters

    model, inputs = build()
    t0 = time.perf_counter()
    pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False, strategy=family,
                     mesh=mesh, baselines=False, optimizer="lamb", **options)  # prices the norm all-reduces
    # full_state_dict returns unsplit tensors as views of the live parameters: clone to keep them
    start = {k: v.clone() for k, v in pm.full_state_dict().items()}
    out = dict(mesh=str(pm.plan.mesh), predicted=dict(pm.plan.comm_bytes), parallelize_seconds=time.perf_counter() - t0, mismatches=shard_mismatches(pm),
               cut=sorted(s.name for s in pm.shards() if s.is_param and s.split_axes))
    for kind in ("lamb", "lars"):
        for reduced in (True, False):
            pm.load_full_state_dict(start)
            if not reduced:  # per-piece norms: the optimizer no longer knows the cuts
                for p in pm.parameters():
                    if hasattr(p, SHARD_ATTR):
                        delattr(p, SHARD_ATTR)
            t0 = time.perf_counter()
            r = train(pm, inputs, kind)
            r["seconds"] = time.perf_counter() - t0
            tag_parameters(pm.shards())
            r["params"] = {k: v.clone() for k, v in pm.full_state_dict().items()}
            out[f"{kind}/{'reduced' if reduced else 'per-piece'}"] = r
    return out


def case(rank: int, world: int, family: str, mesh: str | None, options: dict) -> dict:
    """One family on this rank (run by tests/launcher.py); shape mismatches gathered from every rank."""
    r = run_family(family, mesh, options)
    gathered = [None] * world
    dist.all_gather_object(gathered, r.pop("mismatches"))
    r["mismatches"] = [m for ms in gathered for m in ms]
    return r
