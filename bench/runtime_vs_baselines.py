"""Train one GPT with autopar and with torch's own parallel methods, on CPU ranks (gloo).

    python bench/runtime_vs_baselines.py --methods ddp autopar-dp --out /tmp/r.json [--quick]

Launches ``--ranks`` processes (torch.multiprocessing, gloo, one thread each) that run the
given methods one after the other (``bench/suite.py`` launches one method per run, so a
failure or hang costs one method). Per method every rank builds the same model from one seed
and the same global batch, sets the method up (timed apart from the steps), runs
``warmup`` steps under the live-tensor tracker (``bench/memtrack.py``: peak bytes per rank,
from the last warm-up step) and ``steps`` timed steps (forward, backward, AdamW step,
zero_grad; a barrier before and after each, so a step is the slowest rank's), with
``autopar.runtime.count_bytes`` around forward and backward. Rank 0 writes one JSON record
per method to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memtrack import LiveBytes, optimizer_tensors  # noqa: E402
from methods import setup  # noqa: E402

__all__ = ["ModelShape", "FULL", "QUICK", "build_model", "run_methods"]

LR = 1e-3


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    batch_size: int  # global batch
    seq_len: int
    warmup: int
    steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


# ~7.4 M parameters, 1024 tokens per step: ~1.8 s per step on one core here, ~1 s on 4 ranks
FULL = ModelShape(n_layer=4, n_head=8, n_embd=256, vocab_size=8192, batch_size=8, seq_len=128, warmup=2, steps=5)
QUICK = ModelShape(n_layer=2, n_head=4, n_embd=128, vocab_size=2048, batch_size=8, seq_len=64, warmup=2, steps=2)


def build_model(shape: ModelShape, device: str = "cpu"):
    from autopar.models import GPTConfig, gpt

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
                    vocab_size=shape.vocab_size, block_size=shape.seq_len)
    return gpt(cfg, batch_size=shape.batch_size, seq_len=shape.seq_len, device=device)


def _step(runner, opt) -> tuple[torch.Tensor, dict[str, float]]:
    from autopar.runtime import count_bytes

    with runner.step_context():
        with count_bytes() as sent:
            loss = runner.module(*runner.inputs)
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, dict(sent)


def _run_one(method: str, shape: ModelShape, hardware: str) -> dict:
    rank = dist.get_rank()
    gc.collect()
    model, inputs = build_model(shape)
    dist.barrier()
    runner, setup_s = setup(method, model, inputs, hardware)
    del model
    dist.barrier()
    opt = torch.optim.AdamW(runner.param_groups, lr=LR)
    losses, tracked_s = [], []
    with LiveBytes() as mem:
        for i in range(shape.warmup):
            mem.track(optimizer_tensors(runner.module, opt))
            if i == shape.warmup - 1:
                mem.reset_peak()
            t0 = time.perf_counter()
            loss, _ = _step(runner, opt)
            tracked_s.append(time.perf_counter() - t0)
            losses.append(runner.global_loss(loss))
        peak_bytes = mem.peak_bytes
    del loss
    step_s, sent_per_step = [], []
    for _ in range(shape.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss, sent = _step(runner, opt)
        dist.barrier()
        step_s.append(time.perf_counter() - t0)
        sent_per_step.append(sent)
        losses.append(runner.global_loss(loss))
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mine = dict(peak_bytes=peak_bytes, rss_mib=rss_mib, setup_s=setup_s, sent=sent_per_step)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    mesh, info = runner.mesh, runner.info
    del runner, opt
    if rank != 0:
        return {}
    return dict(method=method, ok=True, mesh=mesh, losses=losses,
                step_s=step_s, median_step_s=statistics.median(step_s),
                tokens_per_s=shape.tokens_per_step / statistics.median(step_s),
                tracked_step_s=tracked_s, setup_s=max(r["setup_s"] for r in everyone),
                peak_bytes_per_rank=[r["peak_bytes"] for r in everyone],
                rss_hwm_mib_per_rank=[r["rss_mib"] for r in everyone],
                sent_per_rank_per_step=[r["sent"] for r in everyone], **info)


def _rank_main(rank: int, world: int, port: int, methods: list[str], shape: ModelShape, hardware: str,
               out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    records = []
    try:
        for method in methods:
            try:
                records.append(_run_one(method, shape, hardware))
            except Exception as exc:  # recorded per method; the suite reports it
                records.append(dict(method=method, ok=False, error=f"{type(exc).__name__}: {exc}",
                                    traceback=traceback.format_exc()[-3000:]))
                raise
            dist.barrier()
    finally:
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump([r for r in records if r], f, indent=1)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_methods(methods: list[str], shape: ModelShape, hardware: str, out_path: str, ranks: int = 4) -> None:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    mp.spawn(_rank_main, args=(ranks, _free_port(), methods, shape, hardware, out_path), nprocs=ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", required=True, help="ddp fsdp2 tp autopar-<family> ...")
    parser.add_argument("--out", required=True)
    parser.add_argument("--hardware", default="cpu", help="profile (or JSON path) autopar plans with")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    shape = QUICK if args.quick else FULL
    try:
        run_methods(args.methods, shape, args.hardware, args.out, args.ranks)
    except Exception:
        # a rank raised: its record (with traceback) is in --out if rank 0 got to write it
        if not os.path.exists(args.out):
            with open(args.out, "w") as f:
                json.dump([dict(method=m, ok=False, error=traceback.format_exc()[-3000:]) for m in args.methods], f)
        sys.exit(1)


if __name__ == "__main__":
    main()
