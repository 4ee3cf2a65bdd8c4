"""Scheduler policies on hand-made workloads whose schedules are known, and the simulator core."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from autopar.scheduler import Allocation, SchedulerError, make_policy, simulate
from autopar.scheduler.cluster import Cluster
from autopar.scheduler.efficiency import EfficiencyError, NoiseScaleEfficiency
from autopar.scheduler.jobs import JobError, JobModel
from autopar.scheduler.optimus import Optimus, fit_speed_model
from autopar.scheduler.registry import PolicyError
from autopar.scheduler.simulator import JobState, View
from autopar.scheduler.tiresias import Tiresias

from scheduler_fixtures import job, job_model, table


def test_single_job_finishes_at_restart_plus_work_over_goodput():
    m = job_model(restart_s=7.0)
    r = simulate([job(0, 5.0, 1000.0, gpus=2)], make_policy("fifo"), m, 8)
    assert r.jct_s[0] == pytest.approx(7.0 + 1000.0)
    assert r.makespan_s == pytest.approx(1007.0)
    assert r.utilization == pytest.approx(2 / 8 * 1000 / 1007)


def test_fifo_blocks_behind_the_head_and_tiresias_demotes_the_long_job():
    """A 10-hour 4-GPU job holds a 4-GPU cluster; a 10-minute 4-GPU job arrives at 2 h. FIFO makes
    it wait for the long job; Tiresias has demoted the long job (28,800 GPU-s > 3,600) and runs the
    short one first, preempting the long one, which resumes after it."""
    m = job_model(restart_s=0.0)
    jobs = [job(0, 0.0, 36000.0, gpus=4), job(1, 7200.0, 600.0, gpus=4)]
    fifo = simulate(jobs, make_policy("fifo"), m, 4, devices_per_node=4)
    assert fifo.jct_s[1] == pytest.approx(36000.0 - 7200.0 + 600.0)
    tir = simulate(jobs, make_policy("tiresias"), m, 4, devices_per_node=4)
    assert tir.jct_s[1] == pytest.approx(600.0, abs=61.0)  # starts within one 60 s round of arriving
    assert tir.jct_s[0] > 36000.0 + 600.0 - 1
    assert tir.restarts == 1
    assert Tiresias().queue(0.0) == 0 and Tiresias().queue(28800.0) == 1


def _view(states, total, m):
    return View(0.0, tuple(states), total, 8, m)


def test_optimus_gives_the_next_gpus_to_the_largest_marginal_gain():
    m = job_model()
    # a job that scales (linear) and one that does not (flat), same remaining time at 1 GPU
    lin, fl = JobState(job(0, 0, 1000.0, 1, "lin")), JobState(job(1, 0, 1000.0, 1, "flat"))
    out = Optimus().schedule(_view([lin, fl], 4, m))
    assert out == {0: Allocation(2, 8), 1: Allocation(1, 8)}  # flat gains nothing; lin's next doubling needs 2
    # two scaling jobs: the one with more remaining work saves more time per GPU added
    a, b = JobState(job(0, 0, 1000.0, 1)), JobState(job(1, 0, 4000.0, 1))
    out = Optimus().schedule(_view([a, b], 3, m))  # one spare GPU after the first one each
    assert out[1].gpus == 2 and out[0].gpus == 1
    assert all(al.batch == 8 for al in out.values())  # Optimus keeps the requested batch


def test_optimus_fits_the_speed_model():
    ns = [1, 2, 4, 8, 16]
    a, c, d = fit_speed_model(ns, [2.0 / n + 0.5 + 0.1 * n for n in ns])
    assert (a, c, d) == pytest.approx((2.0, 0.5, 0.1), rel=1e-6)
    a, c, d = fit_speed_model(ns, [3.0 / n for n in ns])
    assert (a, c, d) == pytest.approx((3.0, 0.0, 0.0), abs=1e-9)


def _allocations(view, out):
    return {st.job.job_id: (st.alloc, st.job) for st in view.jobs}, out, view.total_gpus


def _who_runs(view, out):
    return view.now, {st.job.job_id for st in view.jobs}, set(out)


@dataclass
class _Recorder:
    """Wraps a policy; records ``what(view, decisions)`` of every round (by default the view's
    allocations before, the decisions and the cluster size)."""

    inner: object
    what: object = _allocations
    rounds: list = field(default_factory=list)

    @property
    def name(self):
        return self.inner.name

    @property
    def interval_s(self):
        return self.inner.interval_s

    def schedule(self, view):
        out = self.inner.schedule(view)
        self.rounds.append(self.what(view, out))
        return out


def _workload():
    return [job(0, 0, 3000.0, 2), job(1, 100, 400.0, 1), job(2, 200, 8000.0, 4, max_gpus=8),
            job(3, 250, 600.0, 1, "flat"), job(4, 900, 1500.0, 8, max_gpus=8)]


def test_ones_never_exceeds_the_cluster_and_follows_its_scaling_rules():
    m = job_model(restart_s=5.0, noise_scale_ratio=4.0)
    rec = _Recorder(make_policy("ones", seed=3))
    result = simulate(_workload(), rec, m, 8)
    assert len(result.jct_s) == 5
    grew = False
    for before, out, total in rec.rounds:
        assert sum(a.gpus for a in out.values()) <= total
        for jid, a in out.items():
            cur, j = before[jid]
            assert a.gpus & (a.gpus - 1) == 0 and a.gpus <= j.max_gpus
            assert a.batch == min(j.per_gpu_batch * a.gpus, j.max_batch)  # per-GPU batch x GPUs, capped
            if cur is None:
                assert a.gpus <= j.requested_gpus  # (re)starts at most at its request
            else:
                assert cur.gpus // 2 <= a.gpus <= 2 * cur.gpus  # doubles or halves at most per round
                grew |= a.gpus > cur.gpus
    assert grew  # it does resize jobs


def test_ones_scales_a_lone_job_up_by_doubling_and_beats_its_static_run():
    m = job_model(restart_s=1.0)
    rec = _Recorder(make_policy("ones"))
    ones = simulate([job(0, 0, 20000.0, 1, max_gpus=8)], rec, m, 8)
    sizes = [out[0].gpus for _, out, _ in rec.rounds if 0 in out]
    assert sizes[:4] == [1, 2, 4, 8]
    fifo = simulate([job(0, 0, 20000.0, 1, max_gpus=8)], make_policy("fifo"), m, 8)
    assert ones.jct_s[0] < 0.3 * fifo.jct_s[0]


def test_policies_are_deterministic_per_seed():
    m = job_model(restart_s=5.0, noise_scale_ratio=4.0)
    for name in ("fifo", "tiresias", "optimus", "ones", "pollux"):
        a = simulate(_workload(), make_policy(name, seed=1), m, 8)
        b = simulate(_workload(), make_policy(name, seed=1), m, 8)
        assert a.jct_s == b.jct_s and a.restarts == b.restarts, name


def test_simulator_refuses_an_overcommitting_policy():
    @dataclass
    class Greedy:
        name: str = "greedy"
        interval_s: float | None = None

        def schedule(self, view):
            return {st.job.job_id: Allocation(8, 8) for st in view.jobs}

    with pytest.raises(SchedulerError, match="allocated 16 GPUs on a cluster of 8"):
        simulate([job(0, 0, 10.0), job(1, 0, 10.0)], Greedy(), job_model(), 8)
    with pytest.raises(SchedulerError, match="requests 16 GPUs"):
        simulate([job(0, 0, 10.0, 16)], make_policy("fifo"), job_model(), 8)
    with pytest.raises(PolicyError, match="unknown policy 'onez'"):
        make_policy("onez")


def test_table_interpolates_batches_and_refuses_what_does_not_fit():
    t = table({"m": lambda n, b: 0.1 + 0.01 * b / n}, batches=(8, 32))
    p = t.model("m")
    assert p.step_seconds(2, 16) == pytest.approx(0.1 + 0.01 * 16 / 2)  # affine in the batch: exact
    assert math.isinf(p.step_seconds(2, 64))  # beyond the largest planned batch
    assert math.isinf(p.step_seconds(32, 64))  # an unplanned GPU count
    assert p.samples_per_second(3, 8) == 0.0


def test_noise_scale_efficiency():
    e = NoiseScaleEfficiency(4.0)
    assert e.efficiency(64, 64) == 1.0
    assert e.efficiency(128, 64) == pytest.approx((256 + 64) / (256 + 128))
    assert e.efficiency(512, 64) < e.efficiency(256, 64) < 1
    assert e.learning_rate(1e-3, 256, 64, 128) == pytest.approx(2e-3)
    with pytest.raises(EfficiencyError):
        NoiseScaleEfficiency(0.0)


def test_placement_best_fit_then_span():
    c = Cluster.with_gpus(16)
    assert c.place(4) == ((0, 4),)
    assert c.place(2) == ((0, 2),)  # the fuller node that still fits
    assert c.place(8) == ((1, 8),)
    assert c.place(2) == ((0, 2),)
    c2 = Cluster(2, 8, [3, 3])
    assert sorted(c2.place(4)) == [(0, 3), (1, 1)]  # no node holds 4: the job spans


def test_pollux_picks_the_goodput_maximizing_batch():
    """A fixed 50 ms per step makes larger batches faster per sample; whether Pollux takes them
    depends on the statistical efficiency (the noise scale)."""
    from autopar.scheduler.pollux import Pollux

    fns = {"lin": lambda n, b: 0.05 + 0.01 * b / n}
    st = JobState(job(0, 0, 1000.0, 1, batch_cap=8))
    big = Pollux().schedule(_view([st], 1, job_model(fns, noise_scale_ratio=1e9)))
    assert big == {0: Allocation(1, 64)}  # efficiency ~1: the cap
    small = Pollux().schedule(_view([st], 1, job_model(fns, noise_scale_ratio=0.01)))
    assert small == {0: Allocation(1, 8)}  # efficiency falls as 1/batch: the base batch
    two = Pollux().schedule(_view([st, JobState(job(1, 5, 1000.0, 1))], 3, job_model(fns, noise_scale_ratio=1e9)))
    assert sorted(a.gpus for a in two.values()) == [1, 2]  # both run; the spare GPU doubles one



def _longest_wait(rounds, job_id: int) -> float:
    """Longest time from a round that left ``job_id`` waiting to the round that gave it GPUs again
    (or to the last round, if it never got them back)."""
    longest, since = 0.0, None
    for now, active, running in rounds:
        if job_id in active and job_id not in running:
            since = now if since is None else since
        elif since is not None:
            longest, since = max(longest, now - since), None
    if since is not None:
        longest = max(longest, rounds[-1][0] - since)
    return longest


def test_tiresias_promotes_a_starving_job():
    """A 4-GPU cluster: a long 4-GPU job (5,000 s alone) is demoted after 900 s (3,600 GPU-s); from
    1,000 s a stream of twenty 10-minute 4-GPU jobs keeps queue 0 busy until 13,000 s. Without the
    guard the long job waits all of it (12,000 s); with a 3,000 s starve limit it is promoted back to
    queue 0 within one 60 s round of waiting 3,000 s, holds the GPUs until it has 3,600 GPU-s anew
    (900 s), and so on; the short jobs still all finish."""
    m = job_model(restart_s=0.0)
    jobs = [job(0, 0.0, 5000.0, gpus=4)] + [job(k + 1, 1000.0 + 500.0 * k, 600.0, gpus=4) for k in range(20)]
    plain = _Recorder(Tiresias(starve_limit_s=None), _who_runs)
    starved = simulate(jobs, plain, m, 4, devices_per_node=4)
    assert _longest_wait(plain.rounds, 0) >= 11_900.0
    guarded = _Recorder(Tiresias(starve_limit_s=3000.0), _who_runs)
    res = simulate(jobs, guarded, m, 4, devices_per_node=4)
    assert 3000.0 < _longest_wait(guarded.rounds, 0) <= 3000.0 + 60.0
    assert sorted(res.jct_s) == list(range(21)) and sorted(starved.jct_s) == list(range(21))
    back = {name: next(now for now, _, running in rec.rounds if now > 1000.0 and 0 in running)
            for name, rec in (("plain", plain), ("guarded", guarded))}
    assert back["plain"] >= 12_900.0 and back["guarded"] <= 1000.0 + 3000.0 + 120.0
    # once promoted it runs at least until it has earned a demotion again (3,600 GPU-s = 900 s)
    runs = [now for now, active, running in guarded.rounds if 0 in running]
    first_back = back["guarded"]
    assert all(t in runs for t in [now for now, _, _ in guarded.rounds if first_back <= now < first_back + 840.0])


def test_launch_stop_and_exit_costs_are_charged_where_the_controller_pays_them():
    """The real run's costs in the job model: a 4-GPU 10-hour job and a 10-minute one arriving at
    2 h (Tiresias preempts the long one). Launch: 3 s + 1 s per process alive (4 ranks + 1 launcher); a
    stop (checkpoint, exit) takes 5 s and the round's launches wait for it; a job is gone 2 s after
    its last step."""
    m = job_model(restart_s=3.0)
    m.launch_s_per_process, m.stop_s, m.exit_s = 1.0, 5.0, 2.0
    jobs = [job(0, 0.0, 36000.0, gpus=4), job(1, 7200.0, 600.0, gpus=4)]
    r = simulate(jobs, make_policy("tiresias"), m, 4, devices_per_node=4)
    assert r.jct_s[1] == pytest.approx(5.0 + (3.0 + 5.0) + 600.0 + 2.0)
    move = 2 * 12e6 / 4 / 1e9  # the checkpoint over the host link, out and back
    done_first = 7200.0 - 8.0
    assert r.jct_s[0] == pytest.approx(7815.0 + 8.0 + move + 36000.0 - done_first + 2.0)
    # a job preempted while still starting up (launch 996 + 5 x 1 s, demoted at 900 s) has nothing to
    # save: the 1-GPU job that takes its place launches at once (996 + 2 x 1 s), no stop wait
    m.restart_overhead_s = 996.0
    r = simulate([job(0, 0.0, 36000.0, gpus=4), job(1, 950.0, 600.0, gpus=1)], make_policy("tiresias"), m, 4,
                 devices_per_node=4)
    assert r.jct_s[1] == pytest.approx(998.0 + 600.0 + 2.0)
    with pytest.raises(JobError, match="stop_s"):
        JobModel(m.table, stop_s=-1.0)


def test_a_job_exiting_when_its_allocation_changes_is_gone_at_its_finish_not_relaunched():
    """Job 0 (2 GPUs, 100 s) has done its last step at 100 s and exits until 105 s; job 1 arrives
    at 101 s and the policy gives job 0 one GPU and job 1 two. As in the real controller, job 0 is
    not stopped or relaunched (it finishes at 105 s), and job 1 launches once it is gone, with only
    its own 2 ranks and launcher alive: 3 s + 3 x 1 s."""

    @dataclass
    class Reshuffle:
        name: str = "reshuffle"
        interval_s: float | None = None

        def schedule(self, view):
            ids = {st.job.job_id for st in view.jobs}
            out = {1: Allocation(2, 16)} if 1 in ids else {}
            if 0 in ids:
                out[0] = Allocation(1 if 1 in ids else 2, 16)
            return out

    m = job_model(restart_s=3.0)
    m.launch_s_per_process, m.stop_s, m.exit_s = 1.0, 7.0, 5.0
    r = simulate([job(0, -6.0, 100.0, gpus=2), job(1, 101.0, 50.0, gpus=2)], Reshuffle(), m, 4,
                 devices_per_node=4)
    assert r.jct_s[0] == pytest.approx(6.0 + 100.0 + 5.0)  # launch 3 + 3 x 1 s, 100 s of work, exit
    assert r.jct_s[1] == pytest.approx(105.0 - 101.0 + 6.0 + 50.0 + 5.0)
    assert r.restarts == 0


def test_jobs_on_cpu_slots_sharing_cores_slow_each_other_down():
    """Two 2-slot jobs (100 s and 50 s alone) start together on 4 slots sharing 2 cores: 4 ranks
    train at once, each at half a core, so both step at half their alone speed until the short
    one is done (its 50 s of work takes 100 s); the long one then has 50 s of work left, alone
    (2 ranks, 2 cores). Unshared (GPUs, the default) each runs at its table speed."""
    jobs = [job(0, 0.0, 100.0, gpus=2), job(1, 0.0, 50.0, gpus=2)]
    m = job_model()
    assert m.contention(2, 4) == 1.0
    r = simulate(jobs, make_policy("fifo"), m, 4, devices_per_node=4)
    assert r.jct_s == pytest.approx({0: 100.0, 1: 50.0})
    m.shared_cores = 2.0
    assert [m.contention(n, busy) for n, busy in ((1, 1), (1, 2), (1, 4), (2, 4), (4, 4), (1, 3))] == \
        [1.0, 1.0, 2.0, 2.0, 1.0, 1.5]  # 4 ranks of one job on 2 cores: its table time is already shared
    r = simulate(jobs, make_policy("fifo"), m, 4, devices_per_node=4)
    assert r.jct_s == pytest.approx({0: 150.0, 1: 100.0})
    with pytest.raises(JobError, match="shared_cores"):
        JobModel(m.table, shared_cores=-2.0)
