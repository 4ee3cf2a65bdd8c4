"""autopar.forking: the planner's independent pricings shared with a forked child (share_work, and
SharedQueues over several queues in turn).

Run in a fresh single-threaded interpreter (pytest-xdist workers hold threads, where the planner
never forks), loading the module by path: it imports nothing else, so the check costs no torch
import.
"""

import json
import pathlib
import subprocess
import sys
import textwrap

MODULE = pathlib.Path(__file__).resolve().parents[1] / "autopar" / "forking.py"

CODE = textwrap.dedent("""
    import importlib.util, json, os, sys, threading, time
    spec = importlib.util.spec_from_file_location("forking", sys.argv[1])
    forking = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forking)
    parent = os.getpid()
    items = list(range(7))

    def work(x):
        time.sleep(0.05)  # long enough for the child to start and take its share of the queue
        return (x * x, os.getpid() != parent)

    def uneven(x):  # the first item takes as long as the rest together: whoever takes it takes no other
        time.sleep(0.3 if x == 0 else 0.05)
        return (x, os.getpid())

    def fails_in_child(x):
        if os.getpid() != parent:
            raise RuntimeError("child failure")
        return (x * x, False)

    def queues(fail_in=None):
        # queue 0: 6 quick items; queue 1: 4 slow ones. This process takes from queue 0, collects
        # the child's share of it while the child already works on queue 1, then takes from 1.
        def work(q, x):
            if q == fail_in and os.getpid() != parent:
                raise RuntimeError("child failure")
            time.sleep(0.02 if q == 0 else 0.25)
            return (q, x * 10, os.getpid() != parent)
        shared = forking.SharedQueues([list(range(6)), list(range(4))], work)
        mine0 = {i: work(0, x) for i, x in shared.take(0)}
        t0 = time.perf_counter()
        theirs0 = shared.theirs(0)
        waited0 = time.perf_counter() - t0
        mine1 = {i: work(1, x) for i, x in shared.take(1)}
        theirs1 = shared.theirs(1)
        return dict(q0=[v for _, v in sorted({**mine0, **theirs0}.items())],
                    q1=[v for _, v in sorted({**mine1, **theirs1}.items())], waited0=waited0)

    print(json.dumps(dict(
        safe=forking.fork_is_safe(),
        shared=forking.share_work(items, work, weight=lambda x: 1.0 + x),
        inline=forking.share_work(items, work, fork=False),
        recovered=forking.share_work(items, fails_in_child),
        uneven=forking.share_work(items, uneven, weight=lambda x: 7.0 - x),
        queues=queues(),
        queues_failed=queues(fail_in=1),
        threads_after=forking.fork_is_safe(),
    )))
""")


def test_share_work_splits_keeps_order_and_recovers_from_a_failed_child():
    out = subprocess.run([sys.executable, "-c", CODE, str(MODULE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    squares = [x * x for x in range(7)]
    assert got["safe"], "a fresh single-threaded interpreter on a multi-core machine may fork"
    # the same answers in the same order, part of them computed by the child
    assert [v for v, _ in got["shared"]] == squares
    assert any(child for _, child in got["shared"]) and not all(child for _, child in got["shared"])
    assert got["inline"] == [[v, False] for v in squares]
    # a child that fails leaves its share to this process: still every answer, in order
    assert got["recovered"] == [[v, False] for v in squares]
    # the items go to whichever process is free, heaviest first: the one that took the slow first
    # item took nothing else while the other did the rest
    slow = got["uneven"][0][1]
    assert [x for x, _ in got["uneven"]] == list(range(7))
    assert [pid for _, pid in got["uneven"]].count(slow) == 1
    # no thread left behind, so later work still forks
    assert got["threads_after"]
    # shared queues: every item once, in order, both processes working on each queue; the
    # child's share of queue 0 came back before it finished queue 1 (one slow item is 0.25 s)
    q = got["queues"]
    assert [x for _, x, _ in q["q0"]] == [10 * i for i in range(6)] and [x for _, x, _ in q["q1"]] == [0, 10, 20, 30]
    assert {c for _, _, c in q["q0"]} == {True, False} and {c for _, _, c in q["q1"]} == {True, False}
    assert q["waited0"] < 0.2
    # a child that fails on queue 1 leaves its share there to this process
    failed = got["queues_failed"]
    assert [x for _, x, _ in failed["q1"]] == [0, 10, 20, 30] and not any(c for _, _, c in failed["q1"])
