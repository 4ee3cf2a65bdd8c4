"""What would a change to the profile have done to past fidelity runs? Re-price the plans of
``bench/fidelity.py`` runs under their own calibrated profile with its collectives' latency (or
bandwidth) scaled, against the step times those runs measured; nothing is run on the ranks.

    python bench/fidelity_whatif.py RUN.json [RUN2.json ...] --scale 1 1.5 2
    python bench/fidelity_whatif.py RUN.json --scale 1.5 --what bandwidth

Why: one fidelity run takes ~5 minutes, and the machine's speed moves between runs by more than
most model changes move a prediction, so a change judged by one fresh run is judged by the
machine. Re-pricing the same measured steps isolates what the cost model would say. Scale 1
must reproduce each run's own figures (the check that the re-pricing is the bench's). A plan
that re-plans to another layout under the scaled profile is marked: its measured step belongs
to the layout the run timed, so the row compares different plans and says so.

This is a sensitivity tool, not a calibration: a scale chosen here from these runs' steps would
be fitted to the bench. A change it points to has to come from a measurement of the machine
(``autopar calibrate``) and be judged by fresh runs of ``bench/fidelity.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def scaled_profile(profile: dict, scale: float, what: str) -> dict:
    """``profile`` with every link's latency times ``scale`` (``what="latency"``) or its
    bandwidth divided by it (``"bandwidth"``), the measured per-collective rows included."""
    out = copy.deepcopy(profile)
    for side in ("intra_node", "inter_node"):
        link = out[side]
        if what == "latency":
            link["latency_s"] *= scale
            link["per_collective"] = [[c, n, b, a * scale] for c, n, b, a in link.get("per_collective", [])]
        else:
            link["bandwidth_bytes_per_s"] /= scale
            link["per_collective"] = [[c, n, b / scale, a] for c, n, b, a in link.get("per_collective", [])]
    return out


def reprice(run: dict, scale: float, what: str) -> tuple[dict, list[str]]:
    """(the fidelity figures of ``run``'s measured steps against the re-priced plans, one
    ``plan:ratio`` note per plan)."""
    from fidelity import PLANS, make_plan
    from fidelity_tables import plan_fidelity, same_layout
    from runtime_vs_baselines import FULL, build_model

    measured = {r["plan"]: r for r in run["records"] if r.get("ok")}
    records, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        with open(path, "w") as f:
            json.dump(scaled_profile(run["profile"], scale, what), f)
        for name, options in PLANS:
            if name not in measured:
                continue
            model, inputs = build_model(FULL)
            plan = make_plan(model, inputs, path, options)
            was = measured[name]
            records.append(dict(was, ok=True, predicted_step_s=plan.step_seconds,
                                predicted_peak_bytes=plan.peak_memory_bytes_per_device,
                                baselines=[dict(name=b.name, step_seconds=b.step_seconds, feasible=b.feasible)
                                           for b in plan.baselines]))
            other = "" if same_layout(plan, was) else f" (re-planned: {plan.mesh})"
            notes.append(f"{name} {was['measured_step_s'] / plan.step_seconds:.2f}{other}")
    return plan_fidelity(records), notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench/fidelity.py --json outputs")
    ap.add_argument("--scale", nargs="+", type=float, default=[1.0, 1.5, 2.0])
    ap.add_argument("--what", choices=("latency", "bandwidth"), default="latency")
    args = ap.parse_args()
    for path in args.runs:
        with open(path) as f:
            run = json.load(f)
        for scale in args.scale:
            fig, notes = reprice(run, scale, args.what)
            print(f"{os.path.basename(path)} {args.what} x{scale:g}: Spearman {fig['spearman_step_time']:.2f}, "
                  f"median error {fig['median_abs_step_error']:.0%}, pick as fast as predicted: "
                  f"{'yes' if fig['passes']['auto_beats_predicted'] else 'no'}", flush=True)
            print("    " + ", ".join(notes), flush=True)


if __name__ == "__main__":
    main()
