"""The shared multi-process test launcher: many cases on N gloo ranks in ONE launch.

Starting N ranks (spawn, import torch and autopar, join a gloo group) costs ~10 s at 8 ranks on
two cores, far more than most cases take. So every multi-process test in the suite describes its
work as *cases*, and one launch per world size runs all of them, whichever test files they come
from.

A case is ``(key, "module:function", kwargs)``. The function runs on every rank as
``function(rank, world, **kwargs)`` after the gloo group is up, and returns a picklable value;
rank 0's return value is the case's result (a case that needs every rank's figures gathers them
itself, e.g. with ``dist.all_gather_object``). ``module`` is imported on the ranks by name, with
``tests/`` and the repository root on ``sys.path``; kwargs must pickle.

Per case, the launcher: runs it on every rank, catching its exception; gathers the ranks' errors
(this doubles as the barrier between cases), so a case that failed on any rank reads
``{"error": "rank R: Type: message\\ntraceback"}`` and the next case still runs; rank 0 saves
all results when the launch ends (also after a crash of a later case). A case that leaves its
peers inside a collective fails them after ``timeout_s`` (gloo's timeout) instead of hanging.
Rendezvous goes through a FileStore in the launch's own directory: no TCP port to pick, so
launches of several test runs on one machine cannot collide.

Two ways in:

* ``launch(world, cases, workdir)`` runs one launch now and returns ``{key: result}``;
* from pytest (``tests/conftest.py``), a test module declares::

      LAUNCH_CASES = {4: [("mlp/dp", "dist_cases:case", {"name": "mlp", "family": "dp"}), ...],
                      8: [...]}
      LAUNCH_ORDER = (4, 2, 8)   # optional: launches that must finish before a later world's
                                 # (checkpoints saved at 4 ranks, loaded at 2 and 8)

  and its tests take the ``launched`` fixture: ``launched(4)`` returns this module's results at
  4 ranks, keyed by its own keys. The first call for a world launches the cases of EVERY
  collected module for that world, once per session (``Launches``); modules' keys do not clash
  (they are kept apart by module name). Deselected modules (``-k``, a single file) are not
  launched. Each launch's case count and seconds are printed in the run's closing summary.

Cases share the ranks' processes, one after another: a case must not leave process state behind
that changes a later one (default dtype, a global mode, an unreleased process group it needs
to be the only one). ``scratch_dir()`` is a directory all ranks and cases of a session share
(for files one launch writes and a later one reads).
"""

from __future__ import annotations

import datetime
import importlib
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Case", "Launches", "launch", "run_cases", "scratch_dir", "slowest"]

Case = tuple[str, str, dict]  # (key, "module:function", kwargs)

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
SCRATCH_ENV = "AUTOPAR_TEST_SCRATCH"
SECONDS_FILE = "case_seconds.tsv"  # per launch, next to its results: seconds<TAB>key per case


def scratch_dir() -> str:
    """The directory the launch's ranks (and the session's later launches) share."""
    return os.environ[SCRATCH_ENV]


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def run_cases(rank: int, world: int, cases: Iterable[Case], seconds_path: str | None = None) -> dict[str, Any]:
    """Run each case on this rank (the gloo group is up); every rank learns every case's errors.
    With ``seconds_path``, rank 0 appends ``seconds<TAB>key`` per case there (what each case costs)."""
    import torch.distributed as dist

    results: dict[str, Any] = {}
    for key, target, kwargs in cases:
        start = time.perf_counter()
        try:
            value, error = _resolve(target)(rank, world, **kwargs), None
        except Exception as exc:  # reported per case by the test, with its rank
            value, error = None, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            print(f"[launcher] {key}: {error}", file=sys.stderr, flush=True)
        errors: list = [None] * world
        dist.all_gather_object(errors, error)
        failed = [e for e in errors if e is not None]
        results[key] = {"error": "\n".join(failed)} if failed else value
        if seconds_path is not None and rank == 0:
            with open(seconds_path, "a") as f:
                f.write(f"{time.perf_counter() - start:.2f}\t{key}\n")
    return results


def _rank_main(rank: int, world: int, store_path: str, cases_path: str, out_path: str, timeout_s: float) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results: dict[str, Any] = {}
    try:
        results = run_cases(rank, world, torch.load(cases_path, weights_only=False),
                            os.path.join(os.path.dirname(out_path), SECONDS_FILE))
    finally:
        if rank == 0:
            torch.save(results, out_path)
        dist.destroy_process_group()


def launch(world: int, cases: list[Case], workdir: str | os.PathLike, *, scratch: str | None = None,
           timeout_s: float = 300.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cases`` on ``world`` gloo ranks in one launch; ``{key: rank 0's result or {"error": ...}}``.

    ``workdir`` (empty, per launch) holds the rendezvous file and the results; ``scratch`` is the
    shared directory ``scratch_dir()`` returns on the ranks (default: ``workdir``)."""
    keys = [key for key, _, _ in cases]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate case keys in one launch: {sorted(k for k in keys if keys.count(k) > 1)}")
    workdir = os.fspath(workdir)
    cases_path, out_path = os.path.join(workdir, "cases.pt"), os.path.join(workdir, "results.pt")
    torch.save(list(cases), cases_path)
    run_env = dict(os.environ, **(env or {}), OMP_NUM_THREADS="1", **{SCRATCH_ENV: scratch or workdir})
    run_env["PYTHONPATH"] = os.pathsep.join([TESTS, ROOT, run_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, os.path.abspath(__file__), str(world), os.path.join(workdir, "store"), cases_path, out_path,
           str(timeout_s)]
    # The whole launch may take one gloo timeout per case at worst; the cap only catches a hang.
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=timeout_s * 4 + 60 * len(cases))
    if not os.path.exists(out_path):
        raise RuntimeError(f"launch of {len(cases)} cases on {world} ranks died (exit {proc.returncode}):\n"
                           f"{proc.stderr[-6000:]}")
    results = torch.load(out_path, weights_only=False)
    for key in keys:  # a rank crashed mid-launch: rank 0 saved what it had
        results.setdefault(key, {"error": f"not run: the launch ended early (exit {proc.returncode}):\n"
                                          f"{proc.stderr[-4000:]}"})
    return results


def slowest(workdir: str, n: int = 5) -> str:
    """The ``n`` slowest cases of the launch in ``workdir`` (from its case_seconds.tsv)."""
    path = os.path.join(workdir, SECONDS_FILE)
    if not os.path.exists(path):
        return "n/a"
    with open(path) as f:
        rows = sorted((float(sec), key) for sec, key in (line.rstrip("\n").split("\t", 1) for line in f if line.strip()))
    return ", ".join(f"{key} {sec:.1f} s" for sec, key in rows[::-1][:n])


class Launches:
    """A pytest session's launches: ``results(module, world)`` launches every collected module's
    cases for ``world`` at the first request (after the worlds ``LAUNCH_ORDER`` puts first)."""

    def __init__(self, modules: Iterable, root: str | os.PathLike):
        self.root = os.fspath(root)
        self.scratch = os.path.join(self.root, "scratch")
        os.makedirs(self.scratch, exist_ok=True)
        self.cases: dict[int, list[Case]] = {}
        self.order: list[int] = []
        for module in sorted(set(modules), key=lambda m: m.__name__):
            for world in getattr(module, "LAUNCH_ORDER", ()):
                if world not in self.order:
                    self.order.append(world)
            for world, cases in module.LAUNCH_CASES.items():
                self.cases.setdefault(world, []).extend((f"{module.__name__}::{k}", t, kw) for k, t, kw in cases)
        self.done: dict[int, dict[str, Any]] = {}
        self.failed: dict[int, str] = {}
        self.summary: list[str] = []

    def _run(self, world: int) -> dict[str, Any]:
        if world in self.failed:
            raise RuntimeError(self.failed[world])
        if world not in self.done:
            for before in self.order[: self.order.index(world)] if world in self.order else []:
                self._run(before)
            workdir = os.path.join(self.root, f"world{world}")
            os.makedirs(workdir)
            start = time.perf_counter()
            try:
                self.done[world] = launch(world, self.cases.get(world, []), workdir, scratch=self.scratch)
            except Exception as exc:
                self.failed[world] = str(exc)
                raise
            files = len({k.split("::")[0] for k, _, _ in self.cases.get(world, [])})
            self.summary.append(f"launch of {world} ranks: {len(self.cases.get(world, []))} cases from {files} test "
                                f"files in {time.perf_counter() - start:.1f} s; slowest: {slowest(workdir)}")
        return self.done[world]

    def results(self, module, world: int) -> dict[str, Any]:
        """``module``'s results at ``world`` ranks, keyed by the module's own keys."""
        prefix = f"{module.__name__}::"
        return {k[len(prefix):]: v for k, v in self._run(world).items() if k.startswith(prefix)}


if __name__ == "__main__":
    import torch.multiprocessing as mp

    n, store_file, cases_file, out_file, timeout = sys.argv[1:6]
    mp.spawn(_rank_main, args=(int(n), store_file, cases_file, out_file, float(timeout)), nprocs=int(n))
