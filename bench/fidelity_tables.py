"""The fidelity figures of ``bench/fidelity.py``: per plan predicted vs measured step time and
peak memory, the Spearman rank correlation, the median error, and the planner's pick against
every baseline it was predicted to beat."""

from __future__ import annotations

import math
import statistics

from report_tables import spearman, table

__all__ = ["plan_fidelity", "print_plan_fidelity", "same_layout"]

MIB = 2**20
STEP_TARGET, MEMORY_TARGET, SPEARMAN_TARGET = 0.25, 0.10, 0.9  # issue 19's "done when"


def plan_fidelity(records: list[dict]) -> dict:
    ok = [r for r in records if r.get("ok")]
    for r in ok:
        r["step_ratio"] = r["measured_step_s"] / r["predicted_step_s"]
        r["measured_peak_bytes"] = max(r["peak_bytes_per_rank"])
        r["peak_ratio"] = r["measured_peak_bytes"] / r["predicted_peak_bytes"]
    rho = spearman([r["predicted_step_s"] for r in ok], [r["measured_step_s"] for r in ok])
    median_err = statistics.median(abs(r["step_ratio"] - 1) for r in ok) if ok else math.nan
    by = {r["plan"]: r for r in ok}
    versus = []
    auto = by.get("auto")
    if auto is not None:
        for b in auto["baselines"]:
            if b["feasible"] and b["step_seconds"] > auto["predicted_step_s"] and b["name"] in by:
                versus.append(dict(baseline=b["name"], predicted_speedup=b["step_seconds"] / auto["predicted_step_s"],
                                   measured_speedup=by[b["name"]]["measured_step_s"] / auto["measured_step_s"]))
    return dict(n_plans=len(ok), n_failed=len(records) - len(ok), spearman_step_time=rho,
                median_abs_step_error=median_err,
                worst_peak_error=max((abs(r["peak_ratio"] - 1) for r in ok), default=math.nan),
                auto_mesh=None if auto is None else auto["mesh"], auto_vs_baselines=versus,
                passes=dict(spearman=rho >= SPEARMAN_TARGET, step_error=median_err <= STEP_TARGET,
                            memory=all(abs(r["peak_ratio"] - 1) <= MEMORY_TARGET for r in ok),
                            auto_beats_predicted=all(v["measured_speedup"] >= 1.0 for v in versus)))


def same_layout(plan, record: dict) -> bool:
    """``plan`` is the layout ``record`` timed: the same mesh and the same bytes per collective
    (another layout on the same mesh moves other bytes)."""
    was = record["predicted_comm_bytes"]
    now = {str(k): float(v) for k, v in plan.comm_bytes.items()}
    return str(plan.mesh) == record["mesh"] and all(
        abs(now.get(k, 0.0) - was.get(k, 0.0)) <= 1e-6 * max(was.get(k, 0.0), 1.0) for k in set(now) | set(was))


def print_plan_fidelity(records: list[dict], fig: dict, hardware: str) -> None:
    rows = []
    for r in records:
        if not r.get("ok"):
            rows.append([r["plan"], "FAILED: " + r["error"][:120]] + [""] * 7)
            continue
        rows.append([r["plan"], r["mesh"], f"{r['predicted_step_s'] * 1e3:.0f}", f"{r['measured_step_s'] * 1e3:.0f}",
                     f"{r['step_ratio']:.2f}", f"{r['predicted_peak_bytes'] / MIB:.1f}",
                     f"{r['measured_peak_bytes'] / MIB:.1f}", f"{r['peak_ratio']:.2f}",
                     f"{r['predicted_comm_s'] * 1e3:.0f}"])
    print(table(["plan", "mesh", "pred step ms", "meas step ms", "meas/pred", "pred peak MiB", "meas peak MiB",
                 "meas/pred", "pred comm ms"], rows,
                title=f"Fidelity: 4 CPU ranks (gloo, 1 thread each, 2 ranks per core), plans priced with {hardware}; "
                      f"step: median of round-robin rounds; peak: live tensor bytes, max over ranks"))
    for v in fig["auto_vs_baselines"]:
        print(f"planner's pick ({fig['auto_mesh']}) vs {v['baseline']}: predicted {v['predicted_speedup']:.2f}x faster, "
              f"measured {v['measured_speedup']:.2f}x")
    p = fig["passes"]
    print(f"Spearman(predicted, measured step time) over {fig['n_plans']} plans: {fig['spearman_step_time']:.2f} "
          f"(target >= {SPEARMAN_TARGET}: {'ok' if p['spearman'] else 'NOT MET'})")
    print(f"median |measured/predicted - 1| step time: {fig['median_abs_step_error']:.0%} "
          f"(target <= {STEP_TARGET:.0%}: {'ok' if p['step_error'] else 'NOT MET'})")
    print(f"worst |measured/predicted - 1| peak memory: {fig['worst_peak_error']:.0%} "
          f"(target <= {MEMORY_TARGET:.0%} for every plan: {'ok' if p['memory'] else 'NOT MET'})")
    print(f"planner's pick at least as fast as every baseline it was predicted to beat: "
          f"{'yes' if p['auto_beats_predicted'] else 'NO'}" + ("" if fig["auto_vs_baselines"] else " (none measured)"))
