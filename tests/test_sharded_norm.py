"""Layer norm over a hidden dim split across ranks (Optimus's 2D layer norm, runtime.sharded_norm):
one launch of 4 gloo ranks; every rank's output and input/weight/bias gradient pieces equal the
single-process layer norm's (fp64), and the bytes sent equal cost_model.algorithms' price."""

import os
import subprocess
import sys

import pytest
import torch

from autopar.cost_model.algorithms import sharded_norm_steps
from autopar.cost_model.comm import bytes_sent_per_rank

sys.path.insert(0, os.path.dirname(__file__))
from norm_cases import CASES  # noqa: E402
from test_runtime import _free_port  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("norm") / "results.pt"
    script = os.path.join(os.path.dirname(__file__), "norm_cases.py")
    proc = subprocess.run([sys.executable, script, "4", str(_free_port()), str(out)], capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


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
