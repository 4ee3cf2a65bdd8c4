"""Where a measured step goes: forward, backward (with its collectives), optimizer step, timed
apart on 4 CPU ranks for a few of ``bench/fidelity.py``'s plans, next to the cost model's parts.

    python bench/step_parts.py --hardware PROFILE.json --plans dp zero2 zero3 megatron [--profile dp]

Ranks are pinned 2 per core and step the optimizer ``autopar.runtime.offload.make_optimizer``
builds, as ``bench/fidelity.py`` and ``autopar calibrate`` do. Every plan is set up and warmed up
first; then ``--rounds`` rounds each step every plan once, then calibrate's reference step
(``autopar/calibrate_reference.py``), each part between barriers (so a part is the slowest
rank's; barriers stop the optimizer step of one rank from hiding a late collective of another,
which the real step does not either: ``opt.step`` waits for every gradient). Printed per plan:
the median over rounds of each part, each rank's CPU seconds per step (all its threads, gloo's
included: where the sum over ranks is about cores x wall, the step is CPU-bound; far below, the
cores idled in waits), each rank's minor page faults per step (fresh memory the allocator took
from the system and the kernel zeroed), and the plan's predicted compute, communication and
step. The reference step's line says how fast the machine ran in these rounds: divide a plan's
measured step by it to compare plans across launches. ``--profile NAME`` prints rank 0's top
ops (torch.profiler, self CPU time) of one step of that plan: where Python and dispatch
overhead sit.
"""

from __future__ import annotations

import argparse
import os
import resource
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
    faults, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    t0 = time.perf_counter()
    if not hasattr(module, "parameters"):  # the reference step: one callable, timed whole
        module()
        dist.barrier()
        out["step"] = time.perf_counter() - t0
    elif hasattr(module, "step") and hasattr(module, "stage_ids"):
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
    if opt is not None:
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        out["opt"] = time.perf_counter() - t2
    out["cpu"] = time.process_time() - cpu  # this rank's, not a part: not summed into the step
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return out


def _reference_step():
    """Calibrate's reference step (every rank alone, fused AdamW), as one callable."""
    from autopar.calibrate_reference import reference_model

    model, inputs = reference_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step() -> None:
        model(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _rank(rank: int, port: int, names: list[str], hardware: str, rounds: int, profile: str | None) -> None:
    from fidelity import PLANS, make_plan
    from runtime_vs_baselines import FULL, build_model

    from autopar.calibrate_measure import pin_to_core
    from autopar.plan import Plan
    from autopar.runtime.offload import make_optimizer
    from autopar.runtime.parallel_module import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_core(rank, WORLD)  # 2 ranks per core, as calibrate and bench/fidelity.py run them
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    options = dict(PLANS)
    runs = {}
    for name in names:
        box = [None]
        if rank == 0:
            model, inputs = build_model(FULL)
            box = [make_plan(model, inputs, hardware, options[name]).to_json()]
        dist.broadcast_object_list(box, src=0)
        plan = Plan.from_json(box[0])
        model, inputs = build_model(FULL)
        module = parallelize(model, example_inputs=inputs, plan=plan, hardware=hardware, mixed_precision=False)
        opt = make_optimizer(module, lr=1e-3)
        runs[name] = (plan, module, opt, inputs)
    runs["reference"] = (None, _reference_step(), None, ())
    for _, module, opt, inputs in runs.values():
        for _ in range(2):
            _parts(module, opt, inputs)
    got: dict[str, dict[str, list[float]]] = {name: {} for name in runs}
    for _ in range(rounds):  # round robin: a load swing of the machine hits every plan alike
        for name, (_, module, opt, inputs) in runs.items():
            for k, v in _parts(module, opt, inputs).items():
                got[name].setdefault(k, []).append(v)
    if profile in runs:
        _, module, opt, inputs = runs[profile]
        if rank == 0:
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CPU]) as p:
                _parts(module, opt, inputs)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        else:
            _parts(module, opt, inputs)
    medians = {name: {k: statistics.median(v) for k, v in parts.items()} for name, parts in got.items()}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, medians)
    if rank == 0:
        for name, (plan, *_) in runs.items():
            med = {k: v * 1e3 for k, v in medians[name].items() if k not in ("cpu", "faults")}
            cpu = [round(e[name]["cpu"] * 1e3) for e in everyone]
            faults = [round(e[name]["faults"]) for e in everyone]
            predicted = "" if plan is None else (
                f" | predicted compute {plan.compute_seconds * 1e3:4.0f}  comm {plan.comm_seconds * 1e3:4.0f}  "
                f"step {plan.step_seconds * 1e3:4.0f} ms")
            mesh = "" if plan is None else str(plan.mesh)
            print(f"{name:<13} {mesh:<12} measured " + "  ".join(f"{k} {v:4.0f}" for k, v in med.items())
                  + f"  sum {sum(med.values()):4.0f} ms; CPU ms/rank {cpu}, page faults/rank {faults}" + predicted,
                  flush=True)
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
