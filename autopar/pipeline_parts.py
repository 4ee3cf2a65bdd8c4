"""A solved piece of the graph (a pipeline stage, or a piece the pipeline search prices) split
by how its costs scale with the micro-batch (``Part``): the terms ``evaluate`` adds up, sorted
into per-micro-batch work, per-micro-batch parameter reshards, once-per-step work, and memory.
``autopar.pipeline_search`` composes candidate pipelines from them; ``autopar.pipeline_stages``
prices stage plans with them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cost_model.comm import collective_latency_s, unit_collective_s
from autopar.cost_model.costs import TrainingSpec, compute_seconds, kernel_overhead_seconds
from autopar.cost_model.graph_facts import requires_grad
from autopar.mesh import MeshSpec
from autopar.passes.annotate import STRATEGIES_KEY
from autopar.cost_model.evaluate import shared_reshards
from autopar.cost_model.fsdp_pricing import fsdp_fusions, fsdp_unit_s, fsdp_unit_shares
from autopar.cost_model.hardware import Hardware
from autopar.cost_model.offload import device_parts
from autopar.cost_model.recompute import recompute_effect, recomputed_keys
from autopar.cost_model.reshard import reshard_latency_s

from .plan import Plan

__all__ = ["Part", "split_costs", "accumulate_seconds", "kernel_floor_seconds", "least_compute", "batch_split",
           "microbatch_and_step_seconds", "boundary_bytes"]


@dataclass(frozen=True)
class Part:
    """A piece of the graph on a sub-mesh, for the whole batch, split by how its costs scale."""

    batch_seconds: float = 0.0  # compute, activation collectives: scale with the micro-batch
    use_seconds: float = 0.0  # parameter reshards (ZeRO-3 gathers): paid per micro-batch
    step_seconds: float = 0.0  # optimizer, parameter gradient syncs: once per step
    param_bytes: float = 0.0
    act_bytes: float = 0.0  # for the whole batch; scales with the micro-batch
    # of batch_seconds, what does not shrink with the micro-batch, so each one pays it in full: the
    # latencies of the activation collectives (``split_costs``) and the kernels' floors
    # (``kernel_floor_seconds``, added by the pipeline search)
    fixed_seconds: float = 0.0
    # adding a micro-batch's fresh parameter gradients into ``.grad`` (autograd's AccumulateGrad:
    # read both, write one), which every micro-batch but a step's first pays: ``accumulate_seconds``
    accum_seconds: float = 0.0

    def micro_seconds(self, m: int) -> float:
        """One of ``m`` micro-batches: the batch work over m, its fixed part (collective latencies,
        kernel floors) in full, the parameter reshards (paid per micro-batch) and its share of the
        gradient accumulation ((m - 1) of the m micro-batches add into ``.grad``)."""
        return (max(self.batch_seconds - self.fixed_seconds, 0.0) / m + self.fixed_seconds + self.use_seconds
                + self.accum_share(m))

    def accum_share(self, m: int) -> float:
        """One micro-batch's share of the step's m - 1 gradient accumulations."""
        return self.accum_seconds * (m - 1) / m

    def __add__(self, o: "Part") -> "Part":
        return Part(*(a + b for a, b in zip(self._fields(), o._fields())))

    def __sub__(self, o: "Part") -> "Part":
        return Part(*(max(a - b, 0.0) for a, b in zip(self._fields(), o._fields())))

    def scale(self, f: float) -> "Part":
        return Part(*(a * f for a in self._fields()))

    def _fields(self) -> tuple[float, ...]:
        return (self.batch_seconds, self.use_seconds, self.step_seconds, self.param_bytes, self.act_bytes,
                self.fixed_seconds, self.accum_seconds)


def _bucket_bytes(problem, d, i: int) -> float:
    """The gradient bucket slot a parameter's device bytes include (``offload.device_parts``): a
    pipeline stage has none, its syncs run once per step on ``.grad`` itself (``runtime.pipeline``).
    Priced, they put 6 MiB on the fidelity GPT's last stage under pp=2 x dp=2 (bench/memwhere.py)."""
    st, zero = d.options[i]
    return device_parts(d.node.meta["val"].numel(), st.output, problem.mesh, problem.train, zero,
                        str(d.node.target)).bucket * d.count


def split_costs(problem, choice: dict, regathers: bool = True) -> Part:
    """A solved problem's predicted costs split as Part says (the same terms evaluate() adds up);
    ``regathers=False``: less the backward re-gathers of ZeRO-3 weights (a recomputed block runs
    none: its recompute gathers again, priced with its forward)."""
    mesh = problem.mesh
    batch = use = step = params = acts = latency = accum = 0.0
    for key, d in problem.decisions.items():
        i = choice[key]
        if d.is_param:  # the optimizer once per step; ZeRO-2's collectives (comm_seconds) at every use
            step, use = step + d.seconds[i] - d.comm_seconds[i], use + d.comm_seconds[i]
            params += d.memory_bytes[i] - _bucket_bytes(problem, d, i)
            accum += accumulate_seconds(problem, d, i)
        else:
            batch += d.seconds[i]
            acts += d.memory_bytes[i]
            latency += sum(collective_latency_s(st.collective, mesh.sizes[st.axis], mesh.links[st.axis]) * count
                           for st, count in d.comm_steps[i])
    shared = shared_reshards(problem, choice)  # copies that reuse another op's reshard
    for idx, e in enumerate(problem.edges):
        a, b = e.producer_layouts[choice[e.producer]], e.consumer_layouts[choice[e.consumer]]
        seconds = e.seconds[(a, b)] * (e.count - shared.get(idx, 0)) / e.count
        acts += e.memory.get((a, b), 0.0) * (e.count - shared.get(idx, 0)) / e.count
        if problem.decisions[e.producer].is_param:
            use += seconds
        else:
            batch += seconds
            if seconds > 0:
                latency += reshard_latency_s(a, b, mesh, e.needs_grad) * (e.count - shared.get(idx, 0))
    fused, again = fsdp_fusions(problem, choice, recomputed_keys(problem, choice) if regathers
                                else frozenset(problem.decisions))  # ZeRO-3, per micro-batch
    shares = fsdp_unit_shares(problem, choice)
    for st, count, share in again:
        use += unit_collective_s(st.collective, st.nbytes, mesh.sizes[st.axis], mesh.links[st.axis], share) * count
    for g in problem.syncs:
        if g.param and g.axis in problem.decisions[g.param].options[choice[g.param]][1]:
            continue
        count = g.active_count(choice)
        if count:
            if (g.tensor, g.axis, g.layout) in fused:  # the gather's reduce-scatter, per micro-batch
                use += fsdp_unit_s(problem, "reduce_scatter", g.nbytes, g.axis, g.param, shares) * count
            elif g.param:  # once per step, after the schedule (runtime.pipeline defers them)
                step += g.seconds * count / g.count
            else:
                batch += g.seconds * count / g.count
                latency += collective_latency_s("all_reduce", mesh.sizes[g.axis], mesh.links[g.axis]) * count
    rc_compute, rc_comm, rc_saved, _ = recompute_effect(problem, choice, shared)  # recomputed blocks
    # (a recomputed forward's collectives are priced as rc_comm, their latencies not told apart)
    return Part(batch + rc_compute + rc_comm, use, step, params, acts - rc_saved, latency, accum)


def accumulate_seconds(problem, d, i: int) -> float:
    """Seconds to add one micro-batch's gradient of parameter decision ``d`` (option ``i``, all
    its copies) into ``.grad``: the local gradient (a ZeRO axis's piece) read twice and written
    once at the profile's streaming rate. A pipeline runs this m - 1 times a step per stage
    (``runtime.pipeline`` leaves accumulation to autograd); a plan without micro-batches never.
    The fidelity GPT under pp=2 x dp=2 at 4 micro-batches: 3 x 14 MiB per stage, about 4 ms a
    micro-batch on the calibrated CPU ranks."""
    if problem.stream_bytes_per_s <= 0 or problem.train is None:
        return 0.0
    st, zero = d.options[i]
    grads = device_parts(d.node.meta["val"].numel(), st.output, problem.mesh, problem.train, zero,
                         str(d.node.target)).grads
    return 3.0 * grads * d.count / problem.stream_bytes_per_s


def kernel_floor_seconds(problem, hw: Hardware) -> float:
    """The kernel floors a solved piece's batch seconds hold (``costs.kernel_overhead_seconds``
    summed over the ops of the graph its problem was built on): the same on every mesh and
    strategy, and paid once per micro-batch. Scaled with the micro-batch, as the search did
    before, they made gpt2-xl on 64 look 1.9x faster pipelined (pp=4, 37.5 ms) than its stage
    plans priced at the micro-batch (71.5 ms)."""
    graph = next(iter(problem.decisions.values())).node.graph
    return sum(kernel_overhead_seconds(n, hw, problem.needs_grad.get(n.name, False)) for n in graph.nodes)


def least_compute(gm: fx.GraphModule, n_devices: int, hw: Hardware, train: TrainingSpec) -> Part:
    """A lower bound on the compute of ``gm``'s ops on ``n_devices`` under any layouts, the whole
    batch: each op's time on one device less its kernel floor, split over every device, plus the
    floor (``fixed_seconds``); communication and memory at nothing. A layout splits an op's work
    over at most every device and the roofline's terms split with it (``costs.compute_seconds``),
    so no layout prices an op below this. No solve: the pipeline search bounds the end pieces
    with it before it plans them (``pipeline_search._middle_bound``)."""
    one = MeshSpec(("one",), (1,))
    grads = requires_grad(gm)
    batch = fixed = 0.0
    for n in gm.graph.nodes:
        strategies = n.meta.get(STRATEGIES_KEY) if n.op == "call_function" else None
        if not strategies:
            continue
        fwd, bwd = compute_seconds(n, strategies[0], one, hw, train, grads.get(n.name, False))
        floor = kernel_overhead_seconds(n, hw, grads.get(n.name, False))
        batch += max(fwd + bwd - floor, 0.0) / n_devices + floor
        fixed += floor
    return Part(batch_seconds=batch, fixed_seconds=fixed)


def batch_split(problem, choice: dict, batch: int) -> int:
    """Into how many pieces the solved layouts cut the batch dimension (dim 0 of a tensor whose
    first dimension is the batch): the product of the sizes of the mesh axes that shard it, the
    most over the graph's ops. A micro-batch of fewer samples cannot run those layouts."""
    most = 1
    graph = next(iter(problem.decisions.values())).node.graph
    for n in graph.nodes:
        val = n.meta.get("val")
        if n.name not in problem.rep_of or not isinstance(val, torch.Tensor) or val.ndim < 2 or val.shape[0] != batch:
            continue
        st = problem.strategy_of(n.name, choice)
        if st.outputs:
            cut = 1
            for size, code in zip(problem.mesh.sizes, st.outputs[0].codes):
                cut *= size if code == 0 else 1
            most = max(most, cut)
    return most


def microbatch_and_step_seconds(plan: Plan, m: int = 1) -> tuple[float, float]:
    """A stage plan's (per micro-batch of ``m``, once per step) seconds, as the search composes them."""
    part = split_costs(plan.problem, plan.choice)
    return part.batch_seconds + part.use_seconds + part.accum_share(m), part.step_seconds


def boundary_bytes(gm: fx.GraphModule, train: TrainingSpec) -> tuple[float, float]:
    """Bytes one stage hands the next (whole tensors) and the gradient bytes sent back."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    fwd = bwd = 0.0
    for x in torch.utils._pytree.tree_leaves(out.args[0]):
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if isinstance(val, torch.Tensor):
            if val.dtype.is_floating_point:
                b = val.numel() * train.activation_bytes_per_elem
                fwd, bwd = fwd + b, bwd + b
            else:
                fwd += val.numel() * val.element_size()
    return fwd, bwd
