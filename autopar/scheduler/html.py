"""A self-contained HTML page (inline SVG, no scripts) of each policy's GPU allocation over time."""

from __future__ import annotations

import html
from typing import Sequence

from .report import SeedRun

__all__ = ["write_html"]

_W, _H, _PAD = 760, 180, 40
_COLORS = {"fifo": "#888888", "tiresias": "#1f77b4", "optimus": "#2ca02c", "ones": "#d62728"}


def _chart(name: str, timeline, total_gpus: int, t_end: float) -> str:
    if not timeline:
        return ""
    sx = (_W - 2 * _PAD) / max(t_end, 1.0)
    sy = (_H - 2 * _PAD) / max(total_gpus, 1)
    t0 = timeline[0][0]
    pts, wait = [], []
    for k, (t, used, _running, waiting) in enumerate(timeline):
        x = _PAD + (t - t0) * sx
        x_next = _PAD + ((timeline[k + 1][0] if k + 1 < len(timeline) else t0 + t_end) - t0) * sx
        y = _H - _PAD - used * sy
        pts += [f"{x:.1f},{y:.1f}", f"{x_next:.1f},{y:.1f}"]
        yw = _H - _PAD - min(waiting, total_gpus) * sy
        wait += [f"{x:.1f},{yw:.1f}", f"{x_next:.1f},{yw:.1f}"]
    color = _COLORS.get(name, "#9467bd")
    base = f"{_PAD},{_H - _PAD}"
    return (f'<svg width="{_W}" height="{_H}" xmlns="http://www.w3.org/2000/svg" role="img">'
            f'<text x="{_PAD}" y="16" font-size="13">{html.escape(name)}: GPUs allocated (area), jobs waiting '
            f'(line), over {t_end / 3600:.1f} h</text>'
            f'<polygon points="{base} {" ".join(pts)} {_PAD + t_end * sx:.1f},{_H - _PAD}" fill="{color}" '
            f'fill-opacity="0.45" stroke="{color}"/>'
            f'<polyline points="{" ".join(wait)}" fill="none" stroke="black" stroke-width="0.8"/>'
            f'<line x1="{_PAD}" y1="{_H - _PAD}" x2="{_W - _PAD}" y2="{_H - _PAD}" stroke="black"/>'
            f'<line x1="{_PAD}" y1="{_PAD}" x2="{_PAD}" y2="{_H - _PAD}" stroke="black"/>'
            f'<text x="4" y="{_PAD + 4}" font-size="11">{total_gpus}</text>'
            f'<text x="4" y="{_H - _PAD}" font-size="11">0</text>'
            f'<text x="{_W - _PAD - 30}" y="{_H - _PAD + 16}" font-size="11">{t_end / 3600:.1f} h</text></svg>')


def write_html(runs: Sequence[SeedRun], total_gpus: int, path: str) -> None:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>autopar schedule</title></head>"
             "<body style='font-family:sans-serif'><h1>autopar schedule</h1>"]
    for run in runs:
        t_end = max(r.makespan_s for r in run.results.values())
        parts.append(f"<h2>seed {run.seed}: {len(run.jobs)} jobs on {total_gpus} GPUs</h2><table border=1 "
                     "cellpadding=4><tr><th>policy</th><th>avg JCT h</th><th>p50 h</th><th>p99 h</th>"
                     "<th>makespan h</th><th>utilization</th></tr>")
        for name, r in run.results.items():
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{r.avg_jct / 3600:.2f}</td><td>{r.p50_jct / 3600:.2f}"
                         f"</td><td>{r.p99_jct / 3600:.2f}</td><td>{r.makespan_s / 3600:.2f}</td>"
                         f"<td>{r.utilization:.2f}</td></tr>")
        parts.append("</table>")
        for name, r in run.results.items():
            parts.append("<div>" + _chart(name, r.timeline, total_gpus, t_end) + "</div>")
    parts.append("</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts))
