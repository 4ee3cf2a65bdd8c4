"""The suite's tables (aligned plain text) and the fidelity figures derived from the runtime run."""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["table", "spearman", "fidelity_rows", "print_runtime", "print_fidelity", "print_scaling"]

MIB = 2**20
# each autopar family next to the torch method of the same family
PAIRS = [("autopar-dp", "ddp"), ("autopar-zero3", "fsdp2"), ("autopar-megatron", "tp"),
         ("autopar-auto", "ddp"), ("autopar-auto", "fsdp2"), ("autopar-auto", "tp")]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def is_num(s: str) -> bool:
        return bool(s) and (s[0].isdigit() or s[0] in "-+.") and any(ch.isdigit() for ch in s)

    def fmt(r):
        return "  ".join(c.rjust(w) if is_num(c) else c.ljust(w) for c, w in zip(r, widths)).rstrip()

    lines = ([title] if title else []) + [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells]
    return "\n".join(lines)


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):  # ties share their average rank
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (ties averaged); nan below 2 points."""
    if len(a) != len(b) or len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fidelity_rows(runtime: list[dict]) -> dict:
    """Per autopar plan that ran: bytes per collective (predicted, measured on every rank and
    timed step), peak memory and step time, predicted vs measured; Spearman over the plans."""
    plans = []
    for r in runtime:
        if not r["method"].startswith("autopar-") or not r.get("ok"):
            continue
        predicted = r["predicted_comm_bytes"]
        measured = r["sent_per_rank_per_step"]
        kinds = sorted(set(predicted) | {k for rank in measured for step in rank for k in step})
        collectives = []
        for k in kinds:
            seen = [step.get(k, 0.0) for rank in measured for step in rank]
            p = predicted.get(k, 0.0)
            collectives.append(dict(collective=k, predicted_bytes=p, measured_bytes_rank0=seen[0],
                                    measured_min=min(seen), measured_max=max(seen),
                                    equal=all(math.isclose(s, p, rel_tol=1e-9, abs_tol=0.5) for s in seen)))
        peak = max(r["peak_bytes_per_rank"])
        plans.append(dict(plan=r["method"][len("autopar-"):], mesh=r["mesh"], collectives=collectives,
                          bytes_equal=all(c["equal"] for c in collectives),
                          predicted_peak_bytes=r["predicted_peak_bytes"], measured_peak_bytes=peak,
                          peak_ratio=peak / r["predicted_peak_bytes"],
                          retained_untrained_param_bytes=r.get("retained_untrained_param_bytes", 0.0),
                          predicted_step_s=r["predicted_step_s"], measured_step_s=r["median_step_s"],
                          step_ratio=r["median_step_s"] / r["predicted_step_s"]))
    rho = spearman([p["predicted_step_s"] for p in plans], [p["measured_step_s"] for p in plans])
    return dict(plans=plans, spearman_step_time=rho, n_plans=len(plans))


def print_runtime(runtime: list[dict], shape, reference_loss: float, hardware: str) -> None:
    rows = []
    for r in runtime:
        if not r.get("ok"):
            rows.append([r["method"], "FAILED (see below)"] + [""] * 9)
            continue
        loss0 = r["losses"][0]
        rows.append([r["method"], r["mesh"], _f(r["setup_s"]), _f(r.get("plan_s")), _f(r["median_step_s"] * 1e3, ".0f"),
                     _f(r["tokens_per_s"], ".0f"), _f(max(r["peak_bytes_per_rank"]) / MIB),
                     _f(max(r["rss_hwm_mib_per_rank"]), ".0f"), f"{loss0:.6f}",
                     f"{(loss0 - reference_loss) / reference_loss:+.1e}",
                     "{:.1f}/{:.1f}".format(*r.get("load1_before_after", (math.nan, math.nan)))])
    print()
    print(table(["method", "mesh", "setup s", "plan s", "step ms", "tokens/s", "peak MiB/rank", "RSS hwm MiB",
                 "loss@0", "vs ref", "load"], rows,
                title=f"1. Runtime vs baselines: GPT {shape.n_layer} layers, d={shape.n_embd}, {shape.n_head} heads, "
                      f"vocab {shape.vocab_size}, global batch {shape.batch_size}x{shape.seq_len} tokens, fp32 AdamW; "
                      f"4 CPU ranks (gloo, 1 thread each); {shape.warmup} warm-up + {shape.steps} timed steps, "
                      f"median; autopar plans with hardware {hardware!r}"))
    for r in runtime:
        if not r.get("ok"):
            print(f"  {r['method']} FAILED: {r['error'][:400]}")
    print(f"reference loss@0 (one process, unparallelized): {reference_loss:.6f}. peak MiB/rank: live tensor "
          f"bytes (bench/memtrack.py), max over ranks; RSS hwm: whole-process high-water mark, setup included;\n"
          f"setup s: the method's setup on the ranks (autopar: trace, plan on rank 0, shard), not in step ms; "
          f"load: 1-min load average before/after the launch (the machine is shared: compare with care).")
    by = {r["method"]: r for r in runtime if r.get("ok")}
    pair_rows = []
    for a, b in PAIRS:
        if a in by and b in by:
            ra, rb = by[a], by[b]
            pair_rows.append([f"{a} vs {b}", _f(ra["tokens_per_s"], ".0f"), _f(rb["tokens_per_s"], ".0f"),
                              _f(ra["tokens_per_s"] / rb["tokens_per_s"], ".2f") + "x",
                              _f(max(ra["peak_bytes_per_rank"]) / max(rb["peak_bytes_per_rank"]), ".2f") + "x"])
    if pair_rows:
        print()
        print(table(["comparison", "autopar tok/s", "baseline tok/s", "throughput ratio", "peak memory ratio"],
                    pair_rows, title="1b. autopar / baseline (throughput > 1x: autopar faster; memory < 1x: "
                                     "autopar smaller)"))


def print_fidelity(fid: dict) -> None:
    rows = []
    for p in fid["plans"]:
        for i, c in enumerate(p["collectives"]):
            spread = "" if c["measured_min"] == c["measured_max"] else \
                f" (ranks/steps {c['measured_min']:,.0f}..{c['measured_max']:,.0f})"
            rows.append([p["plan"] if i == 0 else "", p["mesh"] if i == 0 else "", c["collective"],
                         f"{c['predicted_bytes']:,.0f}", f"{c['measured_bytes_rank0']:,.0f}" + spread,
                         "equal" if c["equal"] else "MISMATCH"])
    print()
    print(table(["plan", "mesh", "collective", "predicted bytes/rank/step", "measured (rank 0)", "check"], rows,
                title="2. Fidelity: bytes sent per rank per step (forward+backward), plan vs count_bytes() on "
                      "every rank and timed step"))
    rows = [[p["plan"], p["mesh"], _f(p["predicted_peak_bytes"] / MIB), _f(p["measured_peak_bytes"] / MIB),
             _f(p["retained_untrained_param_bytes"] / MIB), _f(p["peak_ratio"], ".2f"), _f(p["predicted_step_s"] * 1e3, ".0f"), _f(p["measured_step_s"] * 1e3, ".0f"),
             _f(p["step_ratio"], ".2f")] for p in fid["plans"]]
    print()
    print(table(["plan", "mesh", "pred peak MiB", "meas peak MiB", "of which untrained copy",
                 "meas/pred", "pred step ms", "meas step ms",
                 "meas/pred"], rows, title="2b. Fidelity: peak memory per rank and step time"))
    print(f"Spearman rank correlation of predicted vs measured step time over {fid['n_plans']} plans: "
          f"{_f(fid['spearman_step_time'], '.2f')}")


def print_scaling(rows: list[dict]) -> None:
    out = []
    for r in rows:
        head = [r["sweep"], r["n_layer"], r["devices"], _f(r.get("plan_wall_s"))]
        if r.get("error"):
            out.append(head + ["FAILED", "", "", "(see below)", ""])
        else:
            out.append(head + [f"{r['ilp_variables']:,}", f"{r['ilp_constraints']:,}", r["ilps_solved"], r["mesh"],
                               _f(r["predicted_step_ms"], ".1f")])
    print()
    print(table(["sweep", "layers", "devices", "plan s", "ILP vars", "ILP constraints", "ILPs", "mesh",
                 "pred step ms"], out,
                title="3. Planner scaling: GPT-2 width (d=768, batch 8x1024) on the meta device, a100-80gb "
                      "profile; plan s: one whole autopar.plan (trace, mesh search, baselines); ILP size: the "
                      "chosen mesh's ILP"))
    shown = set()
    for r in rows:
        if r.get("error") and (r["n_layer"], r["devices"]) not in shown:
            shown.add((r["n_layer"], r["devices"]))
            print(f"  {r['n_layer']} layers on {r['devices']} devices FAILED: {r['error'][:400]}")
