"""A Plan as one self-contained HTML page: the terminal report's facts plus inline SVG plots.

The page has no scripts, no external fonts or stylesheets and no network references, so it
opens offline and can be mailed or attached to an issue. Plots are hand-written SVG:

- memory per device: the plan's parameters+gradients+optimizer state and activations, next
  to each baseline's peak (baselines report a total only, and are drawn as such);
- step time: the plan's compute, communication and pipeline bubble (0 without pipeline
  stages), next to each baseline's step time (again a total only);
- pipeline stages (a pipelined plan): per stage its blocks, time, communication, bytes sent,
  memory and its stage plan's solver figures;
- the mesh (devices drawn by axis, with each axis's link; cells shrink to keep the drawing
  within the page up to 4096 devices) and the per-block layout table of ``autopar.report``,
  with one coloured chip per axis of the mesh the layouts are for (the stage mesh of a pipeline).

Every piece of text goes through :func:`html.escape`.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass

from .plan import BaselineResult, Plan
from .report import block_rows, gib, ms, bubble_share, stage_rows

__all__ = ["render_html", "write_html"]

# Colour per category of the bar charts: (label, fill).
_PARAMS, _ACTS, _TOTAL = "params", "acts", "total"
_COMPUTE, _COMM, _BUBBLE = "compute", "comm", "bubble"
_COLOURS = {_PARAMS: "#4c78a8", _ACTS: "#f58518", _COMPUTE: "#54a24b", _COMM: "#e45756", _BUBBLE: "#b279a2",
            _TOTAL: "#9d9d9d"}

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 24px 32px;
       color: #1d1d1f; background: #fff; max-width: 1320px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd;
     padding-bottom: 4px; }
.sub { color: #555; margin-bottom: 16px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(280px, 1fr)); gap: 12px;
         align-items: start; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; }
.card h3 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: #666; margin: 0 0 6px; }
.big { font-size: 24px; font-weight: 600; }
table { border-collapse: collapse; font-size: 13px; }
td, th { padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; border-bottom: 1px solid #ddd; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; }
.plots { display: flex; flex-wrap: wrap; gap: 24px; }
.note { color: #666; font-size: 12px; max-width: 640px; }
.chip { display: inline-block; min-width: 34px; padding: 1px 4px; margin-right: 3px; border-radius: 3px;
        text-align: center; font-size: 12px; }
.layouts td { border-bottom: 1px solid #f0f0f0; vertical-align: middle; }
"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


# ------------------------------------------------------------------------------- charts


@dataclass(frozen=True)
class _Bar:
    label: str
    segments: tuple[tuple[str, float], ...]  # (category, value); a value of inf means "no value"
    text: str  # printed right of the bar
    dim: bool = False  # greyed: e.g. a baseline that does not fit


def _nice_step(span: float, n_ticks: int = 5) -> float:
    raw = span / n_ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _bar_chart(chart_id: str, title: str, bars: list[_Bar], unit: float, unit_name: str,
               legend: list[tuple[str, str]], marker: tuple[float, str] | None = None) -> str:
    """Horizontal stacked bars as an SVG string. Values are divided by ``unit`` for the axis."""
    # Text widths are estimated (no layout engine here): ~7 px per character at 12 px, bold ~8.
    label_w = 20 + max(int(8.0 * len(b.label)) for b in bars)
    bar_area, text_w, row_h = 280, 120, 30
    names = dict(legend)
    width = label_w + bar_area + text_w
    finite = [sum(v for _, v in b.segments) for b in bars if all(math.isfinite(v) for _, v in b.segments)]
    vmax = max([v / unit for v in finite] + ([marker[0] / unit] if marker else []) + [1e-12])
    step = _nice_step(vmax)
    axis_max = step * math.ceil(vmax / step - 1e-9)
    scale = bar_area / axis_max
    out = [f'<text x="0" y="16" font-size="14" font-weight="600">{_e(title)}</text>']
    x, y_legend = 0.0, 28
    for key, label in legend:  # legend, wrapped to the chart's width
        item_w = 28 + 7.0 * len(label)
        if x > 0 and x + item_w > width:
            x, y_legend = 0.0, y_legend + 18
        out.append(f'<rect x="{x:.0f}" y="{y_legend}" width="12" height="12" fill="{_COLOURS[key]}"/>'
                   f'<text x="{x + 16:.0f}" y="{y_legend + 10}">{_e(label)}</text>')
        x += item_w
    top = y_legend + (40 if marker is not None else 28)  # room for the marker's label
    y_axis = top + row_h * len(bars)
    t = 0.0
    while t <= axis_max + 1e-9:  # grid lines and tick labels
        gx = label_w + t * scale
        out.append(f'<line x1="{gx:.1f}" y1="{top - 4}" x2="{gx:.1f}" y2="{y_axis}" stroke="#e6e6e6"/>'
                   f'<text x="{gx:.1f}" y="{y_axis + 14}" text-anchor="middle" fill="#555">{t:g}</text>')
        t += step
    out.append(f'<text x="{label_w + bar_area / 2:.0f}" y="{y_axis + 30}" text-anchor="middle" fill="#555">'
               f'{_e(unit_name)}</text>')
    for i, bar in enumerate(bars):
        y = top + i * row_h
        weight = ' font-weight="600"' if i == 0 else ""
        out.append(f'<text x="{label_w - 8}" y="{y + 19}" text-anchor="end"{weight}>{_e(bar.label)}</text>')
        gx = float(label_w)
        if not all(math.isfinite(v) for _, v in bar.segments):
            out.append(f'<text x="{gx + 4:.0f}" y="{y + 19}" fill="#555">{_e(bar.text)}</text>')
            continue
        for key, value in bar.segments:
            w = value / unit * scale
            opacity = ' fill-opacity="0.45"' if bar.dim else ""
            out.append(f'<rect x="{gx:.1f}" y="{y + 6}" width="{max(w, 0):.1f}" height="{row_h - 12}" '
                       f'fill="{_COLOURS[key]}"{opacity}><title>{_e(names.get(key, key))}: '
                       f'{value / unit:.4g} {_e(unit_name)}</title></rect>')
            gx += w
        out.append(f'<text x="{gx + 6:.1f}" y="{y + 19}" fill="#333">{_e(bar.text)}</text>')
    if marker is not None:
        mx = label_w + marker[0] / unit * scale
        out.append(f'<line x1="{mx:.1f}" y1="{top - 6}" x2="{mx:.1f}" y2="{y_axis}" stroke="#333" '
                   f'stroke-dasharray="4 3"/><text x="{mx:.1f}" y="{top - 9}" text-anchor="middle" fill="#333">'
                   f'{_e(marker[1])}</text>')
    height = y_axis + 40
    head = (f'<svg id="{_e(chart_id)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="{_e(title)}" font-size="12" font-family="system-ui, sans-serif">')
    return head + "".join(out) + "</svg>"


def _baseline_label(b: BaselineResult) -> str:
    return f"{b.name} ({b.mesh})" if b.mesh else b.name


def _memory_chart(plan: Plan) -> str:
    bars = [_Bar(f"autopar ({plan.mesh})", ((_PARAMS, plan.param_state_bytes), (_ACTS, plan.activation_bytes)),
                 gib(plan.peak_memory_bytes_per_device))]
    for b in plan.baselines:
        fits = "" if b.feasible else " (does not fit)"
        text = gib(b.peak_memory_bytes_per_device) + fits if math.isfinite(b.peak_memory_bytes_per_device) \
            else "no plan"
        bars.append(_Bar(_baseline_label(b), ((_TOTAL, b.peak_memory_bytes_per_device),), text, not b.feasible))
    peak = max([plan.peak_memory_bytes_per_device] + [b.peak_memory_bytes_per_device for b in plan.baselines
                                                      if math.isfinite(b.peak_memory_bytes_per_device)])
    # The budget line only when it is on the same scale as the bars (else it squashes them).
    marker = (plan.memory_budget_bytes, "budget") if plan.memory_budget_bytes <= 2 * peak else None
    legend = [(_PARAMS, "params+grads+optimizer"), (_ACTS, "activations")]
    if plan.baselines:
        legend.append((_TOTAL, "baseline total (split not reported)"))
    unit, unit_name = (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")
    return _bar_chart("memory-chart", "Peak memory per device", bars, unit, unit_name, legend, marker)


def _time_chart(plan: Plan) -> str:
    bubble = plan.pipeline.bubble_seconds if plan.pipeline is not None else 0.0
    bars = [_Bar(f"autopar ({plan.mesh})", ((_COMPUTE, plan.compute_seconds), (_COMM, plan.comm_seconds),
                                            (_BUBBLE, bubble)), ms(plan.step_seconds))]
    for b in plan.baselines:
        fits = "" if b.feasible else " (does not fit)"
        text = ms(b.step_seconds) + fits if math.isfinite(b.step_seconds) else "no plan"
        bars.append(_Bar(_baseline_label(b), ((_TOTAL, b.step_seconds),), text, not b.feasible))
    legend = [(_COMPUTE, "compute"), (_COMM, "communication"),
              (_BUBBLE, "pipeline bubble" if plan.pipeline is not None else "bubble (0: no pipeline)")]
    if plan.baselines:
        legend.append((_TOTAL, "baseline total"))
    return _bar_chart("time-chart", "Predicted step time", bars, 1e-3, "ms", legend)


# --------------------------------------------------------------------------------- mesh


MESH_MAX_WIDTH = 880  # px: the drawing shares a row of the 1320 px page (_CSS max-width) with the axis table


def _mesh_svg(plan: Plan) -> str:
    """Devices drawn by mesh coordinate: last axis across, the one before down, the first as boxes
    (boxes wrap into rows; axes before the first are folded into it). Cells shrink (down to 6 px,
    device ids drawn only while they fit) so the drawing stays within ``MESH_MAX_WIDTH``; meshes
    over 4096 devices get the axis table alone."""
    sizes, axes = plan.mesh.sizes, plan.mesh.axes
    if not sizes or math.prod(sizes) > 4096:
        return ""
    cols = sizes[-1]
    rows = sizes[-2] if len(sizes) >= 2 else 1
    groups = math.prod(sizes[:-2]) if len(sizes) >= 3 else 1
    box_axis = axes[0] if len(sizes) == 3 else "x".join(axes[:-2])
    cell, gap, pad = 34, 6, 16
    while cell > 6:  # shrink until one box fits the width, and the boxes fit in a few rows
        gap, pad = max(1, cell // 6), max(4, cell // 2)
        group_w = cols * (cell + gap) - gap + 2 * pad
        per_row = max(1, (MESH_MAX_WIDTH + 14) // (group_w + 14))
        if group_w <= MESH_MAX_WIDTH and math.ceil(groups / per_row) * rows * (cell + gap) <= 1200:
            break
        cell -= 2
    gap, pad = max(1, cell // 6), max(4, cell // 2)
    group_w = cols * (cell + gap) - gap + 2 * pad
    group_h = rows * (cell + gap) - gap + 2 * pad + 16
    per_row = max(1, min(groups, (MESH_MAX_WIDTH + 14) // (group_w + 14)))
    box_rows = math.ceil(groups / per_row)
    width = per_row * (group_w + 14) if groups > 1 else group_w
    height = box_rows * (group_h + 8) if groups > 1 else 18 + rows * (cell + gap)
    labels = cell >= 18
    out = [f'<svg id="mesh-diagram" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-size="{11 if labels else 9}" font-family="system-ui, sans-serif" '
           f'role="img" aria-label="device mesh">']
    for g in range(groups):
        gx, gy = (g % per_row) * (group_w + 14), (g // per_row) * (group_h + 8)
        if groups > 1:
            out.append(f'<rect x="{gx + 0.5}" y="{gy + 0.5}" width="{group_w - 1}" height="{group_h - 1}" rx="6" '
                       f'fill="#fafafa" stroke="#bbb"/><text x="{gx + 8}" y="{gy + 13}" fill="#555">'
                       f'{_e(box_axis)}={g}</text>')
        for r in range(rows):
            for c in range(cols):
                device = (g * rows + r) * cols + c
                x, y = gx + pad + c * (cell + gap), gy + 18 + r * (cell + gap)
                out.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" rx="{min(4, cell // 4)}" '
                           f'fill="#dbe7f3" stroke="#4c78a8"><title>device {device}</title></rect>')
                if labels:
                    out.append(f'<text x="{x + cell / 2}" y="{y + cell / 2 + 4}" text-anchor="middle">{device}</text>')
    out.append("</svg>")
    across = f"across: {axes[-1]}"
    down = f", down: {axes[-2]}" if len(sizes) >= 2 else ""
    boxes = f", boxes: {'x'.join(axes[:-2])}" if len(sizes) >= 3 else ""
    return "".join(out) + f"<p class='note'>{_e(across + down + boxes)}; device ids are row-major</p>"


def _mesh_section(plan: Plan) -> str:
    mesh = plan.mesh
    rows = "".join(
        f"<tr><td class='mono'>{_e(a)}</td><td class='num'>{s}</td><td>{_e(l.name)}</td>"
        f"<td class='num'>{l.bandwidth_bytes_per_s / 1e9:,.3g} GB/s</td>"
        f"<td class='num'>{l.latency_s * 1e6:,.3g} us</td></tr>" for a, s, l in zip(mesh.axes, mesh.sizes, mesh.links))
    table = ("<table id='mesh-table'><tr><th>axis</th><th class='num'>size</th><th>link</th>"
             f"<th class='num'>bandwidth</th><th class='num'>latency</th></tr>{rows}</table>")
    return f"<div class='plots'><div>{table}</div><div>{_mesh_svg(plan)}</div></div>"


# ------------------------------------------------------------------------------ layouts

_PLACEMENT_RE = re.compile(r"S\(\d+\)|P\([a-z_]+\)|P|R")
_SHARD_COLOURS = ("#4c78a8", "#72b7b2", "#54a24b", "#b279a2", "#9d755d")


def _chips(layout: str, n_axes: int) -> str:
    """One coloured chip per mesh axis for a layout string like ``S(0)RP``; plain text if it does not parse."""
    tokens = _PLACEMENT_RE.findall(layout)
    if len(tokens) != n_axes or "".join(tokens) != layout.strip():
        return f"<span class='mono'>{_e(layout)}</span>"
    cells = []
    for tok in tokens:
        if tok.startswith("S"):
            dim = int(tok[2:-1])
            style = f"background:{_SHARD_COLOURS[dim % len(_SHARD_COLOURS)]};color:#fff"
        elif tok.startswith("P"):
            style = "background:#f58518;color:#fff"
        else:
            style = "background:#eee;color:#333"
        cells.append(f"<td><span class='chip mono' style='{style}'>{_e(tok)}</span></td>")
    return "".join(cells)


def _layouts_section(plan: Plan, max_rows: int = 80) -> str:
    axes = plan.mesh.axes[1:] if plan.pipeline is not None else plan.mesh.axes  # a pipeline's: the stage mesh
    n_axes = len(axes)
    head = "".join(f"<th>{_e(a)}</th>" for a in axes)
    body = []
    rows = block_rows(plan)
    for name, op, strategy in rows[:max_rows]:
        if op == "param":
            layout, _, zero = strategy.partition(" +")
            note = zero
        else:
            layout = strategy.split("->")[-1].split(",")[0].strip()
            note = strategy
        chips = _chips(layout, n_axes)
        if not chips.startswith("<td>"):
            chips = f"<td colspan='{n_axes}'>{chips}</td>"
        body.append(f"<tr><td class='mono'>{_e(name)}</td><td>{_e(op)}</td>{chips}"
                    f"<td class='mono'>{_e(note)}</td></tr>")
    more = (f"<p class='note'>... {len(rows) - max_rows} more rows (<code>--json</code> has every node)</p>"
            if len(rows) > max_rows else "")
    return (f"<p class='note'>One row per op of each repeated block (as in the terminal report). The coloured "
            f"cells are the output's placement on each mesh axis: <b>S(d)</b> shards tensor dim d over the axis, "
            f"<b>R</b> replicates, <b>P</b> holds partial sums. The last column gives the whole strategy "
            f"(inputs -&gt; output) or, for parameters, their ZeRO sharding.</p>"
            f"<table class='layouts' id='layout-table'><tr><th>node</th><th>op</th>{head}"
            f"<th>strategy</th></tr>{''.join(body)}</table>{more}")


# -------------------------------------------------------------------------------- facts


def _card(title: str, big: str, rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td class='num'>{_e(v)}</td></tr>" for k, v in rows)
    return (f"<div class='card'><h3>{_e(title)}</h3><div class='big'>{_e(big)}</div>"
            f"<table>{body}</table></div>")


def _facts(plan: Plan) -> str:
    s = plan.solver
    gap = "n/a" if s.gap != s.gap else f"{s.gap * 100:.2f}%"
    comm = sorted(plan.comm_bytes.items())
    cards = [
        _card("predicted step time", ms(plan.step_seconds),
              [("compute", ms(plan.compute_seconds)), ("communication", ms(plan.comm_seconds)),
               ("pipeline bubble", ms(plan.pipeline.bubble_seconds if plan.pipeline else 0.0)
                + (f" ({bubble_share(plan) * 100:.1f}% of the step)" if plan.pipeline else ""))]),
        _card("peak memory / device", gib(plan.peak_memory_bytes_per_device),
              [("params+grads+optimizer", gib(plan.param_state_bytes)), ("activations", gib(plan.activation_bytes)),
               ("budget", gib(plan.memory_budget_bytes))]),
        _card("bytes sent / device", f"{sum(plan.comm_bytes.values()) / 2**20:,.1f} MiB",
              [(k, f"{v / 2**20:,.1f} MiB") for k, v in comm] or [("collectives", "none")]),
        _card("solver", f"{s.name} {s.status}",
              [("solve time", f"{s.seconds:.2f} s"), ("variables", f"{s.n_variables:,}"),
               ("constraints", f"{s.n_constraints:,}"), ("objective", ms(s.objective)),
               ("lower bound", ms(s.lower_bound)), ("gap", gap), ("ILPs solved", str(s.ilps_solved)),
               ("whole plan", f"{s.plan_seconds:.1f} s")]),
    ]
    search = f"<p class='note'>mesh search: {_e(s.mesh_search)}</p>" if s.mesh_search else ""
    return f"<div class='cards'>{''.join(cards)}</div>{search}{_stages_table(plan)}"


def _stages_table(plan: Plan) -> str:
    """A pipelined plan's stages: what each runs, and its stage plan's figures."""
    rows = stage_rows(plan)
    if not rows:
        return ""
    info = plan.pipeline
    body = "".join(
        f"<tr><td class='num'>{r['index']}</td><td>{_e(r['blocks'])}</td><td>{_e(r['extras'] or '-')}</td>"
        f"<td class='num'>{_e(ms(r['seconds']))}</td><td class='num'>{_e(ms(r['comm_seconds']))}</td>"
        f"<td class='num'>{sum(r['bytes'].values()) / 2**20:,.2f} MiB</td>"
        f"<td class='mono'>{_e(', '.join(f'{k} {v / 2**20:,.2f}' for k, v in sorted(r['bytes'].items())) or '-')}</td>"
        f"<td class='num'>{_e(gib(r['memory']))}</td><td class='num'>{r['variables']:,}</td>"
        f"<td class='num'>{r['constraints']:,}</td><td>{_e(r['status'])}</td><td class='mono'>{_e(r['tied'] or '-')}</td>"
        f"</tr>" for r in rows)
    return (f"<h2>Pipeline stages</h2><p class='note'>{info.n_stages} stages on mesh {_e(info.stage_mesh)}, schedule "
            f"{_e(info.schedule)}, {info.n_microbatches} micro-batches; bubble {_e(ms(info.bubble_seconds))} = "
            f"{bubble_share(plan) * 100:.1f}% of the step. Communication and bytes are per step per device "
            f"(its stage plans' collectives, sends between stages, tied-weight all-reduces).</p>"
            f"<table id='stage-table'><tr><th class='num'>stage</th><th>blocks</th><th>also</th>"
            f"<th class='num'>time / micro-batch</th><th class='num'>comm / step</th><th class='num'>sent / step</th>"
            f"<th>by kind (MiB)</th><th class='num'>peak memory</th><th class='num'>ILP variables</th>"
            f"<th class='num'>constraints</th><th>status</th><th>tied weights</th></tr>{body}</table>")


def _baseline_table(plan: Plan) -> str:
    if not plan.baselines:
        return "<p class='note'>Baselines were not priced (--no-baselines).</p>"
    rows = [f"<tr><td><b>autopar</b></td><td class='mono'>{_e(plan.mesh)}</td>"
            f"<td class='num'>{_e(ms(plan.step_seconds))}</td>"
            f"<td class='num'>{_e(gib(plan.peak_memory_bytes_per_device))}</td><td>1.00x</td></tr>"]
    for b in plan.baselines:
        if math.isfinite(b.step_seconds):
            vs = f"{b.step_seconds / plan.step_seconds:.2f}x" + ("" if b.feasible else " (does not fit)")
        else:
            vs = "no plan"
        rows.append(f"<tr><td>{_e(b.name)}</td><td class='mono'>{_e(b.mesh)}</td><td class='num'>"
                    f"{_e(ms(b.step_seconds))}</td><td class='num'>{_e(gib(b.peak_memory_bytes_per_device))}</td>"
                    f"<td>{_e(vs)}</td></tr>")
    return ("<table id='baseline-table'><tr><th>method</th><th>mesh</th><th class='num'>step</th>"
            f"<th class='num'>peak memory</th><th>step vs autopar</th></tr>{''.join(rows)}</table>")


# --------------------------------------------------------------------------------- page


def render_html(plan: Plan) -> str:
    """The whole report page as a string (UTF-8, no external references)."""
    precision = "bf16 mixed precision" if plan.mixed_precision else "fp32"
    title = f"autopar plan: {plan.model} on {plan.n_devices} x {plan.hardware}"
    mesh = ", ".join(f"{a}={s} over {l.name}" for a, s, l in zip(plan.mesh.axes, plan.mesh.sizes, plan.mesh.links))
    baseline_note = ("<p class='note'>Baselines report only their totals (step time and peak memory), so their "
                     "bars are single grey segments; a pale bar does not fit the memory budget.</p>"
                     if plan.baselines else "")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_CSS}</style></head>
<body>
<h1>{_e(title)}</h1>
<div class="sub">{_e(plan.optimizer)}, {_e(precision)}, strategy={_e(plan.strategy)}; mesh {_e(mesh)}</div>
<h2>Prediction</h2>
{_facts(plan)}
<h2>Plan vs baselines</h2>
<div class="plots"><div>{_time_chart(plan)}</div><div>{_memory_chart(plan)}</div></div>
{baseline_note}
{_baseline_table(plan)}
<h2>Mesh</h2>
{_mesh_section(plan)}
<h2>Layouts</h2>
{_layouts_section(plan)}
</body></html>
"""


def write_html(plan: Plan, path: str) -> None:
    """Write :func:`render_html` of ``plan`` to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(plan))
