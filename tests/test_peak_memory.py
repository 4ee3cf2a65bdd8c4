"""Peak memory the plan predicts vs the run, for the plans whose peak falls in the language
model head's backward: a GPT whose logits (16 x 32 x 2048) outweigh its hidden states, as in
real language models, under data parallelism, ZeRO-2, Megatron 1D (the head's all-to-all),
Megatron x dp and SUMMA 2D. The run is measured as tests/mem_cases.py does (bench/memtrack.py:
live tensor bytes, second step, the whole step's peak on rank 0; the runtime's fused AdamW).

The walk (cost_model/liveness.py) counts the gradients in flight while the head's backward
runs (cost_model/grad_transients.py): the cross-entropy's backward holds its saved
log-probabilities, their gradient and the logits' gradient at once. Without that term these
plans measure 1.2-1.4x their prediction (bench/memwhere.py shows the groups at the peak).
The cases run in the session's shared 4-rank launch (tests/launcher.py).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mem_cases import case_key  # noqa: E402

CASES = [("gpt-vocab", {"strategy": s, "recompute": "none"}) for s in ("dp", "zero2", "megatron", "megatron-dp", "2d")]
LAUNCH_CASES = {4: [(case_key(c), "mem_cases:case", {"name": c[0], "options": c[1]}) for c in CASES]}


@pytest.fixture
def results(launched):
    return launched(4)


@pytest.mark.parametrize("case", CASES, ids=[case_key(c) for c in CASES])
def test_step_peak_within_10_percent_of_the_plan(results, case, report_line):
    r = results[case_key(case)]
    assert "error" not in r, r["error"]
    ratio = r["step_peak_bytes"] / r["predicted_peak_bytes"]
    report_line(f"step peak {case_key(case)} ({r['mesh']}): measured {r['step_peak_bytes']:,.0f} B, predicted "
                f"{r['predicted_peak_bytes']:,.0f} B ({ratio:.2f})")
    assert abs(ratio - 1) <= 0.10, (r["step_peak_bytes"], r["predicted_peak_bytes"])
