"""Evaluate a chosen assignment: predicted step time (compute / communication, the
asynchronous collectives overlapped with compute as ``cost_model/overlap.py`` says), memory per
device with its breakdown, and bytes each device sends per collective type.

Used for the chosen plan, for every baseline, and for ``Plan.explain``'s alternatives, so all
of them are priced by exactly the same model.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from autopar.strategy import REPLICATE_CODE

from .comm import bytes_sent_per_rank, collective_s, unit_collective_s
from .fsdp_pricing import fsdp_fusions, fsdp_unit_s, fsdp_unit_shares
from .optimizer_norms import norm_allreduce_bytes
from .problem import Problem, partial_grad_axes
from .liveness import step_memory
from .offload import host_bytes
from .overlap import hidden_comm_seconds
from .recompute import recompute_effect, recomputed_keys
from .reshard import reshard_steps, transitions

__all__ = ["Prediction", "evaluate", "shared_reshards"]


def shared_reshards(problem: Problem, choice: dict[str, int]) -> dict[int, int]:
    """Per edge index, how many of its copies the runtime does not reshard: another consumer
    already moved the same tensor to the same layout and synchronizes its gradient there, so
    this one uses that value (``passes.lower``: one reshard, one gradient sync). The ILP
    prices each edge on its own (an over-estimate where layouts coincide); this is exact."""

    seen: set[tuple] = set()
    out: dict[int, int] = {}
    for idx, e in enumerate(problem.edges):
        if not (e.needs_grad and e.tensor):
            continue
        a = e.producer_layouts[choice[e.producer]]
        b = e.consumer_layouts[choice[e.consumer]]
        if not transitions(a, b):
            continue
        producer = problem.decisions[e.producer]
        zero = producer.options[choice[e.producer]][1] if producer.is_param else ()
        st = problem.decisions[e.consumer].options[choice[e.consumer]][0]
        first = next((x for x in partial_grad_axes(st, problem.mesh)
                      if b.codes[x] == REPLICATE_CODE and x not in zero), None)
        if first is None:
            continue
        for source in e.sources or [e.tensor]:
            key = (source, b, first)
            if key in seen:
                out[idx] = out.get(idx, 0) + 1
            seen.add(key)
    return out


@dataclass(frozen=True)
class Prediction:
    step_seconds: float
    compute_seconds: float
    comm_seconds: float
    param_state_bytes: float  # weights + gradients + optimizer state
    activation_bytes: float
    comm_bytes: dict[str, float] = field(default_factory=dict)  # collective -> bytes sent per device per step
    host_bytes: float = 0.0  # ZeRO-Offload: optimizer state in host memory, per device (not in the peak)
    async_comm_seconds: float = 0.0  # of comm_seconds: run beside compute (gradient buckets, ZeRO-3)
    hidden_comm_seconds: float = 0.0  # of those: hidden behind compute (step = compute + comm - hidden)
    # the step's peak device bytes walked block by block (cost_model/liveness.py); None: the sum
    step_peak_bytes: float | None = None
    bucket_bytes: float = 0.0  # gradient all-reduce buckets (in param_state_bytes)
    peak_phase: str = ""  # where in the step the peak falls

    @property
    def peak_memory_bytes(self) -> float:
        if self.step_peak_bytes is not None:
            return self.step_peak_bytes
        return self.param_state_bytes + self.activation_bytes

    @property
    def comm_bytes_total(self) -> float:
        return sum(self.comm_bytes.values())


def evaluate(problem: Problem, choice: dict[str, int]) -> Prediction:
    mesh = problem.mesh
    node_s = comm_s = async_s = window_s = 0.0
    params_b = acts_b = 0.0
    sent: dict[str, float] = defaultdict(float)
    for key, d in problem.decisions.items():
        i = choice[key]
        node_s += d.seconds[i] - d.comm_seconds[i]
        comm_s += d.comm_seconds[i]
        if d.is_param:
            params_b += d.memory_bytes[i]
        else:
            acts_b += d.memory_bytes[i]
            window_s += d.seconds[i] - d.comm_seconds[i]  # forward + backward compute (not the optimizer step)
        for step, count in d.comm_steps[i]:
            sent[step.collective] += bytes_sent_per_rank(step.collective, step.nbytes, mesh.sizes[step.axis]) * count
    shared = shared_reshards(problem, choice)
    fused, regathers = fsdp_fusions(problem, choice, recomputed_keys(problem, choice))  # ZeRO-3 as runtime.fsdp runs it
    gathered = {(tensor, layout) for tensor, _, layout in fused}
    shares = fsdp_unit_shares(problem, choice)  # ZeRO-3 collectives run per unit where the runtime groups them
    panels: dict[int, float] = {}
    for idx, e in enumerate(problem.edges):
        copies = e.count - shared.get(idx, 0)
        if not copies:
            continue
        a = e.producer_layouts[choice[e.producer]]
        b = e.consumer_layouts[choice[e.consumer]]
        edge_s = e.seconds[(a, b)] * copies / e.count
        comm_s += edge_s
        if problem.decisions[e.producer].is_param and (e.tensor, b) in gathered:
            # a ZeRO-3 gather (the reshard's last step), prefetched and run once per unit (runtime.fsdp):
            # this parameter pays its unit share of the latency the edge priced in full
            last = transitions(a, b)[-1]
            n = mesh.sizes[last.axis]
            latency = mesh.links[last.axis].rates("all_gather", n)[1]
            unit_discount = (n - 1) * latency * (1.0 - shares.get(e.producer, 1.0)) * copies
            edge_s -= unit_discount
            comm_s -= unit_discount
            async_s += edge_s
        panel = e.memory.get((a, b), 0.0) * copies / e.count  # gathered panels kept for backward
        acts_b += panel
        if panel:
            panels[idx] = panel
        fwd, bwd = reshard_steps(a, b, e.total_bytes, mesh, e.needs_grad)
        for step in fwd + bwd:
            sent[step.collective] += bytes_sent_per_rank(step.collective, step.nbytes, mesh.sizes[step.axis]) * copies
    for step, count, share in regathers:
        regather_s = unit_collective_s(step.collective, step.nbytes, mesh.sizes[step.axis], mesh.links[step.axis],
                                       share) * count
        comm_s += regather_s
        async_s += regather_s  # prefetched in backward
        sent[step.collective] += bytes_sent_per_rank(step.collective, step.nbytes, mesh.sizes[step.axis]) * count
    for g in problem.syncs:
        if g.param and g.axis in problem.decisions[g.param].options[choice[g.param]][1]:
            continue  # ZeRO-2 reduce-scatters this gradient (its steps are the parameter's)
        count = g.active_count(choice)  # the tensors whose consumers chose a triggering option
        if count:
            kind = "reduce_scatter" if (g.tensor, g.axis, g.layout) in fused else "all_reduce"
            n = mesh.sizes[g.axis]
            sync_s = g.seconds * count / g.count if kind == "all_reduce" else \
                fsdp_unit_s(problem, kind, g.nbytes, g.axis, g.param, shares) * count  # one reduce-scatter per unit
            comm_s += sync_s
            if g.param:  # a parameter's gradient: bucketed (grad_buckets) or reduce-scattered asynchronously (fsdp)
                async_s += sync_s
            sent[kind] += bytes_sent_per_rank(kind, g.nbytes, n) * count
    for axis, nbytes in norm_allreduce_bytes(problem, choice, problem.optimizer).items():  # LAMB/LARS norms
        comm_s += collective_s("all_reduce", nbytes, mesh.sizes[axis], mesh.links[axis])
        sent["all_reduce"] += bytes_sent_per_rank("all_reduce", nbytes, mesh.sizes[axis])
    rc_compute_s, rc_comm_s, rc_saved_b, rc_sent = recompute_effect(problem, choice, shared)  # recomputed blocks
    node_s, comm_s, acts_b = node_s + rc_compute_s, comm_s + rc_comm_s, acts_b - rc_saved_b
    window_s += rc_compute_s  # a recomputed forward is compute the collectives can hide behind too
    for kind, nbytes in rc_sent.items():
        sent[kind] += nbytes
    hidden_s = hidden_comm_seconds(async_s, window_s, problem.comm_overlap)
    mem = step_memory(problem, choice, panels) if problem.train is not None and problem.decisions else None
    return Prediction(node_s + comm_s - hidden_s, node_s, comm_s, params_b, acts_b, dict(sent),
                      host_bytes(problem, choice), async_s, hidden_s,
                      mem.peak_bytes if mem else None, mem.bucket_bytes if mem else 0.0, mem.phase if mem else "")
