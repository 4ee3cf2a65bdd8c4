"""Where a measured step goes: forward, backward (with its collectives), optimizer step, timed
apart on 4 CPU ranks for a few of ``bench/fidelity.py``'s plans, next to the cost model's parts.

    python bench/step_parts.py --hardware PROFILE.json --plans dp zero2 zero3 megatron [--profile dp]

Per plan: every rank runs warm-up steps, then ``--rounds`` steps, each part between barriers
(so a part is the slowest rank's; barriers stop the optimizer step of one rank from hiding a
late collective of another, which the real step does not either: ``opt.step`` waits for every
gradient). The median over rounds of each part is printed, with the plan's predicted compute,
communication (critical and asynchronous), and optimizer seconds (the parameter decisions'
share of the compute term). ``--profile NAME`` prints rank 0's top ops (torch.profiler, self
CPU time) of one step of that plan: where Python and dispatch overhead sit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

WORLD = 4


def _parts(module, opt, inputs) -> dict[str, float]:
    out = {}
    dist.barrier()
    t0 = time.perf_counter()
    if hasattr(module, "step") and hasattr(module, "stage_ids"):
        module.step(*inputs)
        dist.barrier()
        out["fwd+bwd"] = time.perf_counter() - t0
    else:
        loss = module(*inputs)
        dist.barrier()
        t1 = time.perf_counter()
        out["fwd"] = t1 - t0
        loss.backward()
        dist.barrier()
        out["bwd"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    out["opt"] = time.perf_counter() - t2
    return out


def _rank(rank: int, port: int, names: list[str], hardware: str, rounds: int, profile: str | None) -> None:
    from fidelity import PLANS, _make_plan
    from runtime_vs_baselines import FULL, build_model

    from autopar.plan import Plan
    from autopar.runtime.parallel_module import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    options = dict(PLANS)
    for name in names:
        box = [None]
        if rank == 0:
            model, inputs = build_model(FULL)
            box = [_make_plan(model, inputs, hardware, options[name]).to_json()]
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
        model, inputs = build_model(FULL)
        module = parallelize(model, example_inputs=inputs, plan=plan, hardware=hardware, mixed_precision=False)
        opt = torch.optim.AdamW(list(module.parameters()), lr=1e-3)
        for _ in range(2):
            _parts(module, opt, inputs)
        got: dict[str, list[float]] = {}
        for _ in range(rounds):
            for k, v in _parts(module, opt, inputs).items():
                got.setdefault(k, []).append(v)
        if profile == name and rank == 0:
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CPU]) as p:
                _parts(module, opt, inputs)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        elif profile == name:
            _parts(module, opt, inputs)
        if rank == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in got.items()}
            total = sum(med.values())
            print(f"{name:<13} {str(plan.mesh):<12} measured " + "  ".join(f"{k} {v:6.0f}" for k, v in med.items())
                  + f"  sum {total:6.0f} ms | predicted compute {plan.compute_seconds * 1e3:6.0f}  comm "
                  f"{plan.comm_seconds * 1e3:6.0f}  step {plan.step_seconds * 1e3:6.0f} ms", flush=True)
        del module, opt
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp
    from runtime_vs_baselines import _free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", nargs="+", default=["dp", "zero2", "zero3", "megatron"])
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    print(f"1-min load average at the start: {os.getloadavg()[0]:.1f}", flush=True)
    mp.spawn(_rank, args=(_free_port(), args.plans, args.hardware, args.rounds, args.profile), nprocs=WORLD)
    print(f"1-min load average at the end: {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
