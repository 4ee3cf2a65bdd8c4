"""The shared launcher (tests/launcher.py) itself: cases run on every rank of one gloo group,
rank 0's value comes back, and a case that fails on one rank is reported with that rank while
the next case still runs. Its cases ride in the session's 2-rank launch (no launch of its own)."""

import torch
import torch.distributed as dist

LAUNCH_CASES = {2: [("sum", "test_launcher:all_reduce_rank", {"scale": 3}),
                    ("fails-on-1", "test_launcher:fail_on", {"bad_rank": 1}),
                    ("after", "test_launcher:all_reduce_rank", {"scale": 1})]}


def all_reduce_rank(rank: int, world: int, scale: int) -> dict:
    t = torch.tensor([float(rank * scale)])
    dist.all_reduce(t)
    return dict(rank=rank, world=world, total=t.item())


def fail_on(rank: int, world: int, bad_rank: int) -> str:
    if rank == bad_rank:
        raise ValueError(f"case failed on purpose on rank {rank}")
    return "ok"


def test_cases_run_on_every_rank_and_rank_0_reports(launched):
    got = launched(2)
    assert got["sum"] == dict(rank=0, world=2, total=3.0)  # 0*3 + 1*3: both ranks took part
    assert got["after"] == dict(rank=0, world=2, total=1.0)


def test_a_failing_rank_is_reported_per_case(launched):
    error = launched(2)["fails-on-1"]["error"]
    assert error.startswith("rank 1: ValueError: case failed on purpose on rank 1"), error
