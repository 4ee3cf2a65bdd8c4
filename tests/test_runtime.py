"""Real multi-process runs (gloo, 4 ranks): the parallel run equals the single-process run
(loss, gradients, parameters after AdamW steps) and sends exactly the bytes the plan predicted."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_cases import EPS, LR, STEPS, build  # noqa: E402

CASES = [
    ("mlp", "dp", None), ("mlp", "zero3", None), ("mlp", "megatron", None), ("mlp", "megatron-dp", None),
    ("mlp", "auto", None),
    ("gpt-tiny", "dp", None), ("gpt-tiny", "zero3", None), ("gpt-tiny", "megatron", None),
    ("gpt-tiny", "megatron-dp", None), ("gpt-tiny", "auto", None),
    ("bert-tiny", "megatron-dp", None), ("hf-gpt2-tiny", "dp", None), ("hf-gpt2-tiny", "megatron", None),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.pt"
    script = os.path.join(os.path.dirname(__file__), "dist_cases.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, script, "4", str(_free_port()), str(out), json.dumps(CASES)],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _reference(name):
    model, inputs = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(*inputs)
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["/".join(str(x) for x in c if x) for c in CASES])
def test_parallel_run_equals_single_process_and_bytes_match_plan(results, case, report_line):
    name, family, mesh = case
    r = results[f"{name}/{family}/{mesh}"]
    assert "error" not in r, r.get("error")
    losses, grads, params = _reference(name)
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for k, g in grads.items():
        torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {k}: {m}")
    for k, p in params.items():
        if k in r["params"]:
            torch.testing.assert_close(r["params"][k], p, rtol=1e-4, atol=2e-5, msg=lambda m: f"param {k}: {m}")
    for step, sent in enumerate(r["sent"]):
        assert sent == pytest.approx(r["predicted"]), (step, sent, r["predicted"])
    report_line(f"runtime {name}/{family}: mesh {r['mesh']}, bytes/step {sum(r['predicted'].values()):,.0f} "
                f"(measured = predicted), loss {r['losses'][-1]:.6f}")
