"""The terminal report of a Plan: what a person reads after ``autopar plan``."""

from __future__ import annotations

import math
import re
from collections import OrderedDict

from .cost_model.comm import p2p_s
from .cost_model.offload import parameter_group
from .plan import Plan

__all__ = ["format_report", "stage_rows", "bubble_share", "block_rows", "gib", "ms"]


def ms(s: float) -> str:
    return "-" if not math.isfinite(s) else f"{s * 1e3:,.2f} ms"


def gib(b: float) -> str:
    if not math.isfinite(b):
        return "-"
    return f"{b / 2**30:,.2f} GiB" if b >= 2**30 else f"{b / 2**20:,.1f} MiB"


def block_rows(plan: Plan) -> list[tuple[str, str, str]]:
    """One row per distinct (block, op) pattern: repeated blocks collapse into their first."""
    rows: "OrderedDict[tuple[str, str], tuple[str, str, str]]" = OrderedDict()
    for n in plan.nodes:
        if n.op in ("placeholder",) or n.op.startswith("aten.") and any(
                v in n.op for v in ("view", "transpose", "reshape", "permute", "unsqueeze", "expand", "dropout",
                                    "getitem", "split", "select", "slice", "alias", "to.", "_to_copy")):
            continue
        if n.op == "get_attr":
            label = re.sub(r"_(\d+)_", r".\1.", n.name, count=1)
            z = f" +ZeRO-2 on {','.join(plan.mesh.axes[a] for a in n.zero_axes)}" if n.zero_axes else ""
            key = (n.shares_with or n.name, "param")
            rows.setdefault(key, (label, "param", n.output_layout + z))
        else:
            key = (n.shares_with or n.name, n.op)
            rows.setdefault(key, (n.name, n.op.replace("aten.", "").replace(".default", ""), n.strategy))
    return list(rows.values())


def bubble_share(plan: Plan) -> float:
    """The pipeline bubble's share of the predicted step (what the report prints as a percentage)."""
    info = plan.pipeline
    return info.bubble_seconds / plan.step_seconds if info is not None and plan.step_seconds > 0 else 0.0


def stage_rows(plan: Plan) -> list[dict]:
    """Per device position on the pp axis: blocks, extras, time per micro-batch, peak memory,
    and from the stage plans the communication time (collectives, sends between stages, tied
    all-reduces) and bytes sent per step and the solver's
    figures (variables, constraints, status). Empty without pipeline stages."""
    info = plan.pipeline
    if info is None:
        return []
    rows = []
    m, p = info.n_microbatches, info.n_stages
    for st in info.stages:
        mine = list(range(st.index, p * info.virtual_stages, p))
        plans = [plan.stage_plans[s] for s in mine if s < len(plan.stage_plans)]
        chunks = [info.chunks[s] for s in mine if s < len(info.chunks)]
        link = plan.mesh.links[0]
        comm = sum(m * (c.comm_seconds + p2p_s(c.send_bytes, link) + p2p_s(c.send_grad_bytes, link)) for c in chunks) \
            + sum(t.seconds for t in info.tied if st.index in t.positions)
        sent = info.predicted_bytes(st.index) if info.chunks else {}
        rows.append(dict(
            index=st.index, extras=st.extras, seconds=st.seconds_per_microbatch, memory=st.peak_memory_bytes,
            blocks=(f"{st.first_block}-{st.first_block + st.n_blocks - 1}" if info.virtual_stages == 1
                    else f"{st.n_blocks} in {info.virtual_stages} chunks"),
            comm_seconds=comm if plans else float("nan"), bytes=sent,
            variables=sum(x.solver.n_variables for x in plans), constraints=sum(x.solver.n_constraints for x in plans),
            status="/".join(sorted({x.solver.status for x in plans})) or "-",
            tied=", ".join(t.target for t in info.tied if st.index in t.positions)))
    return rows


def _pipeline_lines(plan: Plan) -> list[str]:
    """Stages (blocks, sub-mesh, predicted time, communication, bytes, memory, solver), schedule, bubble."""
    info = plan.pipeline
    if info is None:
        return []
    chunks = f", {info.virtual_stages} model chunks per device" if info.virtual_stages > 1 else ""
    lines = [
        "",
        f"pipeline: {info.n_stages} stages over {plan.mesh.links[0].name}, schedule {info.schedule}{chunks}, "
        f"{info.n_microbatches} micro-batches; bubble {ms(info.bubble_seconds)} = {bubble_share(plan) * 100:.1f}% "
        f"of the step (the step time above includes it; idle over busy time (p-1)/(v m) = "
        f"{info.bubble_fraction * 100:.1f}%)",
        f"  each stage on mesh {info.stage_mesh}; {info.p2p_bytes_per_step / 2**20:,.1f} MiB sent per device "
        f"between stages per step; blocks per stage {list(info.stage_blocks)} of `{info.block_prefix}`",
    ]
    for t in info.tied:
        lines.append(f"  tied weight {t.target}: a copy on stages {list(t.stages)}, its gradient all-reduced once per "
                     f"step between pp positions {list(t.positions)} ({t.bytes_per_rank / 2**20:,.2f} MiB, "
                     f"{ms(t.seconds)} per rank)")
    if not plan.stage_plans:
        lines.append("  no stage plans (planned from a traced graph): plan the model itself to run it")
    lines.append(f"  {'stage':>5s}  {'blocks':12s} {'also':16s} {'time/micro-batch':>16s} {'comm/step':>11s} "
                 f"{'sent/step':>11s} {'peak memory':>12s} {'ILP vars':>9s}")
    for r in stage_rows(plan):
        lines.append(f"  {r['index']:5d}  {r['blocks']:12s} {r['extras'] or '-':16s} {ms(r['seconds']):>16s} "
                     f"{ms(r['comm_seconds']):>11s} {sum(r['bytes'].values()) / 2**20:>7,.2f} MiB "
                     f"{gib(r['memory']):>12s} {r['variables']:>9,d}")
    return lines


def _parallelism_lines(plan: Plan) -> list[str]:
    """The plan's layout family (1D / 2D / 2.5D / 3D tensor parallel) and sequence parallelism."""
    if plan.problem is None or plan.pipeline is not None:
        return []
    from .tp_families import describe_parallelism

    return ["", *describe_parallelism(plan)]


def format_report(plan: Plan, max_rows: int = 40) -> str:
    mesh = plan.mesh
    axes = ", ".join(f"{a}={s} over {l.name}" for a, s, l in zip(mesh.axes, mesh.sizes, mesh.links))
    lines = [
        f"autopar plan: {plan.model} on {plan.n_devices} x {plan.hardware} "
        f"({plan.optimizer}, {'bf16 mixed precision' if plan.mixed_precision else 'fp32'}, strategy={plan.strategy})",
        f"mesh: {axes}",
        "",
        f"predicted step time   {ms(plan.step_seconds)}  " + (
            f"(compute {ms(plan.compute_seconds)}, communication {ms(plan.comm_seconds)})" if plan.pipeline is None
            else f"(stages compute {ms(plan.compute_seconds)}, communication {ms(plan.comm_seconds)}, "
                 f"pipeline bubble {ms(plan.pipeline.bubble_seconds)})"),
        f"peak memory / device  {gib(plan.peak_memory_bytes_per_device)} of {gib(plan.memory_budget_bytes)} budget"
        f"  (params+grads+optimizer {gib(plan.param_state_bytes)}, activations {gib(plan.activation_bytes)})",
        "bytes sent / device   " + (", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in sorted(plan.comm_bytes.items()))
                                  or "none") + ("  (the busiest pp position; per stage below)" if plan.pipeline
                                                else ""),
        "activation recompute  " + (", ".join(_recompute_text(p) for p in plan.recompute) or "none"),
        *([f"host memory / device  {gib(plan.host_bytes)}  (optimizer state, fp32 master weights and gradient "
           f"buffer offloaded{_offloaded_groups(plan)}; "
           f"the step runs on the host)"] if plan.host_bytes else []),
        *_parallelism_lines(plan),
        *_pipeline_lines(plan),
        "",
        "layouts (one row per op of each repeated block; placements per mesh axis, in order "
        f"{','.join(mesh.axes[1:] if plan.pipeline else mesh.axes)}"
        + ("; inside every pipeline stage" if plan.pipeline else "") + "):",
    ]
    rows = block_rows(plan)
    for name, op, strategy in rows[:max_rows]:
        lines.append(f"  {name[:30]:30s} {op[:28]:28s} {strategy}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more rows (--json has every node)")
    s = plan.solver
    gap = "n/a" if s.gap != s.gap else f"{s.gap * 100:.2f}%"
    lines += [
        "",
        f"solver: {s.name} {s.status} in {s.seconds:.2f} s, {s.n_variables:,} variables, "
        f"{s.n_constraints:,} constraints; objective {ms(s.objective)}, lower bound {ms(s.lower_bound)} "
        f"(gap {gap}); {s.ilps_solved} ILPs; whole plan {s.plan_seconds:.1f} s",
        f"        {s.mesh_search}",
    ]
    if plan.stage_plans:
        lines.append(f"        stage plans: {len(plan.stage_plans)} ILPs on mesh {plan.stage_plans[0].mesh}, "
                     f"{sum(x.solver.seconds for x in plan.stage_plans):.2f} s")
    if plan.baselines:
        lines += ["", f"{'baseline':14s} {'mesh':12s} {'step':>12s} {'peak mem':>12s}  vs plan"]
        lines.append(f"{'autopar':14s} {str(mesh):12s} {ms(plan.step_seconds):>12s} "
                     f"{gib(plan.peak_memory_bytes_per_device):>12s}  1.00x")
        for b in plan.baselines:
            ratio = b.step_seconds / plan.step_seconds if math.isfinite(b.step_seconds) else math.inf
            fit = "" if b.feasible else "  (does not fit)"
            lines.append(f"{b.name:14s} {b.mesh:12s} {ms(b.step_seconds):>12s} "
                         f"{gib(b.peak_memory_bytes_per_device):>12s}  {ratio:.2f}x slower{fit}"
                         if math.isfinite(ratio) else f"{b.name:14s} {'-':12s} {'no plan':>12s}")
    return "\n".join(lines)


def _recompute_text(entry: str) -> str:
    """``blocks`` -> every block recomputed; ``blocks:attn`` -> each block's attention (selective)."""
    prefix, _, segment = entry.partition(":")
    return f"{prefix} (each block's {segment}, selective)" if segment else f"{entry} (every block, full)"


def _offloaded_groups(plan: Plan) -> str:
    """`` of 4 groups (blocks.*.mlp.fc.weight, ...)``: what a per-group offload moved."""
    if not plan.offload_params:
        return ""
    groups = sorted({parameter_group(t) for t in plan.offload_params})
    shown = ", ".join(groups[:4]) + (", ..." if len(groups) > 4 else "")
    return f" for {len(groups)} parameter group{'s' if len(groups) > 1 else ''} ({shown})"
