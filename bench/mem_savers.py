"""Memory savers, predicted next to measured: recompute none / selective / full, offload off / on.

Runs the cases of ``tests/mem_cases.py`` on 4 gloo ranks in one launch (tiny GPT under
Megatron-DP, a tiny Hugging Face Llama under data parallelism, ZeRO-3 GPT with
offload and none / selective / full recompute; fp32, 3 AdamW
steps) and prints, per rank 0, what the plan predicts and what ``bench/memtrack.py`` measured
on the second step (the optimizer state exists by then):

* activations: the plan's activation bytes (with recompute: what the forward keeps plus one
  block's recomputed activations) vs the live bytes the forward leaves for backward;
* device state: parameters + gradients + device-side optimizer state (the gradient buckets the
  runtime keeps, ``runtime/grad_buckets.py``, are predicted apart; the run counts them in the peak);
* host: the offloaded master, moments and gradient buffer (counted as host, not device);
* peak: the plan's step peak per device (``cost_model/liveness.py``) vs the whole step's measured
  device peak;
* and each saver's fall from its baseline (recompute none, offload off), predicted vs measured.

    python bench/mem_savers.py            # ~5 min on an idle 2-core machine
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from launcher import launch  # noqa: E402
from mem_cases import case_key  # noqa: E402

MEG = {"strategy": "megatron-dp"}
CASES = [("gpt-tiny", dict(MEG, recompute=rc)) for rc in ("none", "selective", "full")] + \
        [("hf-llama-tiny", {"strategy": "dp", "recompute": rc}) for rc in ("none", "selective", "full")] + \
        [("gpt-tiny", dict(MEG, recompute="none", offload=True)),
         ("gpt-tiny", {"strategy": "zero3", "recompute": "none"}),
         ("gpt-tiny", {"strategy": "zero3", "recompute": "none", "offload": True}),
         ("gpt-tiny", {"strategy": "zero3", "recompute": "selective"}),
         ("gpt-tiny", {"strategy": "zero3", "recompute": "full"})]
# (saver, baseline) pairs whose fall is compared
FALLS = [(CASES[1], CASES[0]), (CASES[2], CASES[0]), (CASES[4], CASES[3]), (CASES[5], CASES[3]),
         (CASES[6], CASES[0]), (CASES[8], CASES[7]), (CASES[9], CASES[7]), (CASES[10], CASES[7])]


def _run() -> dict:
    """Every case on 4 gloo ranks in one launch (tests/launcher.py)."""
    cases = [(case_key(c), "mem_cases:case", {"name": c[0], "options": c[1]}) for c in CASES]
    return launch(4, cases, tempfile.mkdtemp(), env={"PYTHONWARNINGS": "ignore"})


def _kb(x: float) -> str:
    return f"{x / 1024:,.0f}"


def main() -> None:
    r = _run()
    print("| case | activations pred / meas KiB | device state pred / meas KiB | buckets pred KiB "
          "| host pred / meas KiB | step peak pred / meas KiB | meas / pred |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        v = r[case_key(case)]
        if "error" in v:
            print(f"| {case_key(case)} | error: {v['error']} | | | |")
            continue
        print(f"| {case_key(case)} | {_kb(v['predicted_activation_bytes'])} / {_kb(v['kept_bytes'])} "
              f"| {_kb(v['predicted_device_state_bytes'])} / {_kb(v['device_state_bytes'])} "
              f"| {_kb(v.get('predicted_bucket_bytes', 0))} "
              f"| {_kb(v['predicted_host_bytes'])} / {_kb(v['host_bytes'])} "
              f"| {_kb(v['predicted_peak_bytes'])} / {_kb(v['step_peak_bytes'])} "
              f"| {v['step_peak_bytes'] / v['predicted_peak_bytes']:.2f} |")
    print()
    print("| saver vs baseline | device peak fall pred KiB | meas KiB | meas / pred |")
    print("|---|---|---|---|")
    for saver, base in FALLS:
        s, b = r[case_key(saver)], r[case_key(base)]
        if "error" in s or "error" in b:
            continue
        pred = b["predicted_peak_bytes"] - s["predicted_peak_bytes"]
        meas = b["step_peak_bytes"] - s["step_peak_bytes"]
        print(f"| {case_key(saver)} vs {case_key(base)} | {_kb(pred)} | {_kb(meas)} | "
              f"{meas / pred if pred else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
