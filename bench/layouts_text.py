"""Text of `bench/layouts.py`: one planned entry (`Entry`), its table cells, and the closing
explanation that compares the layouts' communication at 64 devices."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30


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
    split_weights: str = ""  # weight matrices (2+ dims) stored split on some axis / all of them
    loss_comm_s: float = math.nan  # communication on the edges into the loss (logits resharded)
    loss_sent_bytes: float = math.nan
    plan_s: float = 0.0
    others: list = field(default_factory=list)  # 1D: the other family's figures


def top_collective(e: Entry) -> str:
    if not e.comm_bytes:
        return "-"
    k, v = max(e.comm_bytes.items(), key=lambda kv: kv[1])
    return f"{k} {v / GIB:.2f}"


def cell_time(e: Entry) -> str:
    return f"{e.step_s * 1e3:.1f}" if e.status == "ok" else e.status


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None or not math.isfinite(r) else f"{r:.2f}x"


def ratio(num: Entry | None, den: Entry | None) -> float | None:
    if num is None or den is None or num.status != "ok" or den.status != "ok":
        return None
    return num.step_s / den.step_s


def table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(headers), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


def entry_cells(e: Entry, label: str, base: Entry) -> list[str]:
    ok = e.status == "ok"
    ms = lambda s: f"{s * 1e3:.1f}" if ok and math.isfinite(s) else ""
    return [str(e.width), str(e.devices), label, e.mesh or "-", e.kind if ok else "", e.split_weights, cell_time(e),
            ms(e.compute_s), ms(e.comm_s), ms(e.loss_comm_s),
            f"{e.peak_bytes / GIB:.1f}" if ok else "", f"{e.sent_bytes / GIB:.2f}" if ok else "",
            top_collective(e) if ok else "",
            ("1.00x" if ok else "-") if e is base else fmt_ratio(ratio(base, e)),
            f"{e.plan_s:.1f}" if e.status != "skipped" else "-", "" if ok else e.reason]


def comm_words(e: Entry) -> str:
    share = e.comm_s / e.step_s if e.step_s > 0 else math.nan
    loss = (f", {e.loss_comm_s / e.comm_s:.0%} of it moving logits into the loss"
            if math.isfinite(e.loss_comm_s) and e.comm_s > 0 and e.loss_comm_s >= 0.05 * e.comm_s else "")
    return (f"{e.compute_s * 1e3:.0f} ms compute + {e.comm_s * 1e3:.0f} ms communication ({share:.0%}{loss}), "
            f"{e.sent_bytes / GIB:.1f} GiB sent, {e.peak_bytes / GIB:.1f} GiB peak")


def explain(at64: dict[int, dict[str, Entry]], paper_runs: dict[int, dict[str, Entry]], per_node: int) -> list[str]:
    """Sentences from the 64-device figures: which term dominates, what the bytes do, memory."""
    out = []
    for d, row in at64.items():
        ok = {k: e for k, e in row.items() if e.status == "ok"}
        one = ok.get("1D")
        if one is None:
            out.append(f"d={d}: 1D has no figure on 64 devices ({row['1D'].status}: {row['1D'].reason}).")
        else:
            out.append(f"d={d}, best meshes: 1D ({one.family}, {one.mesh}) {comm_words(one)}.")
            for k in ("2D", "2.5D", "3D"):
                e = ok.get(k)
                if e is None:
                    out.append(f"d={d}: {k} has no figure: {row[k].status}"
                               + (f" ({row[k].reason})." if row[k].reason else "."))
                    continue
                dc, dm = e.compute_s - one.compute_s, e.comm_s - one.comm_s
                main = "communication" if abs(dm) >= abs(dc) else "compute"
                out.append(f"d={d}: {k} on {e.mesh} is {one.step_s / e.step_s:.2f}x 1D's speed, the difference "
                           f"mostly {main} ({dc * 1e3:+.0f} ms compute, {dm * 1e3:+.0f} ms communication): "
                           f"{comm_words(e)}; {e.sent_bytes / one.sent_bytes:.2f}x 1D's bytes, "
                           f"{e.peak_bytes / one.peak_bytes:.2f}x its peak memory.")
        a, fixed = ok.get("auto"), [e for k, e in ok.items() if k != "auto"]
        if a is not None and fixed:
            b = min(fixed, key=lambda e: e.step_s)
            rel = b.step_s / a.step_s
            out.append(f"d={d}: auto chooses {a.kind or '?'} on {a.mesh} ({a.split_weights} weight matrices stored "
                       f"split; {a.step_s * 1e3:.1f} ms), {rel:.2f}x the "
                       f"fastest pinned layout ({b.layout}, {b.step_s * 1e3:.1f} ms)"
                       + ("; that pinned layout is outside auto's search space (auto keeps the outer axis of a "
                          "3-axis mesh a data axis)" if rel < 1 - 1e-6 else "") + ".")
        pr = paper_runs.get(d, {})
        tp64, node = pr.get("1D tp=64"), pr.get("1D dp=8,tp=8")
        grids = [e for k, e in pr.items() if not k.startswith("1D") and e.status == "ok"]
        if tp64 is not None and tp64.status == "ok" and grids:
            out.append(f"d={d}, papers' grids: 1D over all 64 devices spends {tp64.comm_s / tp64.step_s:.0%} of its "
                       f"step communicating ({tp64.sent_bytes / GIB:.1f} GiB sent"
                       + (f", its rings spanning {64 // per_node} nodes of {per_node}" if per_node < 64 else "") + "), "
                       "so the grids beat it by " + ", ".join(f"{e.layout} {tp64.step_s / e.step_s:.2f}x"
                                                                for e in grids)
                       + (f"; against 1D inside a node x DP ({node.step_s * 1e3:.1f} ms) the same grids are at "
                          + ", ".join(f"{node.step_s / e.step_s:.2f}x" for e in grids)
                          if node is not None and node.status == "ok" else "") + ".")
        elif tp64 is not None and tp64.status != "ok":
            out.append(f"d={d}, papers' grids: 1D over all 64 devices {tp64.status} ({tp64.reason}): it keeps "
                       "every activation whole on every device, so the papers' baseline has no figure at this batch.")
    return out

