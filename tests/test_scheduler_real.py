"""The real run's resize path: one job trained on 2, then 1, then 4 gloo ranks through its
checkpoint follows the loss trajectory of the same job trained alone in one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from autopar.scheduler.elastic_worker import build, make_batch
from autopar.scheduler.real_run import read_steps

STEPS, BATCH, SEED = 9, 8, 5


def _alone() -> list[float]:
    model = build(SEED, BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(STEPS):
        loss = model(*make_batch(SEED, step, BATCH))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.slow
def test_job_resized_through_its_checkpoint_matches_the_job_alone(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for world, pause in ((2, 3), (1, 6), (4, None)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), "-m",
               "autopar.scheduler.elastic_worker", "--job-dir", str(tmp_path), "--steps", str(STEPS),
               "--batch", str(BATCH), "--seed", str(SEED)] + (["--pause-at", str(pause)] if pause else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = read_steps(tmp_path)
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["world"] for s in steps] == [2] * 3 + [1] * 3 + [4] * 3  # three sizes really ran
    torch.testing.assert_close(torch.tensor([s["loss"] for s in steps]), torch.tensor(_alone()),
                               rtol=1e-5, atol=1e-6)
