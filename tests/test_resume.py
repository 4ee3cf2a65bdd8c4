"""Resume after a lost rank: examples/train_gpt.py under torchrun --max-restarts 1, one rank SIGKILLed.

Rank 1 kills itself after step 4 of 6 (ZeRO-2 on 2 ranks, a checkpoint every 2 steps: the last
one holds steps 0-3). torchrun restarts both ranks; they load step_000004 and run steps 4 and 5.
Every step's loss (the re-run step 4 included) must equal an uninterrupted run's, bitwise.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6


def _torchrun(tmp, name: str, *args: str) -> dict[int, list[tuple[int, float]]]:
    out = tmp / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args[:2],
           os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", str(STEPS), "--strategy", "zero2",
           "--checkpoint-dir", str(out / "ckpt"), "--losses-out", str(out / "losses.txt"), *args[2:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    by_attempt: dict[int, list[tuple[int, float]]] = {}
    for line in (out / "losses.txt").read_text().split("\n"):
        if line:
            attempt, step, loss = line.split()
            by_attempt.setdefault(int(attempt), []).append((int(step), float.fromhex(loss)))
    return by_attempt


def test_killed_rank_resumes_from_checkpoint_bitwise(tmp_path):
    ref = _torchrun(tmp_path, "uninterrupted", "--max-restarts", "0", "--checkpoint-every", "3")
    run = _torchrun(tmp_path, "killed", "--max-restarts", "1", "--checkpoint-every", "2", "--resume",
                    "--fail-rank", "1", "--fail-after-step", "4")
    assert list(ref) == [0] and [s for s, _ in ref[0]] == list(range(STEPS))
    assert sorted(run) == [0, 1], "the job was not restarted"
    assert [s for s, _ in run[0]] == [0, 1, 2, 3, 4]      # killed after step 4
    assert [s for s, _ in run[1]] == [4, 5]               # resumed at the last checkpoint's data position
    expected = dict(ref[0])
    for attempt in (0, 1):
        for step, loss in run[attempt]:
            assert loss == expected[step], f"attempt {attempt} step {step}: {loss!r} != {expected[step]!r}"
