"""What one multi-process test launch costs before any case runs: spawn N ranks, import torch,
join a gloo group, run one no-op case, save, exit (tests/launcher.py). The suite ran 16 such
launches before the shared launcher and runs 3 now (one per world size: 2, 4, 8).

    python bench/launch_overhead.py --repeats 3

Prints the median seconds per world size. On a shared machine, compare figures of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from launcher import launch  # noqa: E402


def noop(rank: int, world: int) -> int:
    return rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", default="2,4,8")
    args = parser.parse_args()
    here = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}  # the ranks import noop from here
    for world in (int(w) for w in args.worlds.split(",")):
        seconds = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                got = launch(world, [("noop", "launch_overhead:noop", {})], tmp, env=here)
                seconds.append(time.perf_counter() - start)
                assert got == {"noop": 0}, got
        print(f"{world} ranks: median {statistics.median(seconds):.1f} s per launch "
              f"({', '.join(f'{s:.1f}' for s in seconds)})", flush=True)


if __name__ == "__main__":
    main()
