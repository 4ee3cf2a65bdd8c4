"""Predicted 1D vs 2D vs 2.5D vs 3D tensor parallelism (and autopar's own choice) on GPT widths.

    python bench/layouts.py                  # d = 1024, 4096, 12288 on 8, 64, 512 devices (a100-80gb)
    python bench/layouts.py --quick          # d = 1024 on 8 and 64 devices only (smoke run)
    python bench/layouts.py --json out.json  # every figure, per entry

Every figure is **predicted by autopar's cost model** with a built-in hardware profile
(``a100-80gb`` unless ``--hardware``), not measured: ``autopar.plan`` is run on a GPT built on
the meta device (no memory, no GPU) with the strategy family pinned, ``baselines=False`` and
``pipeline=False``. Layouts:

* ``1D``: the faster of ``megatron`` (1D tensor parallel over all devices) and ``megatron-dp``
  (1D TP, tp = 2/4/8 inside a node, x data parallel), as users run Megatron;
* ``2D`` (``"2d"``, SUMMA/Optimus), ``2.5D`` (``"2.5d"``, Tesseract), ``3D`` (``"3d"``):
  ``autopar.tp_families``; each family tries its candidate meshes and keeps the fastest;
* ``auto``: the unpinned search (1-, 2-, 3-axis meshes; on 3 axes the outer one is a data
  axis), with ``layout_kind(plan)`` naming what it turned out to be.

Per entry: predicted step time (compute + communication as the cost model adds them), peak
memory per device (parameters, gradients, optimizer state, activations), bytes each device
sends per step (all collectives, forward + backward + gradient sync), and the wall time the
plan took here. ``does not fit``: no plan of the family fits the memory budget (the device's
capacity unless ``--memory-budget-gib``); ``-``: the family has no mesh on that many devices
(or none its pin can follow). Ratios are ``1D step time / layout step time`` (> 1: faster
than 1D).

The GPTs have few layers (``--layers``, default 4): repeated blocks are priced once and
multiplied, so depth hardly changes plan time. With 4 layers the LM head (vocab 50304) is a
large share of the work (printed per width: 43% of the forward matmul FLOPs at d=1024), and the
logits (tokens x vocab) are the largest activation; ``->loss ms`` shows what moving them into
the loss costs. Section 3a pins the papers' 64-GPU grids (1D over all 64, 2D 8x8, 2.5D 4x4x4,
3D 4x4x4, and 1D 8-way in a node x 8-way DP) next to the families' fastest meshes.

Time here (2 shared cores, ``--serial``): ~1 min for the full run (69 plans, the slowest
``auto`` on 512 devices at 10-20 s under load), ~10 s for ``--quick``. Without ``--serial``,
``autopar.plan`` forks its usual helper process and uses both cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time

import torch._dynamo  # noqa: F401  (loaded by every trace; kept out of the per-plan times)
import torch.export  # noqa: F401

import autopar.forking
from autopar import trace
from autopar.cost_model.hardware import get_hardware
from autopar.errors import AutoparError
from autopar.models.gpt import GPTConfig, gpt
from autopar.planner import plan
from autopar.tp_families import layout_kind

from layouts_text import Entry, cell_time, entry_cells, explain, fmt_ratio, ratio, table

WIDTHS = (1024, 4096, 12288)
DEVICES = (8, 64, 512)
QUICK_WIDTHS, QUICK_DEVICES = (1024,), (8, 64)
LAYOUTS = ("1D", "2D", "2.5D", "3D", "auto")
FAMILIES = {"1D": ("megatron", "megatron-dp"), "2D": ("2d",), "2.5D": ("2.5d",), "3D": ("3d",), "auto": ("auto",)}
GIB = 2**30
# The grids the papers ran on 64 GPUs, pinned (section 3a): (label, family, mesh).
PAPER_MESHES = (("1D tp=64", "megatron", "tp=64"), ("1D dp=8,tp=8", "megatron-dp", "dp=8,tp=8"),
                ("2D 8x8", "2d", "row=8,col=8"), ("2.5D 4x4x4", "2.5d", "dep=4,row=4,col=4"),
                ("3D 4x4x4", "3d", "x=4,y=4,z=4"))

# Reported speedups (FACTS.md, "Tensor-parallel communication per layer"): training throughput
# ratios on 64 GPUs (3D: 64 V100), (numerator-beaten layout, layout, ratio, source).
PAPERS = (("1D", "2D", 1.48, "Optimus, arXiv 2104.05343 (vs Megatron, 64 GPUs)"),
          ("1D", "2.5D", 1.38, "Tesseract, arXiv 2105.14500"),
          ("2D", "2.5D", 1.53, "Tesseract, arXiv 2105.14500"),
          ("1D", "3D", 2.32, "3D TP, arXiv 2105.14450 (64 V100)"),
          ("2D", "3D", 1.57, "3D TP, arXiv 2105.14450 (64 V100)"))


class _WallCap(Exception):
    pass


_LOSS_OPS = ("cross_entropy_loss", "nll_loss")


def _loss_edge(p) -> tuple[float, float]:
    """Communication seconds and bytes sent per device on the edges into the loss (the logits
    moved to the layout the loss rule takes), as ``cost_model.evaluate`` prices edges. Reads
    the plan's priced problem (``plan.problem``): (nan, nan) where that is unavailable."""
    try:
        from autopar.cost_model.comm import bytes_sent_per_rank
        from autopar.cost_model.evaluate import shared_reshards
        from autopar.cost_model.reshard import reshard_steps

        problem, choice = p.problem, p.choice
        shared = shared_reshards(problem, choice)
        seconds = sent = 0.0
        for idx, e in enumerate(problem.edges):
            d = problem.decisions.get(e.consumer)
            if d is None or d.node.op != "call_function" or not any(o in str(d.node.target) for o in _LOSS_OPS):
                continue
            copies = e.count - shared.get(idx, 0)
            if not copies:
                continue
            a, b = e.producer_layouts[choice[e.producer]], e.consumer_layouts[choice[e.consumer]]
            seconds += e.seconds[(a, b)] * copies / e.count
            fwd, bwd = reshard_steps(a, b, e.total_bytes, problem.mesh, e.needs_grad)
            sent += sum(bytes_sent_per_rank(s.collective, s.nbytes, problem.mesh.sizes[s.axis]) * copies
                        for s in fwd + bwd)
        return seconds, sent
    except Exception:  # private structures changed: leave the column empty
        return math.nan, math.nan


def _alarm(_sig, _frame):
    raise _WallCap()


def _short(exc: BaseException, limit: int = 90) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _plan_one(gm, n: int, family: str, width: int, hardware: str, budget: float | None, time_limit_s: float,
              cap_s: float, mesh: str | None = None, layout: str | None = None) -> Entry:
    layout = layout or next(k for k, fams in FAMILIES.items() if family in fams)
    e = Entry(width, n, layout, family, "ok")
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm) if cap_s else None
    if cap_s:
        signal.alarm(int(math.ceil(cap_s)))
    try:
        p = plan(gm, n, hardware=hardware, strategy=family, mesh=mesh, baselines=False, pipeline=False,
                 memory_budget_bytes=budget, time_limit_s=time_limit_s, model_name=f"gpt-d{width}")
    except _WallCap:
        e.status, e.reason = "timeout", f"stopped after the {cap_s:.0f} s wall cap"
    except AutoparError as exc:
        need = getattr(exc, "need_bytes", None)
        if need is not None:
            e.status, e.reason = "does not fit", f"smallest plan needs {need / GIB:.1f} GiB/device"
        elif type(exc).__name__ == "PinError" or "no mesh" in str(exc) or "no layout" in str(exc):
            e.status, e.reason = "-", f"{type(exc).__name__}: {_short(exc)}"
        else:
            e.status, e.reason = "error", f"{type(exc).__name__}: {_short(exc)}"
    else:
        e.mesh, e.step_s, e.compute_s, e.comm_s = str(p.mesh), p.step_seconds, p.compute_seconds, p.comm_seconds
        e.peak_bytes, e.param_state_bytes, e.activation_bytes = (p.peak_memory_bytes_per_device, p.param_state_bytes,
                                                                 p.activation_bytes)
        e.comm_bytes = {k: float(v) for k, v in p.comm_bytes.items()}
        e.sent_bytes = sum(e.comm_bytes.values())
        e.loss_comm_s, e.loss_sent_bytes = _loss_edge(p)
        weights = {nd.name for nd in gm.graph.nodes
                   if nd.op == "get_attr" and getattr(nd.meta.get("val"), "ndim", 0) >= 2}
        split = sum(1 for nd in p.nodes if nd.name in weights and "S" in nd.output_layout)
        e.split_weights = f"{split}/{len(weights)}"
        try:
            e.kind = layout_kind(p)
        except Exception as exc:  # a naming helper must not lose the figures
            e.kind = f"? ({type(exc).__name__})"
        if p.peak_memory_bytes_per_device > p.memory_budget_bytes * (1 + 1e-9):
            e.status, e.reason = "does not fit", (f"best plan needs {p.peak_memory_bytes_per_device / GIB:.1f} "
                                                  f"GiB/device")
    finally:
        if cap_s:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    e.plan_s = time.perf_counter() - t0
    return e


def _best_1d(entries: list[Entry]) -> Entry:
    """The faster feasible of megatron and megatron-dp (else the first, to show its status)."""
    ok = [e for e in entries if e.status == "ok"]
    best = min(ok, key=lambda e: e.step_s) if ok else entries[0]
    if not ok and len(entries) > 1:  # neither fits / applies: say why for both
        best = Entry(**{**best.__dict__})
        best.reason = "; ".join(f"{e.family}: {e.status}{' (' + e.reason + ')' if e.reason else ''}"
                                for e in entries)
    best.others = [{k: v for k, v in e.__dict__.items() if k != "others"} for e in entries
                   if e.family != best.family]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"d={QUICK_WIDTHS} on {QUICK_DEVICES} devices only")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every entry's figures here")
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--widths", type=int, nargs="+", default=None)
    ap.add_argument("--devices", type=int, nargs="+", default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=512, help="global batch in sequences (default 512: every "
                    "family's batch-split axes divide it on 8, 64 and 512 devices)")
    ap.add_argument("--memory-budget-gib", type=float, default=None, help="default: the device's capacity")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per plan (time_limit_s)")
    ap.add_argument("--cap", type=float, default=240.0, help="wall-clock cap per plan, s (0: none)")
    ap.add_argument("--skip", nargs="*", default=[], metavar="LAYOUT@N",
                    help="entries not to plan, e.g. 3D@512 auto@512 (reported as skipped)")
    ap.add_argument("--no-paper-meshes", action="store_true", help="skip section 3a (the papers' 64-device grids)")
    ap.add_argument("--serial", action="store_true",
                    help="no forked helper process inside plan() (one busy process; slower plans)")
    args = ap.parse_args()
    widths = tuple(args.widths or (QUICK_WIDTHS if args.quick else WIDTHS))
    devices = tuple(args.devices or (QUICK_DEVICES if args.quick else DEVICES))
    budget = args.memory_budget_gib * GIB if args.memory_budget_gib else None
    if args.serial:  # the planner forks a helper to bound meshes on the second core; keep to one
        autopar.forking.fork_is_safe = lambda: False  # the pipeline search's share_work
        autopar.planner.fork_is_safe = lambda: False  # the mesh search's helper
    bad = [n for n in devices if args.batch % n]
    if bad:
        print(f"warning: batch {args.batch} does not divide {bad} devices; some meshes will be skipped",
              file=sys.stderr)
    t_start = time.perf_counter()
    hw = get_hardware(args.hardware)
    precision = ("bf16 mixed precision" if hw.peak_flops > 1.5 * hw.peak_flops_fp32 else "fp32")  # plan()'s default

    print("Tensor-parallel layouts, PREDICTED by autopar's cost model (not measured): hardware profile "
          f"'{args.hardware}', {precision}, AdamW.")
    print(f"GPT, {args.layers} layers, head dim 128 (n_head = d/128), vocab 50304, seq {args.seq}, "
          f"global batch {args.batch} sequences ({args.batch * args.seq:,} tokens) on every device count (strong "
          "scaling).")
    print("step ms: predicted step time; compute/comm ms: the model's compute and communication seconds; peak GiB: "
          "predicted peak memory per device; sent GiB: bytes each device sends per step; vs 1D: 1D step / layout "
          "step (>1: faster than 1D); plan s: wall time of autopar.plan here (time_limit_s="
          f"{args.time_limit:.0f}{f', wall cap {args.cap:.0f} s' if args.cap else ''}"
          f"{', serial: no helper process' if args.serial else ''}).")
    print("1D = the faster of megatron (TP over all devices) and megatron-dp (TP 2/4/8 in a node x DP); "
          "'does not fit': over the memory budget; '-': no mesh of the family on that many devices.")
    print(flush=True)

    results: dict[tuple[int, int], dict[str, Entry]] = {}
    paper_runs: dict[int, dict[str, Entry]] = {}  # width -> paper-shaped 64-device meshes
    all_entries: list[Entry] = []

    def log(e: Entry) -> None:
        all_entries.append(e)
        what = f"{e.step_s * 1e3:9.2f} ms  {e.mesh}  {e.kind}" if e.status == "ok" else f"{e.status}: {e.reason}"
        print(f"  d={e.width:5d} n={e.devices:4d} {e.family:12s} {e.plan_s:6.1f} s  {what}", file=sys.stderr,
              flush=True)

    for d in widths:
        cfg = GPTConfig(n_layer=args.layers, n_head=d // 128, n_embd=d, vocab_size=50304,
                        block_size=max(args.seq, 1024))
        t0 = time.perf_counter()
        model, inputs = gpt(cfg, batch_size=args.batch, seq_len=args.seq, device="meta")
        gm = trace(model, inputs, stack_traces=False)  # once per width: plan() re-annotates it per mesh
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[d={d}: traced in {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
        layer_flops = args.layers * (24 * d * d + 4 * args.seq * d)  # per token, forward: matmuls + attention
        head_flops = 2 * 50304 * d
        print(f"d={d}: {d // 128} heads, {n_params / 1e9:.2f} B parameters; the LM head is "
              f"{head_flops / (head_flops + layer_flops):.0%} of the forward matmul FLOPs")
        for n in devices:
            row: dict[str, Entry] = {}
            for layout in LAYOUTS:
                entries = []
                for family in FAMILIES[layout]:
                    if f"{layout}@{n}" in args.skip or f"{family}@{n}" in args.skip:
                        e = Entry(d, n, layout, family, "skipped", "skipped (--skip): too slow to plan here")
                    else:
                        e = _plan_one(gm, n, family, d, args.hardware, budget, args.time_limit, args.cap)
                    entries.append(e)
                    log(e)
                row[layout] = _best_1d(entries) if layout == "1D" else entries[0]
            results[(d, n)] = row
        if 64 in devices and not args.no_paper_meshes:
            paper_runs[d] = {}
            for label, family, mesh in PAPER_MESHES:
                e = _plan_one(gm, 64, family, d, args.hardware, budget, args.time_limit, args.cap, mesh=mesh,
                              layout=label)
                log(e)
                paper_runs[d][label] = e

    # --- table 1: every entry ----------------------------------------------------------------
    print()
    print("1. Every layout, each family on its fastest mesh: predicted step, compute and communication time, "
          "peak memory and bytes sent per device")
    rows = []
    for (d, n), row in results.items():
        for layout in LAYOUTS:
            e = row[layout]
            fam = f" ({e.family})" if layout == "1D" else ""
            rows.append(entry_cells(e, layout + fam, row["1D"]))
    for line in table(["d", "devices", "layout", "mesh", "kind", "split W", "step ms", "compute ms", "comm ms",
                        "->loss ms", "peak GiB", "sent GiB", "largest collective", "vs 1D", "plan s", "note"], rows,
                       {0, 1, 5, 6, 7, 8, 9, 10, 11, 13, 14}):
        print(line)
    notes = []
    for (d, n), r in results.items():
        for o in r["1D"].others:
            notes.append(f"d={d}/{n}: {o['family']} " + (f"{o['step_s'] * 1e3:.1f} ms on {o['mesh']}"
                                                        if o["status"] == "ok" else o["status"]))
    if notes:
        print("the other 1D family: " + "; ".join(notes))
    print("kind: autopar.tp_families.layout_kind(plan); split W: weight matrices stored split on some mesh axis, of "
          "all of them; ->loss ms: the part of comm ms spent moving the logits into the loss (cross_entropy's rule "
          "keeps the vocab dim whole)")
    print()

    # --- table 2: ratios and winners ---------------------------------------------------------
    print("2. Speedup vs 1D (1D step / layout step; >1: faster than 1D) and the fastest layout per row")
    rows = []
    for (d, n), row in results.items():
        one_d = row["1D"]
        ok = {k: e for k, e in row.items() if e.status == "ok"}
        fixed = {k: e for k, e in ok.items() if k != "auto"}
        win = min(ok, key=lambda k: ok[k].step_s) if ok else "-"
        win_fixed = min(fixed, key=lambda k: fixed[k].step_s) if fixed else "-"
        auto = row["auto"]
        rows.append([str(d), str(n), cell_time(one_d)]
                    + [fmt_ratio(ratio(one_d, row[k])) if row[k].status == "ok" else row[k].status
                       for k in LAYOUTS[1:]]
                    + [auto.kind if auto.status == "ok" else "", win, win_fixed])
    for line in table(["d", "devices", "1D step ms", "2D", "2.5D", "3D", "auto", "auto is", "fastest",
                        "fastest pinned"], rows, {0, 1, 2, 3, 4, 5, 6}):
        print(line)
    print()

    # --- 3: the papers' grids at 64 devices, and the papers vs our predictions ----------------
    explanation: list[str] = []
    at64 = {d: results[(d, 64)] for d in widths if (d, 64) in results}
    if paper_runs:
        print("3a. The papers' grids on 64 devices (mesh pinned): 1D over all 64 devices as the papers' Megatron "
              "baseline, 1D in a node x DP, 2D 8x8, 2.5D 4x4x4, 3D 4x4x4")
        rows = []
        for d, pr in paper_runs.items():
            for label, e in pr.items():
                rows.append(entry_cells(e, label, pr["1D tp=64"]))
        for line in table(["d", "devices", "layout", "mesh", "kind", "split W", "step ms", "compute ms",
                            "comm ms", "->loss ms", "peak GiB", "sent GiB", "largest collective", "vs tp=64", "plan s",
                            "note"], rows, {0, 1, 5, 6, 7, 8, 9, 10, 11, 13, 14}):
            print(line)
        print()
    if at64:
        print("3b. Reported speedups (FACTS.md: measured training throughput on V100-era clusters) vs autopar's "
              "predicted ratios on 64 devices")
        rows = []
        for base, lay, paper, src in PAPERS:
            for d, r in at64.items():
                pr = paper_runs.get(d, {})
                sq_base = [pr.get("1D tp=64"), pr.get("1D dp=8,tp=8")] if base == "1D" else [pr.get("2D 8x8")] * 2
                sq_lay = pr.get({"2D": "2D 8x8", "2.5D": "2.5D 4x4x4", "3D": "3D 4x4x4"}[lay])
                rows.append([f"{lay} vs {base}", f"{paper:.2f}x", str(d), fmt_ratio(ratio(r[base], r[lay])),
                             fmt_ratio(ratio(sq_base[0], sq_lay)), fmt_ratio(ratio(sq_base[1], sq_lay)), src])
        for line in table(["comparison", "paper", "d", "best meshes (tables 1-2)", "papers' grids, 1D = tp=64",
                            "papers' grids, 1D = dp=8,tp=8", "source"], rows, {1, 2, 3, 4, 5}):
            print(line)
        print("(best meshes: each family on its fastest mesh, 1D the faster of megatron and megatron-dp; papers' "
              "grids: table 3a; '-': one side does not fit or has no mesh)")
        print()
        explanation = explain(at64, paper_runs, hw.devices_per_node)
        print("4. What the figures say (sentences generated from the predictions above, 64 devices)")
        for s in explanation:
            print(f"- {s}")
        print()

    slow = sorted((e for e in all_entries if e.status != "skipped"), key=lambda e: -e.plan_s)[:5]
    total = time.perf_counter() - t_start
    failed = [e for e in all_entries if e.status in ("error", "timeout")]
    print("slowest plans: " + ", ".join(f"{e.family}@{e.devices} d={e.width} {e.plan_s:.1f} s" for e in slow))
    if failed:
        print("errors / timeouts: " + "; ".join(f"{e.family}@{e.devices} d={e.width}: {e.reason}" for e in failed))
    skipped = [e for e in all_entries if e.status == "skipped"]
    if skipped:
        print("skipped (--skip): " + ", ".join(f"{e.family}@{e.devices} d={e.width}" for e in skipped))
    print(f"total wall time {total:.0f} s ({len(all_entries)} plans)"
          + (f"; figures in {args.json}" if args.json else ""))
    if args.json:
        clean = lambda e: {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                           for k, v in e.__dict__.items() if k != "others"}
        out = dict(hardware=args.hardware, layers=args.layers, seq=args.seq, batch=args.batch,
                   memory_budget_bytes=budget, time_limit_s=args.time_limit, wall_cap_s=args.cap, serial=args.serial,
                   widths=list(widths), devices=list(devices), total_wall_s=total,
                   entries=[clean(e) for e in all_entries],
                   table={f"d={d},n={n}": {k: e.family for k, e in row.items()} for (d, n), row in results.items()},
                   paper_meshes={str(d): {k: clean(e) for k, e in pr.items()} for d, pr in paper_runs.items()},
                   papers=[dict(comparison=f"{lay} vs {base}", reported=paper, source=src,
                                predicted_64_best_meshes={str(d): ratio(r[base], r[lay]) for d, r in at64.items()})
                           for base, lay, paper, src in PAPERS],
                   explanation=explanation)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
