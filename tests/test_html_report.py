"""The HTML report is one well-formed, self-contained page that shows the plan's numbers
and draws its plots as inline SVG (checked without a browser)."""

import dataclasses
import re
from html.parser import HTMLParser

import pytest

from autopar.cli import main
from autopar.html_report import render_html
from autopar.models import get_model
from autopar.plan import Plan
from autopar.planner import plan
from autopar.report import block_rows, gib, ms

_VOID = {"meta", "br", "img", "input", "link", "hr", "col", "wbr", "source", "area", "base"}


class _Checker(HTMLParser):
    """Records tags, attributes and text; fails on an end tag that does not close the open one."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.tags, self.attrs, self.text, self.errors = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def _parse(page: str) -> _Checker:
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    return checker


@pytest.fixture(scope="module")
def tiny_plan() -> Plan:
    # batch 256: big enough that the plan shards over two mesh axes and communicates
    model, inputs = get_model("gpt-tiny", batch_size=256, device="meta")
    p = plan(model, 4, inputs, model_name="gpt-tiny")
    assert p.comm_seconds > 0 and len(p.mesh.axes) >= 1 and p.baselines
    return p


def test_page_is_well_formed_and_self_contained(tiny_plan):
    page = render_html(tiny_plan)
    checker = _parse(page)
    assert checker.tags[:1] == ["html"] and page.startswith("<!DOCTYPE html>")
    assert "script" not in checker.tags and "link" not in checker.tags and "img" not in checker.tags
    urls = [v for k, v in checker.attrs if k in ("src", "href", "xlink:href", "action") and v]
    assert urls == []
    assert not re.search(r"https?:|url\(|@import|//[a-z]", page, re.IGNORECASE)
    ids = {v for k, v in checker.attrs if k == "id"}
    assert {"time-chart", "memory-chart", "mesh-diagram", "mesh-table", "layout-table", "baseline-table"} <= ids
    assert checker.tags.count("svg") == 3


def test_page_shows_the_plans_numbers(tiny_plan):
    p = tiny_plan
    text = " ".join(_parse(render_html(p)).text)
    for figure in (ms(p.step_seconds), ms(p.compute_seconds), ms(p.comm_seconds),
                   gib(p.peak_memory_bytes_per_device), gib(p.param_state_bytes), gib(p.activation_bytes),
                   gib(p.memory_budget_bytes), f"{p.solver.n_variables:,}", f"{p.solver.n_constraints:,}",
                   f"{p.solver.gap * 100:.2f}%", p.solver.status, p.hardware, p.model):
        assert figure in text, figure
    for collective, nbytes in p.comm_bytes.items():
        assert f"{collective}" in text and f"{nbytes / 2**20:,.1f} MiB" in text
    for axis, link in zip(p.mesh.axes, p.mesh.links):
        assert axis in text and link.name in text
    for b in p.baselines:
        assert b.name in text and ms(b.step_seconds) in text and gib(b.peak_memory_bytes_per_device) in text
    for name, op, _ in block_rows(p):
        assert name in text and op in text


def test_charts_draw_the_plans_split_and_only_baseline_totals(tiny_plan):
    p = tiny_plan
    page = render_html(p)
    time_svg = page[page.index('<svg id="time-chart"'):]
    time_svg = time_svg[:time_svg.index("</svg>")]
    titles = re.findall(r"<title>([^<]*)</title>", time_svg)
    assert f"compute: {p.compute_seconds * 1e3:.4g} ms" in titles
    assert f"communication: {p.comm_seconds * 1e3:.4g} ms" in titles
    assert any(t.startswith("bubble") for t in titles)
    # Baselines carry totals only: one bar each, labelled as a total, never an invented split.
    assert sum(t.startswith("baseline total") for t in titles) == len(p.baselines)
    widths = {t.split(":")[0]: float(w) for w, t in
              re.findall(r'width="([0-9.]+)" height="\d+" fill="#[0-9a-f]+"[^>]*><title>([^<]*)</title>', time_svg)}
    assert widths["compute"] / widths["communication"] == pytest.approx(p.compute_seconds / p.comm_seconds, rel=0.02)


def test_text_is_escaped(tiny_plan):
    evil = '<script>alert("x")</script> & co'
    page = render_html(dataclasses.replace(tiny_plan, model=evil))
    assert evil not in page and "<script" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; co" in page
    _parse(page)


def test_plan_read_back_from_json_renders(tiny_plan, tmp_path):
    path = tmp_path / "plan.json"
    tiny_plan.to_json(str(path))
    page = render_html(Plan.from_json(str(path)))
    assert ms(tiny_plan.step_seconds) in page
    _parse(page)


def test_cli_plan_writes_html(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["plan", "mlp", "--gpus", "4", "--html", str(out), "--quiet", "--no-baselines"]) == 0
    assert f"HTML report written to {out}" in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    checker = _parse(page)
    assert "mlp" in " ".join(checker.text) and "Baselines were not priced" in page


@pytest.fixture(scope="module")
def pipelined_plan() -> Plan:
    """A tiny HF GPT-2 (embedding tied to the head) pinned to pp=2 x dp=2 on 4 devices."""
    from autopar.models.hf import hf_gpt2

    model, inputs = hf_gpt2(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, batch_size=8,
                            seq_len=16, device="meta")
    p = plan(model, 4, inputs, mesh="pp=2,dp=2", model_name="hf-gpt2-4l")
    assert p.pipeline is not None and len(p.stage_plans) == p.pipeline.n_stages * p.pipeline.virtual_stages
    return p


def test_pipelined_plan_shows_each_stages_figures(pipelined_plan):
    """Today's gaps closed: communication, bytes, bubble and solver figures of a pipelined plan
    come from its stage plans; the bubble's percentage is its share of the step."""
    from autopar.report import bubble_share, format_report, stage_rows

    p = pipelined_plan
    info = p.pipeline
    assert p.comm_seconds > 0 and sum(p.comm_bytes.values()) > 0 and p.solver.n_variables > 0
    assert info.tied and info.tied[0].bytes_per_rank > 0  # the tied head's all-reduce, priced
    rows = stage_rows(p)
    assert len(rows) == 2 and all(r["comm_seconds"] > 0 and sum(r["bytes"].values()) > 0 and r["variables"] > 0
                                  for r in rows)
    report = format_report(p)
    share = bubble_share(p)
    assert share == pytest.approx(info.bubble_seconds / p.step_seconds)
    assert f"bubble {ms(info.bubble_seconds)} = {share * 100:.1f}% of the step" in report
    assert "collectives none" not in report and f"communication {ms(p.comm_seconds)}" in report
    page = render_html(p)
    checker = _parse(page)
    text = " ".join(checker.text)
    assert "stage-table" in {v for k, v in checker.attrs if k == "id"}
    assert f"{ms(info.bubble_seconds)} ({share * 100:.1f}% of the step)" in text  # the summary card
    for r in rows:
        assert ms(r["comm_seconds"]) in text and f"{sum(r['bytes'].values()) / 2**20:,.2f} MiB" in text
        assert f"{r['variables']:,}" in text
    table = page[page.index("id='layout-table'"):]
    head = re.findall(r"<th>([^<]*)</th>", table[:table.index("</tr>")])
    assert head == ["node", "op", *p.mesh.axes[1:], "strategy"]  # the stage mesh's axes, not pp
    time_svg = page[page.index('<svg id="time-chart"'):]
    assert f"pipeline bubble: {info.bubble_seconds * 1e3:.4g} ms" in time_svg[:time_svg.index("</svg>")]


@pytest.mark.parametrize("mesh", ["dp=8,tp=8", "pp=4,dp=4,tp=8", "pp=8,dp=16,tp=8", "a=2,b=2,c=4,d=8"])
def test_mesh_drawing_fits_the_page(tiny_plan, mesh):
    from autopar.html_report import MESH_MAX_WIDTH
    from autopar.mesh import MeshSpec

    spec = MeshSpec.parse(mesh)
    p = dataclasses.replace(tiny_plan, mesh=spec, n_devices=spec.n_devices)
    svg = render_html(p)
    svg = svg[svg.index('<svg id="mesh-diagram"'):]
    width = int(re.match(r'<svg id="mesh-diagram" width="(\d+)"', svg).group(1))
    assert width <= MESH_MAX_WIDTH
    assert svg[:svg.index("</svg>")].count("<rect") == spec.n_devices + (spec.n_devices // (spec.sizes[-1] * spec.sizes[-2])
                                                                         if spec.ndim >= 3 else 0)
