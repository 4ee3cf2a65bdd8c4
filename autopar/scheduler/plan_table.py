"""Build the scheduler's throughput table: ``autopar.plan`` at every (model, GPUs, per-GPU batch).

    python -m autopar.scheduler.plan_table --out autopar/scheduler/data/throughput_a100-80gb.json

Each point is one plan (``baselines=False, pipeline=False``: the scheduler needs the best plan's
step time, not the report) on the hardware profile, inside one node and, for jobs of up to a
node's GPUs, spanning nodes (a copy of the profile with one device per node, so every mesh axis
runs over the inter-node link). A batch that fits nowhere is recorded with ``step_seconds: null``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..cost_model.hardware import get_hardware
from ..errors import AutoparError
from ..models import get_model
from ..planner import plan

__all__ = ["build_table", "main"]


def _plan_point(name: str, n: int, q: int, spans: bool, hw, seq_len: int | None, strategy: str) -> dict[str, Any]:
    model, inputs = get_model(name, batch_size=n * q, seq_len=seq_len, device="meta")
    try:
        p = plan(model, n, inputs, hardware=hw, baselines=False, pipeline=False, model_name=name,
                 strategy=strategy if n > 1 else "auto")
        step, mesh = p.step_seconds, str(p.mesh)
    except AutoparError as exc:  # nothing fits in device memory at this batch
        step, mesh = None, f"infeasible: {str(exc)[:80]}"
    return {"n": n, "batch": n * q, "spans_nodes": spans, "step_seconds": step, "mesh": mesh}


def build_table(models: Sequence[str], gpu_counts: Sequence[int], per_gpu_batches: Sequence[int],
                hardware: str = "a100-80gb", seq_len: int | None = None, host_link_bytes_per_s: float = 25e9,
                progress: bool = True, strategy: str = "auto") -> dict[str, Any]:
    """Plan every (model, n, per-GPU batch) point, inside a node and spanning nodes; a JSON-ready dict.

    ``strategy`` pins the planner's family (``"dp"`` for jobs that run data parallel, as the real
    run's workers do); ``"auto"`` takes the best plan.

    ``host_link_bytes_per_s`` prices checkpoint traffic on migration (PCIe 4 x16 on A100 hosts,
    about 25 GB/s per direction; see FACTS).
    """
    hw = get_hardware(hardware)
    spread = dataclasses.replace(hw, devices_per_node=1)  # every axis crosses nodes
    out: dict[str, Any] = {"hardware": hw.name, "devices_per_node": hw.devices_per_node,
                           "host_link_bytes_per_s": host_link_bytes_per_s, "models": {}}
    for name in models:
        model, _ = get_model(name, seq_len=seq_len, device="meta")
        params = sum(p.numel() for p in model.parameters())
        points = []
        for n in gpu_counts:
            for spans in ((False, True) if 1 < n <= hw.devices_per_node else (n > hw.devices_per_node,)):
                for q in per_gpu_batches:
                    t0 = time.perf_counter()
                    pt = _plan_point(name, n, q, spans, spread if spans and n <= hw.devices_per_node else hw, seq_len,
                                     strategy)
                    points.append(pt)
                    if progress:
                        print(f"{name} n={n} b={n * q} spans={spans}: {pt['step_seconds']} {pt['mesh']} "
                              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        out["models"][name] = {"params": params, "per_gpu_batch": per_gpu_batches[len(per_gpu_batches) // 2],
                               "points": points}
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the scheduler's throughput table from autopar.plan.")
    ap.add_argument("--models", default="vit-base,bert-base,gpt2")
    ap.add_argument("--gpus", default="1,2,4,8,16,32,64")
    ap.add_argument("--per-gpu-batches", default="2,8,32")
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: each zoo entry's)")
    ap.add_argument("--host-link", type=float, default=25e9, help="host link bytes/s for checkpoints")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(list(argv) if argv is not None else None)
    t0 = time.perf_counter()
    table = build_table(args.models.split(","), _ints(args.gpus), _ints(args.per_gpu_batches), args.hardware,
                        args.seq, args.host_link)
    table["generated_by"] = ("python -m autopar.scheduler.plan_table " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None))
    table["build_seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps(table, indent=1), encoding="utf-8")
    print(f"{sum(len(m['points']) for m in table['models'].values())} plans in {table['build_seconds']} s -> "
          f"{args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
