"""What a sharded checkpoint costs: peak memory per rank while saving and loading, and the bytes
each rank reads and the seconds a reshard-on-load takes (the price of migrating a job).

    OMP_NUM_THREADS=1 python bench/checkpoint_cost.py [--layers 4 --embd 512]

A GPT (4 layers, 512 wide, vocabulary 2048: 14.8M parameters, 59 MB fp32; AdamW state twice
that) is trained one step under zero3 on 4 ranks and saved; then loaded at 2 ranks (zero3), 4
ranks (megatron-dp 2x2) and 8 ranks (zero3). Peak memory is the process's resident high-water
mark (Linux VmHWM, reset through /proc/self/clear_refs before each measured call) minus the
resident size before it: what the call adds on top of the rank's state. The ranks run with
glibc's ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor buffer over 64 KiB is its own mapping,
returned on free: the resident size follows live buffers instead of memory malloc keeps for
reuse. The same is measured for ``full_state_dict()``, which gathers the whole model on every
rank. ``--runs 2`` does only the save and the first load.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_added(fn):
    """(result, bytes the call added to the resident high-water mark)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _rss("VmRSS")
    out = fn()
    return out, _rss("VmHWM") - before


def build(layers: int, embd: int):
    from autopar.models import gpt

    torch.manual_seed(0)
    return gpt("gpt-tiny", batch_size=8, seq_len=32, n_layer=layers, n_embd=embd, vocab_size=2048)


def run(rank: int, world: int, port: int, phase: str, family: str, mesh: str, ckpt: str, args) -> None:
    from autopar import checkpoint
    from autopar.runtime.parallel_module import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, inputs = build(args.layers, args.embd)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pm = parallelize(model, example_inputs=inputs, strategy=family, mesh=mesh, mixed_precision=False, baselines=False)
    del model
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    loss = pm(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad()
    state_bytes = sum(t.numel() * t.element_size() for p in pm.parameters()
                      for t in [p, *(v for v in opt.state[p].values() if v.dim())])
    if phase == "save":
        _, added = peak_added(lambda: checkpoint.save(ckpt, pm, opt, extra={"step": 1}))
    else:
        stats: dict = {}
        _, added = peak_added(lambda: checkpoint.load(ckpt, pm, opt, stats=stats))
    _, full_added = peak_added(pm.full_state_dict)
    box: list = [None] * world
    dist.all_gather_object(box, (state_bytes, added, full_added))
    if rank == 0:
        mb = 1e6
        print(f"{phase} {family} {mesh} on {world} ranks (model {full_bytes / mb:.1f} MB fp32):")
        for r, (state, add, full) in enumerate(box):
            print(f"  rank {r}: own state (params + AdamW moments) {state / mb:6.1f} MB, peak added by "
                  f"{phase} {add / mb:6.1f} MB, by full_state_dict() {full / mb:6.1f} MB")
        if phase == "load":
            print(f"  bytes read per rank {[round(b / mb, 1) for b in stats['bytes_read_per_rank']]} MB, "
                  f"{stats['seconds']:.2f} s (checkpoint {sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)) / mb:.1f} MB)")
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--runs", type=int, default=4, help="how many of the save/load runs below to do")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc when each rank starts
    runs = ((4, "save", "zero3", "dp=4"), (2, "load", "zero3", "dp=2"),
            (4, "load", "megatron-dp", "dp=2,tp=2"), (8, "load", "zero3", "dp=8"))
    with tempfile.TemporaryDirectory() as root:
        ckpt = os.path.join(root, "ckpt")
        for world, phase, family, mesh in runs[:args.runs]:
            mp.spawn(run, args=(world, _port(), phase, family, mesh, ckpt, args), nprocs=world)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
