"""Train the tiny GPT across processes with the plan autopar chooses, next to a single-process run.

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 4 examples/train_gpt.py [--steps 5] [--strategy auto]
        [--memory-budget-mb 2]

Every rank builds the same model and batch; ``autopar.parallelize`` plans on rank 0 (cost model
of the ``--hardware`` profile), shares the plan, shards the parameters and returns a module
that trains with any torch optimizer. Rank 0 also trains an unmodified copy on one process and
prints both losses side by side, and the bytes each rank sent per step against the plan.

Checkpoints and resume (``autopar.checkpoint``, sharded on torch.distributed.checkpoint):

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 --max-restarts 1 examples/train_gpt.py \
        --steps 8 --checkpoint-every 2 --checkpoint-dir ckpt --resume

saves the model, the AdamW state and the data position every 2 steps (``ckpt/step_000002``, ...;
a checkpoint counts once its manifest is written). With ``--resume``, a (re)started run loads the
latest complete one, with the plan it was saved under, and continues at the next step: the batch
of step ``i`` is drawn from a generator seeded by ``i``, so the data position is the step number
and no optimizer step is lost or repeated. ``--fail-rank R --fail-after-step K`` makes rank R
SIGKILL itself after step K on the first attempt only (how the test kills a rank mid-run).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal

import torch
import torch.distributed as dist

from autopar import checkpoint
from autopar.models import get_model
from autopar.models.gpt import GPT_CONFIGS
from autopar.runtime import count_bytes
from autopar.runtime.parallel_module import parallelize

BATCH, SEQ = 8, 32


def batch_at(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step ``step`` (a generator seeded by the step: the data position is the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    vocab = GPT_CONFIGS["gpt-tiny"].vocab_size
    return (torch.randint(vocab, (BATCH, SEQ), generator=g), torch.randint(vocab, (BATCH, SEQ), generator=g))


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (its manifest is written last)."""
    done = sorted(d for d in os.listdir(root) if d.startswith("step_")
                  and os.path.exists(os.path.join(root, d, checkpoint.MANIFEST))) if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def init_process_group(attempt: int) -> None:
    """gloo over torchrun's store. After a restart, the store still holds the first attempt's
    addresses under the same keys, and a rank may read a dead peer's address before the new one
    is written (connection refused): each attempt gets its own key prefix."""
    if attempt == 0 or "MASTER_ADDR" not in os.environ:
        dist.init_process_group("gloo")
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank, world_size=world)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--strategy", default="auto", help="auto, dp, zero2, zero3, megatron, megatron-sp, megatron-dp")
    parser.add_argument("--hardware", default="a100-80gb", help="profile the plan is priced for")
    parser.add_argument("--memory-budget-mb", type=float, default=None,
                        help="per-device budget for the plan in MB (default: the device's memory). The tiny "
                             "GPT fits anywhere, and replicated is then fastest; a small budget makes it shard")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint, if any")
    parser.add_argument("--losses-out", default=None, help="rank 0 appends 'attempt step loss.hex()' lines here")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank SIGKILLs itself (first attempt only)")
    parser.add_argument("--fail-after-step", type=int, default=-1)
    args = parser.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group(attempt)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model, batch = get_model("gpt-tiny", batch_size=BATCH, seq_len=SEQ)
    resume_from = latest_checkpoint(args.checkpoint_dir) if args.resume else None
    # A checkpointed run draws a new batch every step and skips the single-process reference
    # (it would start over on a restart).
    single = None if args.checkpoint_every or resume_from else copy.deepcopy(model)
    budget = args.memory_budget_mb * 1e6 if args.memory_budget_mb else None
    # Resuming on the same world size runs the plan the checkpoint was saved under.
    saved = checkpoint.read_record(resume_from)[0] if resume_from else None
    plan = saved["plans"][0] if saved and saved["world_size"] == dist.get_world_size() else None
    parallel = parallelize(model, example_inputs=batch, strategy=args.strategy, hardware=args.hardware,
                           mixed_precision=False, memory_budget_bytes=budget, plan=plan)
    if rank == 0:
        p = parallel.plan
        print(f"plan: mesh {p.mesh}, predicted step {p.step_seconds * 1e3:.2f} ms on {args.hardware}, "
              f"peak memory {p.peak_memory_bytes_per_device / 2**20:.2f} MiB/device, bytes/step predicted "
              f"{sum(p.comm_bytes.values()):,.0f} ({', '.join(f'{k} {v:,.0f}' for k, v in sorted(p.comm_bytes.items()))})")
    opt = torch.optim.AdamW(parallel.parameters(), lr=1e-3)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-3) if single is not None else None
    start = checkpoint.load(resume_from, parallel, opt)["step"] if resume_from else 0
    if rank == 0 and resume_from:
        print(f"attempt {attempt}: resumed from {resume_from} at step {start}")
    for step in range(start, args.steps):
        if args.checkpoint_every:
            batch = batch_at(step)
        with count_bytes() as sent:
            loss = parallel(*batch)
            loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and args.losses_out:
            with open(args.losses_out, "a") as f:
                f.write(f"{attempt} {step} {loss.item().hex()}\n")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            checkpoint.save(os.path.join(args.checkpoint_dir, f"step_{step + 1:06d}"), parallel, opt,
                            extra={"step": step + 1})
        if attempt == 0 and rank == args.fail_rank and step == args.fail_after_step:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank: torchrun restarts the job
        if single is None:
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f}, bytes sent {sum(sent.values()):,.0f}")
            continue
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
