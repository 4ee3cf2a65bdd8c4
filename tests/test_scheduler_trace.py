"""Trace workloads on the committed throughput table, and the `autopar schedule` command."""

from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.scheduler import JobModel, load_table, load_trace, make_policy, sample_workload, simulate
from autopar.scheduler.throughput import ThroughputError
from autopar.scheduler.workload import WorkloadError


@pytest.fixture(scope="module")
def model():
    return JobModel(load_table())


@pytest.fixture(scope="module")
def trace():
    return load_trace()


def test_committed_table_comes_from_the_planner(model):
    t = model.table
    assert t.hardware == "a100-80gb" and t.n_plans >= 100
    gpt2 = t.model("gpt2")
    assert gpt2.params > 100e6
    # more GPUs at the same per-GPU batch never take longer per sample inside a node
    assert gpt2.samples_per_second(8, 64) > gpt2.samples_per_second(1, 8)
    # crossing nodes costs: the same job on 8 GPUs spread over nodes is slower
    assert gpt2.step_seconds(8, 64, spans_nodes=True) > gpt2.step_seconds(8, 64)
    with pytest.raises(ThroughputError, match="not in the throughput table"):
        t.model("gpt5")


def test_workload_is_deterministic_and_runs_for_its_trace_duration(model, trace):
    a = sample_workload(trace, 40, 64, model, seed=3)
    b = sample_workload(trace, 40, 64, model, seed=3)
    assert a == b and a != sample_workload(trace, 40, 64, model, seed=4)
    assert a[0].arrival_s == 0 and max(j.arrival_s for j in a) <= 8 * 3600
    for j in a:
        alone_s = j.work / model.goodput(j, j.requested_gpus, j.base_batch)
        assert alone_s == pytest.approx(j.trace_duration_s)
        assert 60 <= j.trace_duration_s <= 86400 and j.requested_gpus <= 64
    with pytest.raises(WorkloadError, match="holds 100000 usable jobs"):
        sample_workload(trace, 100000, 64, model, seed=0)


def test_ones_beats_tiresias_and_optimus_on_a_trace_workload(model, trace):
    jobs = sample_workload(trace, 30, 16, model, seed=1)
    avg = {p: simulate(jobs, make_policy(p, 1), model, 16).avg_jct for p in ("tiresias", "optimus", "ones")}
    assert avg["ones"] < avg["tiresias"] and avg["ones"] < avg["optimus"], avg


def test_schedule_command_prints_the_table_and_writes_json_and_html(tmp_path, capsys):
    out, page = tmp_path / "s.json", tmp_path / "s.html"
    assert main(["schedule", "--gpus", "16", "--jobs", "20", "--seed", "0-1", "--quiet", "--json", str(out),
                 "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert "avg JCT h" in text and "ONES avg JCT vs tiresias" in text
    data = json.loads(out.read_text())
    assert set(data["policies"]) == {"fifo", "tiresias", "optimus", "ones", "pollux"}
    for r in data["policies"].values():
        assert set(r) == {"avg_jct", "p50_jct", "p99_jct", "makespan", "utilization"}
        assert 0 < r["utilization"] <= 1 and r["p50_jct"] <= r["p99_jct"]
    assert page.read_text().count("<svg") == 10  # one chart per policy and seed
    assert main(["schedule", "--policy", "onez", "--jobs", "5"]) == 2
    assert "unknown policy 'onez'" in capsys.readouterr().err
    assert main(["schedule", "--gpus", "60"]) == 2
    assert "not whole nodes of 8" in capsys.readouterr().err
    assert main(["schedule", "--jobs", "0"]) == 2
    assert "at least one job" in capsys.readouterr().err
    assert main(["schedule", "--seed", "x"]) == 2
    assert "cannot read --seed 'x'" in capsys.readouterr().err
