"""Steps/s of one AdamW (and LAMB) step on a single fp32 CPU tensor of 10M, 100M and 1B
elements: autopar's fused kernel (csrc/fused_optim.cpp) vs torch's fused CPU AdamW
(``fused=True``) and its ``foreach=True`` path, and the fused LAMB vs the torch-ops reference
LAMB, in one run. All methods step the same tensors in turn (round-robin, ``--rounds``
rounds), so load swings on a shared machine hit them alike; medians are printed.

    OMP_NUM_THREADS=1 python bench/cpu_optim.py               # 10M, 100M, and 1B where memory allows
    python bench/cpu_optim.py --sizes 1e7 1e8 --rounds 7

A size runs only if its working set is free (1B AdamW: p, g, m, v = 16 GB; the foreach path and
the two LAMBs need temporaries and state of the tensor's size on top, so they are left out where
memory is short): what was left out is printed, never guessed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.optim.adamw import adamw as torch_adamw

from autopar.optim import LAMB
from autopar.optim.cpu_kernels import adam_step, extension

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def mem_available_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")


def adamw_methods(p, g, m, v):
    step = torch.tensor(0.0)
    counter = [0]

    def torch_path(**flags):
        def run():
            torch_adamw([p], [g], [m], [v], [], [step], amsgrad=False, maximize=False,
                                    beta1=HYPER["beta1"], beta2=HYPER["beta2"], lr=HYPER["lr"],
                                    weight_decay=HYPER["weight_decay"], eps=HYPER["eps"], **flags)
        return run

    def ours():
        counter[0] += 1
        adam_step(p, g, m, v, counter[0], **HYPER)

    return {"autopar fused": ours, "torch fused": torch_path(fused=True), "torch foreach": torch_path(foreach=True)}


def lamb_methods(p, g):
    param = torch.nn.Parameter(p)
    param.grad = g
    fused = LAMB([param], lr=1e-3, weight_decay=0.01, fused=True)
    ref = LAMB([param], lr=1e-3, weight_decay=0.01, fused=False)
    return {"LAMB fused": fused.step, "LAMB reference": ref.step}


def time_round_robin(methods: dict, rounds: int) -> dict[str, float]:
    for run in methods.values():  # warm-up: state allocation, first touch
        run()
    times = {k: [] for k in methods}
    for _ in range(rounds):
        for name, run in methods.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e7, 1e8, 1e9])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    assert extension() is not None, "the C++ extension did not build: nothing to compare (see the warning)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); medians of {args.rounds} rounds; "
          f"load average {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'elements':>13}  {'method':<15} {'s/step':>9} {'steps/s':>9}  ratio")
    for n in (int(s) for s in args.sizes):
        need = 4 * n * 4 * 1.1  # p, g, m, v
        if mem_available_bytes() < need:
            print(f"{n:>13,}  skipped: needs ~{need / 2**30:.0f} GiB free, "
                  f"{mem_available_bytes() / 2**30:.0f} GiB available")
            continue
        gen = torch.Generator().manual_seed(0)
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
        m, v = torch.zeros(n), torch.zeros(n)
        methods = adamw_methods(p, g, m, v)
        if mem_available_bytes() < 2 * n * 4 * 1.2:  # foreach's temporaries on top of the state
            del methods["torch foreach"]
            print(f"{n:>13,}  torch foreach skipped: its temporaries need ~{2 * n * 4 / 2**30:.0f} GiB more")
        adam = time_round_robin(methods, args.rounds)
        del m, v
        for name, s in adam.items():
            ratio = "" if name == "autopar fused" else f"autopar fused is {s / adam['autopar fused']:.2f}x"
            print(f"{n:>13,}  {name:<15} {s:9.4f} {1 / s:9.2f}  {ratio}")
        if mem_available_bytes() < 5 * n * 4 * 1.2:  # state of two optimizers + the reference's temporaries
            print(f"{n:>13,}  LAMB skipped: needs ~{5 * n * 4 * 1.2 / 2**30:.0f} GiB more free")
            continue
        lamb = time_round_robin(lamb_methods(p, g), args.rounds)
        for name, s in lamb.items():
            ratio = "" if name == "LAMB fused" else f"LAMB fused is {s / lamb['LAMB fused']:.2f}x"
            print(f"{n:>13,}  {name:<15} {s:9.4f} {1 / s:9.2f}  {ratio}")
        del p, g


if __name__ == "__main__":
    main()
