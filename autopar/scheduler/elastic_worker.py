"""One elastic training job, run by torchrun on CPU "GPU slots" (gloo): the real run's worker.

    torchrun --nproc_per_node N -m autopar.scheduler.elastic_worker --job-dir D --steps S --batch B --seed K

Trains the zoo's tiny GPT data parallel (``strategy="dp"``) on a global batch ``B`` that is the
same at every world size, so its loss trajectory is the single-process one whatever the GPU
count. Step ``s`` trains on a batch drawn from ``(seed, s)`` alone. Between steps rank 0 looks
for ``D/stop`` (or reaches ``--pause-at``) and tells every rank; on a stop every rank saves its
pieces of the state (``job_checkpoint``: ``autopar.checkpoint``, DCP) and exits, and a later
launch at another world size resumes from it (reshard on load). Rank 0 appends one JSON line per
step (step, loss, world size, time) to ``D/steps.jsonl`` and one per launch to
``D/launches.jsonl``: when the worker's ``main`` started, when its first step started, what the
load and the save cost, and when it exited (the real run's calibration of the simulator).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..models import get_model
from ..runtime.parallel_module import parallelize
from .job_checkpoint import has_job_state, load_job_state, save_job_state

__all__ = ["make_batch", "main"]

SEQ_LEN = 32


def make_batch(seed: int, step: int, batch: int, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (batch, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build(seed: int, batch: int):
    torch.manual_seed(seed)
    model, _ = get_model("gpt-tiny", batch_size=batch, seq_len=SEQ_LEN)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--pause-at", type=int, default=None, help="checkpoint and exit before this step (tests)")
    args = ap.parse_args(argv)
    t_main = time.time()
    job_dir = Path(args.job_dir)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.seed, args.batch)
    pm = parallelize(model, example_inputs=make_batch(args.seed, 0, args.batch), strategy="dp", hardware="cpu",
                     mixed_precision=False)
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr)
    ckpt = job_dir / "state"
    step, load_s, bytes_read = load_job_state(ckpt, pm, opt) if has_job_state(ckpt) else (0, 0.0, 0)
    record = {"world": world, "t_main": t_main, "load_s": load_s, "bytes_read": bytes_read, "first_step": step,
              "t_ready": time.time(), "save_s": 0.0}
    flag = torch.zeros(1)
    log = open(job_dir / "steps.jsonl", "a", encoding="utf-8") if rank == 0 else None
    while step < args.steps:
        if rank == 0:
            flag.fill_(1.0 if (job_dir / "stop").exists() or step == args.pause_at else 0.0)
        dist.broadcast(flag, 0)
        if flag.item():
            break
        loss = pm(*make_batch(args.seed, step, args.batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if log is not None:
            log.write(json.dumps({"step": step, "loss": loss.item(), "world": world, "t": time.time()}) + "\n")
            log.flush()
        step += 1
    if step < args.steps:
        record["t_stop_seen"] = time.time()
        record["save_s"] = save_job_state(ckpt, pm, opt, step)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        record.update(last_step=step, t_exit=time.time())
        with open(job_dir / "launches.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
