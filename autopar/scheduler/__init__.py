"""An adaptive cluster scheduler driven by the planner (ONES, Tiresias, Optimus, FIFO).

    table = load_table()                          # step times planned by autopar.plan, per (model, GPUs, batch)
    model = JobModel(table)                       # goodput = throughput x statistical efficiency; migration cost
    jobs = sample_workload(load_trace(), 100, 64, model, seed=0)   # Philly trace jobs
    result = simulate(jobs, make_policy("ones", seed=0), model, 64)
    print(result.avg_jct, result.makespan_s, result.utilization)

Files: ``throughput.py`` (the planner's table), ``efficiency.py`` (gradient noise scale),
``jobs.py`` (job, goodput, migration), ``cluster.py`` (placement), ``simulator.py`` (event
loop), ``fifo.py`` / ``tiresias.py`` / ``optimus.py`` / ``ones.py`` (policies), ``registry.py``,
``workload.py`` (trace), ``report.py`` / ``html.py`` / ``cli.py`` (output).
"""

from __future__ import annotations

from .efficiency import NoiseScaleEfficiency
from .jobs import Job, JobModel
from .registry import POLICIES, make_policy, register_policy
from .simulator import Allocation, SchedulerError, SimResult, simulate
from .throughput import ThroughputTable, load_table
from .workload import load_trace, sample_workload

__all__ = ["NoiseScaleEfficiency", "Job", "JobModel", "POLICIES", "make_policy", "register_policy", "Allocation",
           "SchedulerError", "SimResult", "simulate", "ThroughputTable", "load_table", "load_trace",
           "sample_workload"]
