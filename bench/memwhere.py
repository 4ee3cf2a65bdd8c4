"""What is alive at a training step's peak, next to what the plan predicts: the tool behind
peak-memory fidelity fixes.

    python bench/memwhere.py --plans megatron 2d       # plans of bench/fidelity.py, its GPT
    python bench/memwhere.py --hardware hw.json --quick

For every plan (``bench/fidelity.py``'s list), 4 gloo ranks set it up, run two steps and
measure the second (``bench/memtrack.py``: live tensor bytes). At the moment the live bytes
peak, every live storage is put in one group: parameters, gradients, optimizer state, the
input batch, or else the aten op that first produced it, and the phase (forward, backward,
optimizer step). Rank 0 prints the plan's prediction (peak, phase, persistent bytes,
buckets, gradients, kept activations) and every rank's measured groups, largest first.
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from memtrack import LiveBytes, optimizer_tensors  # noqa: E402

WORLD = 4


class PeakGroups(LiveBytes):
    """``LiveBytes`` that also remembers who made each storage and, at each new peak, which
    storages were alive (weak references, so the snapshot keeps nothing alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "?"
        self.made_by: dict[int, str] = {}
        self.snapshot: list[tuple[weakref.ref | None, int, str]] = []
        self.snapshot_phase = ""
        self.snapshot_op = ""
        self._op = ""
        self._refs: dict[int, weakref.ref] = {}

    def _count(self, storage) -> None:
        key = id(storage)
        if key not in self._storages:
            self.made_by[key] = self._op or "tracked"
            try:
                self._refs[key] = weakref.ref(storage)
            except TypeError:
                pass
        before = self.peak_bytes
        super()._count(storage)
        if self.peak_bytes > before:
            # a list first: a storage freed while this runs (a weak reference's callback) edits the dict
            live = list(self._storages.items())
            self.snapshot = [(self._refs.get(k), n, self.made_by.get(k, "?")) for k, (_, n) in live]
            self.snapshot_phase, self.snapshot_op = self.phase, self._op

    def _freed(self, key: int) -> None:
        super()._freed(key)
        self.made_by.pop(key, None)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = f"{self.phase}:{func.__name__}"
        return super().__torch_dispatch__(func, types, args, kwargs)


def _groups(mem: PeakGroups, named: dict[int, str]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for ref, nbytes, who in mem.snapshot:
        st = ref() if ref is not None else None
        label = named.get(id(st), who) if st is not None else who + " (freed since)"
        out[label] += nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _storage_names(module, opt, inputs) -> dict[int, str]:
    from memtrack import plain_tensors

    names: dict[int, str] = {}

    def put(t, label):
        if isinstance(t, torch.Tensor):
            for p in plain_tensors(t):
                names.setdefault(id(p.untyped_storage()), label)

    for p in module.parameters():
        put(p.grad, "gradient")
        put(p, "parameter")
    for state in opt.state.values():
        for v in state.values():
            put(v, "optimizer state")
    for x in inputs:
        put(x, "input")
    return names


def _rank(rank: int, port: int, names: list[str], quick: bool, hardware: str) -> None:
    from fidelity import PLANS, _plans_on_rank0
    from runtime_vs_baselines import FULL, QUICK, build_model

    from autopar.plan import Plan
    from autopar.runtime.offload import make_optimizer
    from autopar.runtime.parallel_module import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    shape = QUICK if quick else FULL
    chosen = [n for n, _ in PLANS if n in names]
    for name, text in zip(chosen, _plans_on_rank0(shape, hardware, names)):
        if text is None:
            continue
        plan = Plan.from_json(text)
        model, inputs = build_model(shape)
        module = parallelize(model, example_inputs=inputs, plan=plan, hardware=hardware, mixed_precision=False)
        opt = make_optimizer(module, lr=1e-3)  # as bench/fidelity.py: the fused AdamW the plan prices
        pipelined = hasattr(module, "step") and hasattr(module, "stage_ids")
        tracker = PeakGroups()
        with tracker:  # both steps: storages kept from the first (gradient buckets) count in the second
            for i in range(2):
                mem = tracker if i == 1 else None
                tracker.track(optimizer_tensors(module, opt) + list(inputs))
                if mem is not None:
                    mem.reset_peak()
                    mem.phase = "forward"
                if pipelined:
                    module.step(*inputs)
                else:
                    loss = module(*inputs)
                    if mem is not None:
                        mem.phase = "backward"
                    loss.backward()
                if mem is not None:
                    mem.phase = "optimizer"
                    named = _storage_names(module, opt, inputs)
                opt.step()
                if mem is not None:
                    named.update({k: v for k, v in _storage_names(module, opt, inputs).items() if k not in named})
                    groups = _groups(mem, named)
                opt.zero_grad(set_to_none=True)
        lines = [f"rank {rank}: measured peak {mem.peak_bytes / 2**20:.1f} MiB in {mem.snapshot_phase} at "
                 f"{mem.snapshot_op}"]
        lines += [f"    {v / 2**20:8.2f} MiB  {k}" for k, v in groups.items() if v >= 2**16]
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, "\n".join(lines))
        if rank == 0:
            print(f"=== {name} ({plan.mesh}): predicted peak {plan.peak_memory_bytes_per_device / 2**20:.1f} MiB, "
                  f"phase {getattr(plan, 'peak_phase', '?')}, param state {plan.param_state_bytes / 2**20:.1f} MiB "
                  f"(buckets {plan.bucket_bytes / 2**20:.1f}), activations {plan.activation_bytes / 2**20:.1f} MiB",
                  flush=True)
            for text_ in everyone:
                print(text_, flush=True)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp
    from fidelity import PLANS
    from runtime_vs_baselines import _free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", nargs="+", default=[n for n, _ in PLANS], choices=[n for n, _ in PLANS])
    ap.add_argument("--hardware", default="cpu", help="a profile name or JSON path (autopar calibrate --out)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(_rank, args=(_free_port(), args.plans, args.quick, args.hardware), nprocs=WORLD)


if __name__ == "__main__":
    main()
