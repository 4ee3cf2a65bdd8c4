"""Rank-side case: two models parallelized in one process keep separate run-time state.

``two_models(rank, world)`` parallelizes two different models on the same ranks, trains them
alternately (A's step, B's step, three times; AdamW) and returns, per model, what
``dist_cases.run_case`` returns for one (losses, first-step gradients, parameters after the
steps, bytes sent per step, shard mismatches), plus identity checks of their state: process
groups, AxisGroups, ZeRO-3 gather state, gradient buckets. Run by tests/test_model_state.py
in the session's 4-rank launch (tests/launcher.py).
"""

from __future__ import annotations

import torch

# (model, strategy family, mesh): one ZeRO-3 (its weights gathered through runtime/fsdp.py's
# state), one data parallel (its gradient all-reduces run from runtime/grad_buckets.py's
# buckets), both over all 4 ranks: one axis spanning the whole world, where torch's DeviceMesh
# would otherwise reuse the default process group for both.
MODELS = (("gpt-tiny", "zero3", None), ("bert-tiny", "dp", None))


def _state_of(pm) -> dict:
    """The run-time objects a ParallelModule owns (by identity)."""
    buckets = pm.grad_buckets
    return dict(
        axis_groups={id(g) for g in pm.axis_groups},
        process_groups={id(g.group) for g in pm.axis_groups},
        program_groups={id(getattr(pm.program, n)) for n in dir(pm.program) if n.startswith("autopar_axis_")},
        fsdp=id(pm.fsdp_state),
        program_fsdp=id(pm.program.autopar_fsdp),
        buckets=id(buckets),
        bucket_params={id(p) for b in buckets.buckets for p in b.params},
        scheduled_params={id(e[0]) for s in pm.fsdp_state.schedules.values() for e in s.last if e is not None},
        params={id(p) for p in pm.parameters()},
    )


def two_models(rank: int, world: int) -> dict:
    from dist_cases import EPS, LR, STEPS, all_ranks, build, shard_mismatches

    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize

    pms, opts, inputs = [], [], []
    for name, family, mesh in MODELS:
        model, x = build(name)
        pm = parallelize(model, example_inputs=x, hardware="a100-80gb", mixed_precision=False, strategy=family,
                         mesh=mesh, baselines=False)
        pms.append(pm)
        opts.append(torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS))
        inputs.append(x)
    runs = [dict(losses=[], sent=[], grads=None) for _ in MODELS]
    for step in range(STEPS):
        for pm, opt, x, r in zip(pms, opts, inputs, runs):  # alternate: A's step, then B's
            with count_bytes() as sent:
                loss = pm(*x)
                loss.backward()
            if step == 0:
                r["grads"] = pm.full_grads()
            r["losses"].append(loss.item())
            r["sent"].append(dict(sent))
            opt.step()
            opt.zero_grad()
    states = [_state_of(pm) for pm in pms]
    a, b = states
    shared = {k: len(a[k] & b[k]) if isinstance(a[k], set) else int(a[k] == b[k]) for k in a}
    out = {}
    for (name, family, mesh), pm, r, s in zip(MODELS, pms, runs, states):
        out[name] = dict(
            r, params=pm.full_state_dict(), predicted=dict(pm.plan.comm_bytes), mesh=str(pm.plan.mesh),
            sent_by_rank=all_ranks(r["sent"]), shard_mismatches=[m for ms in all_ranks(shard_mismatches(pm)) for m in ms],
            cut_params=sum(1 for i in pm.shards() if i.is_param and i.split_axes),
            n_axis_groups=len(s["axis_groups"]), n_process_groups=len(s["process_groups"]),
            program_groups_are_own=s["program_groups"] == s["axis_groups"], program_fsdp_is_own=s["program_fsdp"] == s["fsdp"],
            n_bucket_params=len(s["bucket_params"]), bucket_params_are_own=s["bucket_params"] <= s["params"],
            n_scheduled_params=len(s["scheduled_params"]), scheduled_params_are_own=s["scheduled_params"] <= s["params"],
            live_gathers=len(pm.fsdp_state.gathered), grads_in_flight=len(pm.fsdp_state.grads))
    out["shared"] = {k: v for k, v in shared.items() if k not in ("program_groups", "program_fsdp")}
    out["shared_by_rank"] = all_ranks(out["shared"])
    return out
