"""Per-group ZeRO-Offload: which parameters keep their optimizer state in host memory.

``offload=True`` moves every parameter's optimizer state, fp32 master and gradient buffer to
the host (``cost_model/offload.py``); that frees the most device memory and costs the most host
link and CPU time. ``offload="auto"`` offloads only what the budget needs, as a user tuning
ZeRO-Offload by hand would: no offload if a plan fits without it; else the fewest parameter
groups, largest first, with which a plan fits (bisection over how many, each candidate a full
search). ``offload=["blocks.*.mlp.fc.weight", ...]`` pins the groups (or single parameters).

A group is a parameter's role in every copy of a repeated block (``cost_model.offload.
parameter_group``): the cost problem prices a repeated block's copies as one decision, so a
group is the finest unit it can price apart. Feasibility is monotone in the groups moved (each
moved group only lowers device bytes), which the bisection relies on; among the plans that fit,
fewer groups moved is taken as faster (each adds host link and host CPU time) and checked
against the all-offloaded plan. Plans with pipeline stages offload every parameter or none
(``runtime/pipeline.py`` builds one optimizer per stage from the plan's switch).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch import nn

from .cost_model.ilp import InfeasibleBudgetError
from .cost_model.offload import OffloadTargets, parameter_group
from .errors import BadArgumentError
from .plan import Plan
from .trace import trace

__all__ = ["offload_plan", "parameter_groups"]


def parameter_groups(gm: fx.GraphModule) -> list[tuple[str, tuple[str, ...], int]]:
    """``(group, its parameter names, elements)`` for every trainable parameter the graph
    reads, the largest group first (ties by name)."""
    params = dict(gm.named_parameters())
    members: dict[str, list[str]] = defaultdict(list)
    numel: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op == "get_attr" and target in params and params[target].requires_grad:
            group = parameter_group(target)
            if target not in members[group]:
                members[group].append(target)
                numel[group] += params[target].numel()
    return sorted(((g, tuple(ts), numel[g]) for g, ts in members.items()), key=lambda x: (-x[2], x[0]))


def offload_plan(plan_fn: Callable[..., Plan], model: nn.Module | fx.GraphModule, n_gpus: int,
                 example_inputs: Sequence[Any], offload: str | Sequence[str], options: dict) -> Plan:
    """The plan with ``offload`` "auto" or a list of groups / parameter names (module doc);
    ``plan_fn`` is ``autopar.planner.plan`` and ``options`` its other keyword arguments."""
    options = dict(options, model_name=options.get("model_name") or type(model).__name__)
    if offload == "auto":
        try:
            return plan_fn(model, n_gpus, example_inputs, offload=False, **options)
        except InfeasibleBudgetError:
            pass
        whole = plan_fn(model, n_gpus, example_inputs, offload=True, **options)  # raises if even this does not fit
        if whole.pipeline is not None:
            return whole
        gm = _graph(model, example_inputs, options)
        groups = parameter_groups(gm)
        best, lo, hi = whole, 1, len(groups) - 1
        while lo <= hi:  # the fewest largest groups with which a plan fits
            k = (lo + hi) // 2
            try:
                got = _with_targets(plan_fn, gm, n_gpus, [t for _, ts, _ in groups[:k] for t in ts], options)
            except InfeasibleBudgetError:
                lo = k + 1
                continue
            best, hi = got, k - 1
        return best if best.step_seconds <= whole.step_seconds else whole
    names = [offload] if isinstance(offload, str) else list(offload)
    if not names or not all(isinstance(x, str) for x in names):
        raise BadArgumentError(f"offload={offload!r}: pass True, False, 'auto' or a list of parameter names or groups "
                               "(e.g. ['blocks.*.mlp.fc.weight'])")
    gm = _graph(model, example_inputs, options)
    groups = parameter_groups(gm)
    targets = [t for g, ts, _ in groups for t in ts if g in names or t in names]
    unknown = [x for x in names if not any(x == g or x in ts for g, ts, _ in groups)]
    if unknown:
        known = ", ".join(g for g, _, _ in groups[:6])
        raise BadArgumentError(f"offload names {unknown} are neither parameters nor parameter groups of this model; "
                               f"its groups, largest first: {known}{', ...' if len(groups) > 6 else ''}")
    return _with_targets(plan_fn, gm, n_gpus, targets, options)


def _graph(model, example_inputs, options: dict) -> fx.GraphModule:
    if isinstance(model, fx.GraphModule):
        return model
    return trace(model, example_inputs, options.get("example_kwargs"), stack_traces=False)


def _with_targets(plan_fn, gm: fx.GraphModule, n_gpus: int, targets: list[str], options: dict) -> Plan:
    mesh = options.get("mesh")
    if options.get("strategy") == "pp" or (mesh is not None and "pp" in str(mesh)):
        raise BadArgumentError("per-group offload does not run under pipeline stages yet; pass offload=True "
                               "(every parameter) with pipeline stages, or drop pp from the mesh")
    options = {k: v for k, v in options.items() if k != "example_kwargs"}
    return plan_fn(gm, n_gpus, (), offload=OffloadTargets(sorted(targets)), **dict(options, pipeline=False))
