"""Train the tiny GPT across processes with the plan autopar chooses, next to a single-process run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_gpt.py [--steps 5] [--strategy auto]
        [--memory-budget-mb 2]

Every rank builds the same model and batch; ``autopar.parallelize`` plans on rank 0 (cost model
of the ``--hardware`` profile), shares the plan, shards the parameters and returns a module
that trains with any torch optimizer. Rank 0 also trains an unmodified copy on one process and
prints both losses side by side, and the bytes each rank sent per step against the plan.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

from autopar.models import get_model
from autopar.runtime import count_bytes, parallelize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategy", default="auto", help="auto, dp, zero2, zero3, megatron, megatron-sp, megatron-dp")
    parser.add_argument("--hardware", default="a100-80gb", help="profile the plan is priced for")
    parser.add_argument("--memory-budget-mb", type=float, default=None,
                        help="per-device budget for the plan in MB (default: the device's memory). The tiny "
                             "GPT fits anywhere, and replicated is then fastest; a small budget makes it shard")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, batch = get_model("gpt-tiny", batch_size=8, seq_len=32)
    single = copy.deepcopy(model)
    budget = args.memory_budget_mb * 1e6 if args.memory_budget_mb else None
    parallel = parallelize(model, example_inputs=batch, strategy=args.strategy, hardware=args.hardware,
                           mixed_precision=False, memory_budget_bytes=budget)
    if rank == 0:
        p = parallel.plan
        print(f"plan: mesh {p.mesh}, predicted step {p.step_seconds * 1e3:.2f} ms on {args.hardware}, "
              f"peak memory {p.peak_memory_bytes_per_device / 2**20:.2f} MiB/device, bytes/step predicted "
              f"{sum(p.comm_bytes.values()):,.0f} ({', '.join(f'{k} {v:,.0f}' for k, v in sorted(p.comm_bytes.items()))})")
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-3)
    for step in range(args.steps):
        with count_bytes() as sent:
            loss = parallel(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref = single(*batch)
            ref.backward()
            single_opt.step()
            single_opt.zero_grad()
            print(f"step {step}: loss {loss.item():.6f} (single process {ref.item():.6f}), "
                  f"bytes sent {sum(sent.values()):,.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
