"""Interleaved timing of a few methods in one launch: every round runs one step of each
method in turn, so the load swings of a shared machine hit all of them alike (the suite runs
one launch per method, back to back, and its ratios move with the load between launches).

    python bench/interleaved.py ddp autopar-dp fsdp2 autopar-zero3 --rounds 6

Prints per-method median step time (ms), the ratio of each autopar method to the baseline
before it on the command line (of the medians, and per round with the median of those: a
round's two steps ran seconds apart, so the per-round ratio is the one a load swing between
rounds moves least), every round's times, and each method's peak live bytes per
rank (``bench/memtrack.py``, the largest over ranks, from one extra untimed step). Same model,
batch and setup as ``runtime_vs_baselines.FULL`` (``--quick``: ``QUICK``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, world: int, port: int, methods: list[str], rounds: int, quick: bool, hardware: str) -> None:
    from bench.memtrack import LiveBytes, optimizer_tensors
    from bench.methods import setup
    from bench.runtime_vs_baselines import FULL, QUICK, _step, build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape = QUICK if quick else FULL
    runs = {}
    for m in methods:
        model, inputs = build_model(shape)
        runner, _ = setup(m, model, inputs, hardware)
        opt = torch.optim.AdamW(runner.param_groups, lr=1e-3)
        for _ in range(shape.warmup):
            _step(runner, opt)
        runs[m] = (runner, opt)
    peak: dict[str, float] = {}
    for m in methods:  # one untimed step under the tracker (it costs Python work per op)
        runner, opt = runs[m]
        with LiveBytes() as mem:
            mem.track(optimizer_tensors(runner.module, opt))
            _step(runner, opt)
        everyone = [None] * world
        dist.all_gather_object(everyone, mem.peak_bytes)
        peak[m] = max(everyone)
    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            dist.barrier()
            t0 = time.perf_counter()
            _step(*runs[m])
            dist.barrier()
            times[m].append(time.perf_counter() - t0)
    if rank == 0:
        med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
        for k, m in enumerate(methods):
            ratio = ""
            if m.startswith("autopar-") and k and not methods[k - 1].startswith("autopar-"):
                base = methods[k - 1]
                per_round = [b / a for a, b in zip(times[m], times[base])]  # one round's throughput ratio
                ratio = (f"  throughput vs {base}: {med[base] / med[m]:.2f}x, "
                         f"peak memory vs {base}: {peak[m] / peak[base]:.2f}x\n{'':<20} per-round ratios "
                         f"{[round(r, 2) for r in per_round]}, median {statistics.median(per_round):.2f}x, "
                         f">= 1 in {sum(r >= 1 for r in per_round)} of {len(per_round)}")
            print(f"{m:<20} median {med[m]:7.0f} ms  peak {peak[m] / 2**20:6.1f} MiB/rank  "
                  f"rounds {[round(x * 1e3) for x in times[m]]}{ratio}")
        print(f"1-min load average at the end: {os.getloadavg()[0]:.1f}")
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from bench.runtime_vs_baselines import _free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("methods", nargs="+")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hardware", default="cpu", help="profile for autopar's plans (name or JSON path)")
    args = ap.parse_args()
    mp.spawn(_rank, args=(4, _free_port(), args.methods, args.rounds, args.quick, args.hardware), nprocs=4)


if __name__ == "__main__":
    main()
