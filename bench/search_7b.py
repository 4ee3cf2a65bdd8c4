"""Search completeness at scale: a 7.5B-parameter GPT (36 layers, hidden 4096, 32 heads, seq 2048,
vocab 51200, batch 512) on 128 A100-80GB, the free ``strategy="auto"`` plan against pinned meshes.

    python bench/search_7b.py                          # auto, then dp=32,tp=4
    python bench/search_7b.py --meshes dp=32,tp=4 dp=16,tp=8 dp=64,tp=2
    python bench/search_7b.py --pipeline               # let auto try pipeline stages too (slower)
    python bench/search_7b.py --no-auto --jsonl rows.jsonl --meshes a=4,b=4,c=8 pp=4,dp=8,tp=4

The free plan must be at least as fast as every pinned one. Before the second pass bounded every
mesh with ZeRO-2 and recompute options (``autopar.mesh_search.search_with_zero2``), auto stopped at
m0=16,m1=2,m2=4 (2558 ms) because that mesh fit loosely, while dp=32,tp=4 is faster with them.
Each plan takes minutes on a 2-core machine (about 1,400 traced nodes, 22 candidate meshes).
``--jsonl`` appends each row as it is made (a long sweep keeps what it finished); a pinned mesh
that cannot be planned (over budget, a pin that does not apply) is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import time

from autopar.errors import AutoparError
from autopar.models.gpt import gpt
from autopar.planner import plan


def _model():
    return gpt("gpt3-6.7b", n_layer=36, n_head=32, n_embd=4096, vocab_size=51200, block_size=2048,
               batch_size=512, seq_len=2048, device="meta")


def _row(mesh, args) -> dict:
    model, inputs = _model()
    t0 = time.perf_counter()
    try:
        p = plan(model, 128, inputs, mesh=mesh, model_name="gpt-7.5b", pipeline=args.pipeline,
                 baselines=mesh is None, progress=args.progress)
    except AutoparError as exc:
        return dict(pinned=mesh or "auto", error=str(exc)[:300], plan_s=time.perf_counter() - t0)
    return dict(pinned=mesh or "auto", mesh=str(p.mesh), step_ms=p.step_seconds * 1e3,
                lower_bound_ms=p.solver.lower_bound * 1e3, gap=p.solver.gap,
                peak_gib=p.peak_memory_bytes_per_device / 2**30, recompute=list(p.recompute),
                plan_s=time.perf_counter() - t0, search=p.solver.mesh_search)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meshes", nargs="*", default=["dp=32,tp=4"], help="pinned meshes to compare")
    parser.add_argument("--pipeline", action="store_true", help="auto may choose pipeline stages")
    parser.add_argument("--no-auto", action="store_true", help="plan the pinned meshes only")
    parser.add_argument("--progress", action="store_true", help="the planner's progress lines on stderr")
    parser.add_argument("--json", default=None)
    parser.add_argument("--jsonl", default=None, help="append each row to this file as it is made")
    args = parser.parse_args()
    rows = []
    for mesh in ([] if args.no_auto else [None]) + list(args.meshes):
        rows.append(_row(mesh, args))
        r = rows[-1]
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")
        if "error" in r:
            print(f"{r['pinned']:12s} -> no plan ({r['error'][:120]})", flush=True)
            continue
        print(f"{r['pinned']:12s} -> {r['mesh']:22s} step {r['step_ms']:9.1f} ms  bound {r['lower_bound_ms']:9.1f} ms"
              f"  gap {r['gap'] * 100:5.2f}%  peak {r['peak_gib']:5.1f} GiB  planned in {r['plan_s']:.0f} s", flush=True)
    planned = [r for r in rows if "error" not in r]
    if args.no_auto or not planned or planned[0]["pinned"] != "auto":
        return
    auto = planned[0]["step_ms"]
    worse = [r["pinned"] for r in planned[1:] if r["step_ms"] < auto * (1 - 1e-9)]
    print("auto is at least as fast as every pinned mesh" if not worse else f"auto LOSES to {worse}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
