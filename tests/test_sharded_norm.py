"""Layer norm over a hidden dim split across ranks (Optimus's 2D layer norm, runtime.sharded_norm):
one launch of 4 gloo ranks; every rank's output and input/weight/bias gradient pieces equal the
single-process layer norm's (fp64), and the bytes sent equal cost_model.algorithms' price."""

import os
import sys

import pytest

from autopar.cost_model.algorithms import sharded_norm_steps
from autopar.cost_model.comm import bytes_sent_per_rank

sys.path.insert(0, os.path.dirname(__file__))
from norm_cases import CASES  # noqa: E402


# One case in the session's 4-rank launch (tests/launcher.py).
LAUNCH_CASES = {4: [("norm", "norm_cases:all_cases", {})]}


@pytest.fixture
def results(launched):
    got = launched(4)["norm"]
    assert "error" not in got, got
    return got


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{a}-{'x'.join(map(str, s))}-{'affine' if f else 'plain'}"
                                                          for a, s, f in CASES])
def test_sharded_layer_norm_equals_layer_norm_and_sends_what_is_priced(results, index):
    for rank, per_case in enumerate(results):
        r = per_case[index]
        assert r["out_err"] < 1e-12 and r["grad_err"] < 1e-12, (rank, r)
        # fp64 statistics: 8 bytes per row and value (the cost model's max(elem, 4))
        steps = sharded_norm_steps(r["rows"], 0, 8.0, backward=True)
        want = sum(bytes_sent_per_rank(s.collective, s.nbytes, r["n"]) for s in steps)
        assert r["sent"] == pytest.approx({"all_reduce": want}), (rank, r["sent"], want)
