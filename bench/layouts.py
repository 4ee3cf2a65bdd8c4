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
multiplied, so depth hardly changes plan time, and per-layer ratios are what the papers report.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch._dynamo  # noqa: F401  (loaded by every trace; kept out of the per-plan times)
import torch.export  # noqa: F401

import autopar.planner as planner_mod
from autopar import trace
from autopar.errors import AutoparError
from autopar.models.gpt import GPTConfig, gpt
from autopar.planner import plan
from autopar.tp_families import layout_kind

WIDTHS = (1024, 4096, 12288)
DEVICES = (8, 64, 512)
QUICK_WIDTHS, QUICK_DEVICES = (1024,), (8, 64)
LAYOUTS = ("1D", "2D", "2.5D", "3D", "auto")
FAMILIES = {"1D": ("megatron", "megatron-dp"), "2D": ("2d",), "2.5D": ("2.5d",), "3D": ("3d",), "auto": ("auto",)}
GIB = 2**30

# Reported speedups (FACTS.md, "Tensor-parallel communication per layer"): training throughput
# ratios on 64 GPUs (3D: 64 V100), (numerator-beaten layout, layout, ratio, source).
PAPERS = (("1D", "2D", 1.48, "Optimus, arXiv 2104.05343 (vs Megatron, 64 GPUs)"),
          ("1D", "2.5D", 1.38, "Tesseract, arXiv 2105.14500"),
          ("2D", "2.5D", 1.53, "Tesseract, arXiv 2105.14500"),
          ("1D", "3D", 2.32, "3D TP, arXiv 2105.14450 (64 V100)"),
          ("2D", "3D", 1.57, "3D TP, arXiv 2105.14450 (64 V100)"))


class _WallCap(Exception):
    pass


@dataclass
class Entry:
    width: int
    devices: int
    layout: str
    family: str
    status: str  # "ok", "does not fit", "-", "error", "timeout", "skipped"
    reason: str = ""
    mesh: str = ""
    kind: str = ""
    step_s: float = math.nan
    compute_s: float = math.nan
    comm_s: float = math.nan
    peak_bytes: float = math.nan
    param_state_bytes: float = math.nan
    activation_bytes: float = math.nan
    sent_bytes: float = math.nan
    comm_bytes: dict = field(default_factory=dict)
    plan_s: float = 0.0
    others: list = field(default_factory=list)  # 1D: the other family's figures


def _alarm(_sig, _frame):
    raise _WallCap()


def _short(exc: BaseException, limit: int = 90) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _plan_one(gm, n: int, family: str, width: int, hardware: str, budget: float | None, time_limit_s: float,
              cap_s: float) -> Entry:
    layout = next(k for k, fams in FAMILIES.items() if family in fams)
    e = Entry(width, n, layout, family, "ok")
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm) if cap_s else None
    if cap_s:
        signal.alarm(int(math.ceil(cap_s)))
    try:
        p = plan(gm, n, hardware=hardware, strategy=family, baselines=False, pipeline=False,
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


def _cell_time(e: Entry) -> str:
    return f"{e.step_s * 1e3:.1f}" if e.status == "ok" else e.status


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.2f}x"


def _ratio(num: Entry | None, den: Entry | None) -> float | None:
    if num is None or den is None or num.status != "ok" or den.status != "ok":
        return None
    return num.step_s / den.step_s


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def _best_1d(entries: list[Entry]) -> Entry:
    """The faster feasible of megatron and megatron-dp (else the first, to show its status)."""
    ok = [e for e in entries if e.status == "ok"]
    best = min(ok, key=lambda e: e.step_s) if ok else entries[0]
    if not ok and len(entries) > 1:  # neither fits / applies: say why for both
        best = Entry(**{**best.__dict__})
        best.reason = "; ".join(f"{e.family}: {e.status}{' (' + e.reason + ')' if e.reason else ''}"
                                for e in entries)
    best.others = [{k: v for k, v in e.__dict__.items() if k != "others"} for e in entries if e is not best]
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
    ap.add_argument("--serial", action="store_true",
                    help="no forked helper process inside plan() (one busy process; slower plans)")
    args = ap.parse_args()
    widths = tuple(args.widths or (QUICK_WIDTHS if args.quick else WIDTHS))
    devices = tuple(args.devices or (QUICK_DEVICES if args.quick else DEVICES))
    budget = args.memory_budget_gib * GIB if args.memory_budget_gib else None
    if args.serial:  # the planner forks a helper to bound meshes on the second core; keep to one
        planner_mod._fork_is_safe = lambda: False
    bad = [n for n in devices if args.batch % n]
    if bad:
        print(f"warning: batch {args.batch} does not divide {bad} devices; some meshes will be skipped",
              file=sys.stderr)
    t_start = time.perf_counter()

    print("Tensor-parallel layouts, PREDICTED by autopar's cost model (not measured): hardware profile "
          f"'{args.hardware}', bf16 mixed precision, AdamW.")
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
    all_entries: list[Entry] = []
    for d in widths:
        cfg = GPTConfig(n_layer=args.layers, n_head=d // 128, n_embd=d, vocab_size=50304,
                        block_size=max(args.seq, 1024))
        t0 = time.perf_counter()
        model, inputs = gpt(cfg, batch_size=args.batch, seq_len=args.seq, device="meta")
        gm = trace(model, inputs, stack_traces=False)  # once per width: plan() re-annotates it per mesh
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[d={d}: {n_params / 1e9:.2f} B parameters, traced in {time.perf_counter() - t0:.1f} s]",
              file=sys.stderr, flush=True)
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
                    all_entries.append(e)
                    what = (f"{e.step_s * 1e3:9.2f} ms  {e.mesh}  {e.kind}" if e.status == "ok"
                            else f"{e.status}: {e.reason}")
                    print(f"  d={d:5d} n={n:4d} {family:12s} {e.plan_s:6.1f} s  {what}", file=sys.stderr, flush=True)
                row[layout] = _best_1d(entries) if layout == "1D" else entries[0]
            results[(d, n)] = row

    # --- table 1: every entry ----------------------------------------------------------------
    print("1. Every layout: predicted step, compute and communication time, peak memory and bytes sent per device")
    rows = []
    for (d, n), row in results.items():
        one_d = row["1D"]
        for layout in LAYOUTS:
            e = row[layout]
            ok = e.status == "ok"
            fam = e.family if layout in ("1D",) else ""
            rows.append([str(d), str(n), layout + (f" ({fam})" if fam else ""), e.mesh or "-",
                         e.kind if ok else "", _cell_time(e),
                         f"{e.compute_s * 1e3:.1f}" if ok else "", f"{e.comm_s * 1e3:.1f}" if ok else "",
                         f"{e.peak_bytes / GIB:.1f}" if ok else "", f"{e.sent_bytes / GIB:.2f}" if ok else "",
                         _fmt_ratio(_ratio(one_d, e)) if layout != "1D" else ("1.00x" if ok else "-"),
                         f"{e.plan_s:.1f}" if e.status != "skipped" else "-",
                         "" if ok else e.reason])
    for line in _table(["d", "devices", "layout", "mesh", "kind", "step ms", "compute ms", "comm ms", "peak GiB",
                        "sent GiB", "vs 1D", "plan s", "note"], rows, {0, 1, 5, 6, 7, 8, 9, 10, 11}):
        print(line)
    alt = [(k, r["1D"]) for k, r in results.items() if r["1D"].others]
    notes = []
    for (d, n), e in alt:
        for o in e.others:
            if o["status"] == "ok":
                notes.append(f"d={d}/{n}: {o['family']} {o['step_s'] * 1e3:.1f} ms on {o['mesh']}")
            else:
                notes.append(f"d={d}/{n}: {o['family']} {o['status']}")
    if notes:
        print("the other 1D family: " + "; ".join(notes))
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
        rows.append([str(d), str(n), _cell_time(one_d)]
                    + [_fmt_ratio(_ratio(one_d, row[k])) if row[k].status == "ok" else row[k].status
                       for k in LAYOUTS[1:]]
                    + [auto.kind if auto.status == "ok" else "", win, win_fixed])
    for line in _table(["d", "devices", "1D step ms", "2D", "2.5D", "3D", "auto", "auto is", "fastest",
                        "fastest pinned"], rows, {0, 1, 2, 3, 4, 5, 6}):
        print(line)
    print()

    # --- 3: the papers vs our predictions at 64 devices ---------------------------------------
    at64 = {d: results[(d, 64)] for d in widths if (d, 64) in results}
    explanation: list[str] = []
    if at64:
        print("3. Reported speedups (FACTS.md; measured training throughput, V100-era clusters) vs autopar's "
              "predicted ratios at 64 devices")
        headers = ["comparison", "paper", "source"] + [f"d={d}" for d in at64] + [f"d={d} vs megatron" for d in at64]
        rows = []
        for base, lay, paper, src in PAPERS:
            cells = [f"{lay} vs {base}", f"{paper:.2f}x", src]
            cells += [_fmt_ratio(_ratio(r[base], r[lay])) for r in at64.values()]
            pure = []
            for d, r in at64.items():  # against 1D over all 64 devices, as the papers' baselines were
                if base != "1D":
                    pure.append("")
                    continue
                meg = [x for x in [r["1D"]] + [Entry(**{k: v for k, v in o.items()}) for o in r["1D"].others]
                       if x.family == "megatron"]
                pure.append(_fmt_ratio(_ratio(meg[0], r[lay])) if meg else "-")
            rows.append(cells + pure)
        for line in _table(headers, rows, set(range(3, len(headers)))):
            print(line)
        print("(vs 1D: best of megatron / megatron-dp; 'vs megatron': against 1D TP over all 64 devices)")
        print()
        explanation = _explain(at64)
        print("4. What the figures say (generated from the predictions above)")
        for s in explanation:
            print(f"- {s}")
        print()

    slow = sorted((e for e in all_entries if e.status != "skipped"), key=lambda e: -e.plan_s)[:5]
    total = time.perf_counter() - t_start
    failed = [e for e in all_entries if e.status in ("error", "timeout")]
    print(f"slowest plans: " + ", ".join(f"{e.family}@{e.devices} d={e.width} {e.plan_s:.0f} s" for e in slow))
    if failed:
        print("errors / timeouts: " + "; ".join(f"{e.family}@{e.devices} d={e.width}: {e.reason}" for e in failed))
    skipped = [e for e in all_entries if e.status == "skipped"]
    if skipped:
        print("skipped (--skip): " + ", ".join(f"{e.family}@{e.devices} d={e.width}" for e in skipped))
    print(f"total wall time {total:.0f} s ({len(all_entries)} plans)" + (f"; figures in {args.json}" if args.json else ""))
    if args.json:
        out = dict(hardware=args.hardware, layers=args.layers, seq=args.seq, batch=args.batch,
                   memory_budget_bytes=budget, time_limit_s=args.time_limit, wall_cap_s=args.cap, serial=args.serial,
                   widths=list(widths), devices=list(devices), total_wall_s=total,
                   entries=[{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                             for k, v in e.__dict__.items() if k != "others"} for e in all_entries],
                   table={f"d={d},n={n}": {k: e.family for k, e in row.items()} for (d, n), row in results.items()},
                   papers=[dict(comparison=f"{lay} vs {base}", reported=paper, source=src,
                                predicted_64={str(d): _ratio(r[base], r[lay]) for d, r in at64.items()})
                           for base, lay, paper, src in PAPERS],
                   explanation=explanation)
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _explain(at64: dict[int, dict[str, Entry]]) -> list[str]:
    """Sentences from the 64-device figures: which term dominates, what the bytes do, memory."""
    out = []
    for d, row in at64.items():
        ok = {k: e for k, e in row.items() if e.status == "ok"}
        if not ok:
            out.append(f"d={d}: no layout fits or applies on 64 devices.")
            continue
        parts = []
        for k, e in ok.items():
            share = e.comm_s / (e.compute_s + e.comm_s) if e.compute_s + e.comm_s > 0 else math.nan
            parts.append(f"{k} {e.compute_s * 1e3:.0f}+{e.comm_s * 1e3:.0f} ms ({share:.0%} comm, "
                         f"{e.sent_bytes / GIB:.1f} GiB sent, {e.peak_bytes / GIB:.0f} GiB peak)")
        out.append(f"d={d}, 64 devices, compute+communication: " + "; ".join(parts) + ".")
        one = ok.get("1D")
        if one is not None:
            comm_dom = one.comm_s > one.compute_s
            out.append(f"d={d}: 1D ({one.family}, {one.mesh}) is {'communication' if comm_dom else 'compute'}-bound "
                       f"in the model ({one.comm_s / max(one.compute_s, 1e-12):.2f}x as much communication as compute "
                       "time).")
            for k in ("2D", "2.5D", "3D"):
                e = ok.get(k)
                if e is None:
                    why = row[k].status + (f" ({row[k].reason})" if row[k].reason else "")
                    out.append(f"d={d}: {k} has no figure here: {why}.")
                    continue
                dc, dm = e.compute_s - one.compute_s, e.comm_s - one.comm_s
                byte_ratio = e.sent_bytes / one.sent_bytes if one.sent_bytes else math.inf
                main = "communication" if abs(dm) >= abs(dc) else "compute"
                verdict = "faster" if e.step_s < one.step_s else "slower"
                out.append(f"d={d}: {k} is {verdict} than 1D ({one.step_s / e.step_s:.2f}x), mostly through "
                           f"{main} ({dc * 1e3:+.0f} ms compute, {dm * 1e3:+.0f} ms communication); it sends "
                           f"{byte_ratio:.2f}x 1D's bytes and needs {e.peak_bytes / one.peak_bytes:.2f}x its peak "
                           "memory.")
        else:
            out.append(f"d={d}: 1D has no figure on 64 devices ({row['1D'].status}: {row['1D'].reason}).")
        a = ok.get("auto")
        if a is not None:
            best_fixed = min((e for k, e in ok.items() if k != "auto"), key=lambda e: e.step_s, default=None)
            if best_fixed is not None:
                rel = best_fixed.step_s / a.step_s
                out.append(f"d={d}: auto picks {a.kind or '?'} on {a.mesh} ({a.step_s * 1e3:.1f} ms), "
                           f"{rel:.2f}x the best pinned layout ({best_fixed.layout}, {best_fixed.step_s * 1e3:.1f} ms)"
                           + ("; the pinned layout is faster: it lies outside auto's search space (on 3-axis meshes "
                              "auto keeps the outer axis a data axis)" if rel < 1 - 1e-6 else "") + ".")
    return out


if __name__ == "__main__":
    main()
