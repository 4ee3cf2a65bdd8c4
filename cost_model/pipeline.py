"""Cost of a pipeline schedule: step time with its bubble, activations in flight, bytes between stages.

A stage is priced for one micro-batch by the ordinary cost model on its sub-mesh (its plan's
step time, parameter-state and activation bytes); this module composes the stages.

Schedules (p stages, m micro-batches, v model chunks per device for interleaved 1F1B;
Narayanan et al. 2021, arXiv 2104.04473, section 2.2; FACTS.md):

* step time      ``(m - 1) * t_max + sum_k t_k``  for GPipe and 1F1B (fill, steady state at the
                 slowest stage, drain; with equal stages ``(m + p - 1) t``, bubble ``(p - 1)/m``
                 of the ideal ``m t``); interleaved: ``(m + (p - 1)/v) * t_max`` where t_max is a
                 device's time for one micro-batch over its v chunks, bubble ``(p - 1)/(v m)``.
* activations    GPipe keeps all m micro-batches of a stage alive until their backward; 1F1B
                 at most ``p - k`` at stage k (warm-up of p - k - 1 forwards plus one);
                 interleaved (torch's ScheduleInterleaved1F1B warm-up) at most
                 ``(v - 1) p + 2 (p - k - 1) + 1`` chunk micro-batches on device k, spread
                 over its v chunks.
* point-to-point the tensors that cross each stage boundary, forward (activations) and
                 backward (their gradients; floating-point tensors only), once per micro-batch,
                 priced on the link the pp axis crosses (``p2p_s``: S/B + a).

Point-to-point sends do not overlap compute here (``cost_model/overlap.py`` hides only the
bucketed gradient all-reduces and ZeRO-3's collectives).

Oversubscribed CPU ranks (``Hardware.shared_cores``: more ranks than cores, each rank's
calibrated rate a share of a core): a rank idle in the bubble hands its share to the busy
ones, which run up to ``idle_speedup`` faster. The step is then bounded by the machine's
total work (every device's ``m`` micro-batches at the all-busy rate, shared by all of them:
their mean) and by the schedule above run that much faster:
``max(m * mean_k t_k, step / idle_speedup)``; with ``idle_speedup`` 1 (GPUs) that is the
schedule's step unchanged. Ranks pinned to cores (``autopar calibrate`` and the benchmarks pin
them round robin) share only their own core: a core's work is its ranks' ``m`` micro-batches,
done at the whole core's speed, so the step is also at least ``m * sum_k share_ck t_k`` for
every core c, ``share_ck`` the fraction of its ranks that run stage k
(``Hardware.pipeline_core_shares``). With every stage on every core that is the mean again;
4 ranks on 2 cores running pp=4 put stages 0 and 2 on one core and 1 and 3 (the head's) on the
other, whose ranks measured 141 + 432 ms of CPU a step against 149 + 138 on the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autopar.mesh import Link

from .comm import bytes_sent_per_rank, collective_s, p2p_s
from .fsdp_pricing import fsdp_fusions
from .recompute import recomputed_keys

__all__ = ["SCHEDULES", "bubble_fraction", "activations_in_flight", "StageCost", "PipelineCost", "pipeline_cost",
           "step_sync_bytes", "step_sync_seconds", "tied_sync_cost"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def _check(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; pick one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    if (schedule == "interleaved-1f1b") != (v > 1):
        raise ValueError(f"{schedule} with v={v}: only interleaved-1f1b has v > 1 chunks per device")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time over ideal time: (p - 1)/m, interleaved (p - 1)/(v m)."""
    _check(schedule, p, m, v)
    return (p - 1) / (v * m)


def activations_in_flight(schedule: str, p: int, m: int, stage: int, v: int = 1) -> float:
    """Micro-batches whose activations device ``stage`` (0-based on the pp axis) holds at
    its peak, per model chunk it runs (see module doc)."""
    _check(schedule, p, m, v)
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    return min(v * m, (v - 1) * p + 2 * (p - stage - 1) + 1) / v


@dataclass(frozen=True)
class StageCost:
    """One stage (or, interleaved, one chunk) for one micro-batch on its sub-mesh."""

    seconds: float  # forward + backward + its own collectives, one micro-batch
    param_state_bytes: float  # weights, gradients, optimizer state per device
    activation_bytes: float  # kept for backward, one micro-batch, per device
    send_bytes: float = 0.0  # what it hands the next stage per micro-batch (whole tensors)
    send_grad_bytes: float = 0.0  # the gradients of what it received, sent back per micro-batch
    # recomputed blocks: one block's activations for one micro-batch, alive during its backward
    # only (once per device, not per micro-batch in flight; cost_model/recompute.py)
    transient_bytes: float = 0.0


@dataclass(frozen=True)
class PipelineCost:
    schedule: str
    n_stages: int
    n_microbatches: int
    virtual_stages: int
    step_seconds: float
    bubble_fraction: float
    bubble_seconds: float
    stage_seconds: tuple[float, ...]  # per device, one micro-batch, its chunks and sends included
    stage_memory_bytes: tuple[float, ...]  # peak per device of each pp position
    p2p_bytes_per_step: float  # sent by one device of the busiest boundary, per step

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.stage_memory_bytes)


def pipeline_cost(stages: list[StageCost], schedule: str, m: int, link: Link, v: int = 1,
                  idle_speedup: float = 1.0, core_shares: Sequence[Sequence[float]] = ()) -> PipelineCost:
    """Compose ``stages`` (``p * v`` of them, in model order; device k runs k, k + p, ...);
    ``idle_speedup``: ``Hardware.idle_speedup`` of the pipeline's devices, ``core_shares``:
    ``Hardware.pipeline_core_shares`` (see module doc; () where no ranks share pinned cores)."""
    if len(stages) % v:
        raise ValueError(f"{len(stages)} stages do not split into v={v} chunks per device")
    p = len(stages) // v
    _check(schedule, p, m, v)
    dev_seconds, dev_memory, p2p = [], [], 0.0
    for k in range(p):
        chunks = [stages[k + j * p] for j in range(v)]
        send = sum(p2p_s(c.send_bytes, link) + p2p_s(c.send_grad_bytes, link) for c in chunks)
        dev_seconds.append(sum(c.seconds for c in chunks) + send)
        flight = activations_in_flight(schedule, p, m, k, v)
        dev_memory.append(sum(c.param_state_bytes + flight * c.activation_bytes for c in chunks)
                          + max(c.transient_bytes for c in chunks))
        p2p = max(p2p, m * sum(c.send_bytes + c.send_grad_bytes for c in chunks))
    t_max = max(dev_seconds)
    if v == 1:
        step = (m - 1) * t_max + sum(dev_seconds)
    else:
        step = (m + (p - 1) / v) * t_max
    ideal = m * t_max
    busy = max([m * sum(dev_seconds) / p] + [m * sum(share * t for share, t in zip(row, dev_seconds))
                                             for row in core_shares])
    step = max(busy, step / idle_speedup)
    return PipelineCost(schedule, p, m, v, step, bubble_fraction(schedule, p, m, v), step - ideal,
                        tuple(dev_seconds), tuple(dev_memory), p2p)


def _step_syncs(problem, choice: dict):
    """(sync, active count) of the parameter gradient all-reduces a pipeline stage runs once per
    step after the schedule (runtime.pipeline defers them), not once per micro-batch: the syncs
    ``evaluate`` counts, less ZeRO-2's reduce-scatters and ZeRO-3's fused ones (those stay per
    micro-batch)."""
    fused, _ = fsdp_fusions(problem, choice, recomputed_keys(problem, choice))
    for g in problem.syncs:
        if not g.param or g.axis in problem.decisions[g.param].options[choice[g.param]][1]:
            continue
        count = g.active_count(choice)
        if count and (g.tensor, g.axis, g.layout) not in fused:
            yield g, count


def step_sync_bytes(problem, choice: dict) -> dict[str, float]:
    """Bytes one rank sends for a stage's once-per-step gradient all-reduces (``_step_syncs``)."""
    total = sum(bytes_sent_per_rank("all_reduce", g.nbytes, problem.mesh.sizes[g.axis]) * count
                for g, count in _step_syncs(problem, choice))
    return {"all_reduce": total} if total else {}


def step_sync_seconds(problem, choice: dict) -> float:
    """Seconds of a stage's once-per-step gradient all-reduces (``_step_syncs``), as ``evaluate``
    prices them into the stage plan's communication time."""
    return sum(g.seconds * count / g.count for g, count in _step_syncs(problem, choice))


def tied_sync_cost(nbytes: float, n_positions: int, link: Link) -> tuple[float, float]:
    """(bytes each rank sends, seconds) of the once-per-step all-reduce of a tied weight's
    gradient (``nbytes`` per rank) between the ``n_positions`` pp positions that hold it."""
    if n_positions < 2:
        return 0.0, 0.0
    return (bytes_sent_per_rank("all_reduce", nbytes, n_positions),
            collective_s("all_reduce", nbytes, n_positions, link))
