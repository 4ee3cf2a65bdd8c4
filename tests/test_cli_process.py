"""The CLI's process entry point (autopar.cli.run): it exits with main's code, and only a process
of its own has its garbage collector frozen (an in-process main() leaves the caller's alone)."""

import gc
import subprocess
import sys

from autopar.cli import main


def test_run_exits_with_the_commands_code():
    ok = subprocess.run([sys.executable, "-m", "autopar", "zoo"], capture_output=True, text=True)
    assert ok.returncode == 0 and "gpt2" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "autopar.cli", "plan", "gpt2", "--gpus", "8", "--strategy", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown strategy" in bad.stderr


def test_main_in_process_leaves_the_collector_alone(capsys):
    before = gc.get_freeze_count()
    assert main(["plan", "mlp", "--gpus", "2", "--quiet", "--no-baselines"]) == 0
    assert gc.get_freeze_count() == before
