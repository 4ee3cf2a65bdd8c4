"""Measuring for ``autopar calibrate`` (``autopar/calibrate.py`` fits and writes the profile):
timing loops, device rates, collective times over message sizes, and the local ranks spawned
when there is no ``torchrun``. Every function here runs on the ranks; nothing fits or prints a
summary.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import AutoparError
from .calibrate_reference import time_reference_step
from .optim.cpu_kernels import adam_step

__all__ = ["CalibrationError", "measure_device", "pin_to_core", "rank_measure", "spawn_ranks"]


class CalibrationError(AutoparError):
    """Calibration could not measure or fit something; the message says what to change."""


# Message sizes in bytes per rank (all-reduce: the tensor; all-gather: the gathered output).
# CPU stops at 8 MiB: above ~16 MiB gloo's all-gather on loopback ran 2-4x slower than its
# ring formula (4 ranks, 2 cores: 32 MiB took ~2x the all-reduce, where the ring says 1/2),
# which would drag the fit away from the small messages a CPU-sized plan actually sends.
_SIZES_CPU = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)
_SIZES_CPU_QUICK = (4 << 10, 256 << 10, 4 << 20)
_SIZES_CUDA = (64 << 10, 1 << 20, 16 << 20, 128 << 20, 512 << 20)
_SIZES_CUDA_QUICK = (64 << 10, 4 << 20, 128 << 20)


def _sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _seconds_per_call(fn: Callable[[], Any], sync: Callable[[], None], window_s: float, batch: int = 1) -> float:
    """Run ``fn`` in batches until ``window_s`` has passed; seconds per call (after one warm-up)."""
    fn()
    sync()
    calls, t0 = 0, time.perf_counter()
    while True:
        for _ in range(batch):
            fn()
        sync()
        calls += batch
        elapsed = time.perf_counter() - t0
        if elapsed >= window_s:
            return elapsed / calls


def _matmul_flops(n: int, dtype: torch.dtype, device: torch.device, sync: Callable[[], None],
                  window_s: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _seconds_per_call(lambda: torch.mm(a, b), sync, window_s)


def _adamw_params_per_s(device: torch.device, sync: Callable[[], None], window_s: float) -> float:
    """Parameter elements per second the AdamW that ``autopar.make_optimizer`` builds updates:
    torch's fused kernel (one pass over weights, gradients and moments, no temporaries: what the
    memory walk assumes too), over eight layer-sized fp32 tensors far larger than any cache."""
    rows, cols = (4096, 4096) if device.type == "cuda" else (512, 1024)
    params = [torch.nn.Parameter(torch.randn(rows, cols, device=device)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt.step()  # creates the moments
    return 8 * rows * cols / _seconds_per_call(opt.step, sync, window_s)


def _backward_ratio(device: torch.device, sync: Callable[[], None], window_s: float) -> float:
    """A linear layer's backward time over its forward time (2 by FLOPs: two matmuls of the
    forward's size; on CPU measured ~2.4-2.7, the transposed operands and the bias sum), at a
    transformer-like shape: tokens x hidden -> 4 hidden."""
    tokens, k, n = (8192, 4096, 4096) if device.type == "cuda" else (512, 256, 1024)
    x = torch.randn(tokens, k, device=device, requires_grad=True)
    layer = torch.nn.Linear(k, n, device=device)
    grad = torch.randn(tokens, n, device=device)
    forward = _seconds_per_call(lambda: layer(x), sync, window_s)
    both = _seconds_per_call(lambda: layer(x).backward(grad), sync, window_s)
    return max(both - forward, forward) / forward


def _host_adam_params_per_s(window_s: float) -> float:
    """Parameter elements per second the host (CPU) AdamW step of ZeRO-Offload updates:
    ``autopar.optim.cpu_kernels.adam_step`` (csrc/'s fused kernel, or its torch fallback), the
    call ``runtime/offload.py`` makes per parameter, over eight layer-sized fp32 tensors, on
    this rank's threads (the profile's ``host_adam_params_per_s``, per device)."""

    rows, cols = 512, 1024
    state = [[torch.randn(rows, cols), torch.randn(rows, cols), torch.zeros(rows, cols), torch.zeros(rows, cols)]
             for _ in range(8)]
    step = [0]

    def one_step() -> None:
        step[0] += 1
        for master, grad, exp_avg, exp_avg_sq in state:
            adam_step(master, grad, exp_avg, exp_avg_sq, step[0], 1e-3, 0.9, 0.999, 1e-8, 0.01, True)

    return 8 * rows * cols / _seconds_per_call(one_step, lambda: None, window_s)


def _stream_rates(nbytes: int, device: torch.device, sync: Callable[[], None],
                  window_s: float) -> tuple[float, float]:
    """(copy, add) bytes per second: a copy moves 2 x ``nbytes``, ``c = a + b`` 3 x."""
    x = torch.ones(nbytes // 4, device=device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    copy = 2 * nbytes / _seconds_per_call(lambda: y.copy_(x), sync, window_s)
    add = 3 * nbytes / _seconds_per_call(lambda: torch.add(x, y, out=z), sync, window_s)
    return copy, add


def _softmax_bytes_per_s(device: torch.device, sync: Callable[[], None], window_s: float) -> float:
    """Bytes per second (input + output) of log-softmax over vocabulary-wide rows (8192 fp32
    columns, as a language model's loss runs it): the rate the cost model prices softmax-like
    ops at (``cost_model.costs``). 8 MiB on CPU (a per-rank loss of a small GPT), 256 MiB on CUDA."""
    rows = 8192 if device.type == "cuda" else 256
    x = torch.randn(rows, 8192, device=device)
    out = torch.empty_like(x)
    return 2 * x.numel() * 4 / _seconds_per_call(lambda: torch.log_softmax(x, -1, out=out), sync, window_s)


def measure_device(device: torch.device, quick: bool, say: Callable[[str], None],
                   between: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """This rank's device rates (see the module docstring for what each is). ``between()`` runs
    before each measurement: with several ranks, a barrier, so that every rank measures each
    rate while the others measure the same one: unaligned, the ranks drift apart over the
    measurements (one still warming up while its core-mate times), and a rank that times while
    its core-mate idles measures up to a whole core, not the share a training step gets."""
    sync = _sync_fn(device)
    cuda = device.type == "cuda"
    window = 0.15 if quick else 0.4
    n = (4096 if quick else 8192) if cuda else (512 if quick else 1024)

    def probe(fn: Callable[[], Any]) -> Any:
        """``fn()`` after ``between()``; on CPU the median of three such runs, per value. One run
        of a rate on this shared 2-core machine (4 ranks, 2 per core) swung 1.8x between
        calibrations minutes apart (fp32 matmul 21.4 and 39.2 GFLOP/s; eight back-to-back runs
        on 4 pinned ranks: per-rank 24-46, per-run medians 25-42), and the profile's every price
        moved with it, the reference step's fit hiding it only for the reference's op mix."""
        runs = []
        for _ in range(1 if cuda else 3):
            between()
            runs.append(fn())
        if len(runs) == 1:
            return runs[0]
        if isinstance(runs[0], tuple):
            return tuple(statistics.median(r[i] for r in runs) for i in range(len(runs[0])))
        return statistics.median(runs)

    fp32 = probe(lambda: _matmul_flops(n, torch.float32, device, sync, window))
    say(f"matmul fp32 {n}^3: {fp32 / 1e9:,.1f} GFLOP/s")
    bf16_native = cuda and torch.cuda.is_bf16_supported()
    nb = n if bf16_native else min(n, 256)  # CPU bf16 matmul runs ~50x slower: keep it short
    bf16 = probe(lambda: _matmul_flops(nb, torch.bfloat16, device, sync, window))
    say(f"matmul bf16 {nb}^3: {bf16 / 1e9:,.1f} GFLOP/s")
    stream_bytes = (256 << 20 if quick else 1 << 30) if cuda else (16 << 20 if quick else 64 << 20)
    copy, add = probe(lambda: _stream_rates(stream_bytes, device, sync, window))
    say(f"copy {copy / 1e9:,.1f} GB/s, add {add / 1e9:,.1f} GB/s ({stream_bytes >> 20} MiB tensors)")
    softmax = probe(lambda: _softmax_bytes_per_s(device, sync, window))
    say(f"log-softmax {softmax / 1e9:,.2f} GB/s (input + output)")
    adamw = probe(lambda: _adamw_params_per_s(device, sync, window))
    say(f"AdamW step (fused): {adamw / 1e6:,.1f} M parameters/s")
    backward = probe(lambda: _backward_ratio(device, sync, window))
    say(f"linear layer backward / forward: {backward:.2f}")
    host_adam = probe(lambda: _host_adam_params_per_s(window))
    say(f"host AdamW step (ZeRO-Offload's adam_step): {host_adam / 1e6:,.1f} M parameters/s")
    one, out = torch.ones(1, device=device), torch.empty(1, device=device)
    tiny = probe(lambda: _seconds_per_call(lambda: torch.add(one, one, out=out), sync, window, batch=100))
    say(f"tiny op {tiny * 1e6:.1f} us")
    # the reference training step (autopar/calibrate_reference.py): CPU profiles fit their
    # compute efficiency to it
    reference = 0.0 if cuda else time_reference_step(device, between, quick)
    if reference:
        say(f"reference training step {reference * 1e3:.1f} ms")
    if cuda:
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return dict(device=name, matmul_n=n, matmul_fp32_flops=fp32, matmul_bf16_flops=bf16, bf16_native=bf16_native,
                stream_bytes=stream_bytes, copy_bytes_per_s=copy, add_bytes_per_s=add, tiny_op_seconds=tiny,
                memory_bytes=memory, adamw_params_per_s=adamw, softmax_bytes_per_s=softmax, backward_ratio=backward,
                host_adam_params_per_s=host_adam, reference_step_seconds=reference)


def _time_collective(fn: Callable[[], Any], sync: Callable[[], None], group: Any, device: torch.device,
                     quick: bool, between: Callable[[], Any] | None = None) -> float:
    """Seconds per call of collective ``fn`` on this rank: median of trials.

    ``between`` (CPU): the calls are timed as a training step meets them, each one after a piece
    of compute on every rank, less the same compute timed alone (trials alternate the two).
    CPU ranks sharing cores that wait back to back hand the cores to each other, so a
    collective there runs about twice as fast as between compute, where both ends must be
    scheduled at once (4 ranks on 2 cores: 4 KiB pair all-reduce 2.3 ms in a step, ~1 ms alone).

    Three trials even when quick: the median of three drops one trial that a neighbouring process
    slowed down (the median of two is their mean, and keeps it).

    Every rank must run the same number of calls, so the repeat count comes from the slowest
    rank's warm-up time (an all-reduce MAX), not from each rank's own clock.
    """
    def call() -> None:
        if between is not None:
            between()
        fn()

    call()
    call()
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    estimate = torch.tensor([time.perf_counter() - t0], device=device, dtype=torch.float64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=group)
    target_s = 0.04 if quick else 0.12
    reps = max(2, min(200, round(target_s / max(estimate.item(), 1e-7))))

    def trial(body: Callable[[], Any]) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(reps):
            body()
        sync()
        return (time.perf_counter() - t0) / reps

    trials = []
    for _ in range(3 if quick else 5):
        with_call = trial(call)
        trials.append(with_call if between is None else max(with_call - trial(between), 0.0))
    return statistics.median(trials)


# What the runtime calls, each timed on its own: gloo's reduce-scatter and all-gather are not
# the ring algorithms the formulas assume (4 ranks on 2 cores: a reduce-scatter ~1.5x an
# all-reduce of the same input, an all-gather ~1x), so each gets rates of its own. all_to_all:
# the runtime's one call (``all_to_all_single``; Ulysses, an embedding cut on its hidden dim).
ALL_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")  # p2p: pairs only


def _measure_collectives(group: Any, n: int, device: torch.device, quick: bool,
                         say: Callable[[str], None],
                         kinds: tuple[str, ...] = ("all_reduce", "all_gather")) -> list[dict[str, Any]]:
    """This rank's times of each of ``kinds`` over the message sizes, on ``group`` of ``n``
    ranks (``bytes_per_rank``: all-reduce and broadcast the tensor, all-gather the gathered
    output, reduce-scatter and all-to-all the whole input)."""
    sync = _sync_fn(device)
    cuda = device.type == "cuda"
    sizes = (_SIZES_CUDA_QUICK if quick else _SIZES_CUDA) if cuda else (_SIZES_CPU_QUICK if quick else _SIZES_CPU)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    root = 0 if group is None else dist.get_global_rank(group, 0)
    me = dist.get_rank() if group is None else dist.get_group_rank(group, dist.get_rank())
    peer = (1 - me) if group is None else dist.get_global_rank(group, 1 - me) if n == 2 else -1

    def p2p(t: torch.Tensor) -> None:  # a pipeline stage's send: the pair's first rank to its second
        if me == 0:
            dist.send(t, dst=peer)
        else:
            dist.recv(t, src=peer)
    warm = torch.ones(1024, device=device)
    for _ in range(5):  # first collectives on a group pay for set-up (buffers, connections, NCCL comms)
        dist.all_reduce(warm, group=group)
    sync()
    between = None
    if not cuda:  # time them between compute, as a step meets them (see _time_collective)
        a, b = torch.randn(256, 256), torch.randn(256, 512)

        def between() -> None:
            for _ in range(2):
                torch.mm(a, b)
    points = []
    for size in sizes:
        elems = max(n, size // 4 // n * n)  # float32, divisible by n for the all-gather
        full = torch.ones(elems, device=device)
        shard = torch.ones(elems // n, device=device)
        out = torch.empty(elems, device=device)
        fns = {"all_reduce": lambda: dist.all_reduce(full, group=group),
               "all_gather": lambda: gather(out, shard, group=group),
               "reduce_scatter": lambda: scatter(shard, full, group=group),
               "broadcast": lambda: dist.broadcast(full, src=root, group=group),
               "all_to_all": lambda: dist.all_to_all_single(out, full, group=group),
               "p2p": lambda: p2p(full)}
        for name in (k for k in kinds if k != "p2p" or n == 2):
            fn = fns[name]
            seconds = _time_collective(fn, sync, group, device, quick, between)
            points.append(dict(collective=name, bytes_per_rank=elems * 4, n_ranks=n, seconds=seconds))
            say(f"{name} {n} ranks {elems * 4 / 2**20:8.3f} MiB: {seconds * 1e3:8.3f} ms")
    return points


def _measure_overlap(group: Any, n: int, device: torch.device, quick: bool, say: Callable[[str], None]) -> float:
    """This rank's achieved overlap: an all-reduce in flight while matmuls run.

    ``t_comm`` is an asynchronous all-reduce waited on at once, ``t_comp`` about as long of
    matmuls, ``t_both`` the all-reduce launched, the matmuls run, then waited on. The overlap
    is ``(t_comm + t_comp - t_both) / min(t_comm, t_comp)``, clamped to [0, 1]: 1 when the
    shorter one hides entirely, 0 when they run one after the other (or slow each other down
    that much, as ranks that share their cores with gloo's threads may). Each time is the
    median over rounds that time all three back to back.
    """
    sync = _sync_fn(device)
    cuda = device.type == "cuda"
    size = (64 << 20 if quick else 256 << 20) if cuda else (2 << 20 if quick else 4 << 20)
    buf = torch.ones(size // 4, device=device)
    m = 4096 if cuda else 256
    a, b = torch.randn(m, m, device=device), torch.randn(m, m, device=device)

    def comm() -> None:
        dist.all_reduce(buf, group=group, async_op=True).wait()

    def comp(k: int) -> None:
        for _ in range(k):
            torch.mm(a, b)

    def both(k: int) -> None:
        work = dist.all_reduce(buf, group=group, async_op=True)
        comp(k)
        work.wait()

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    comm()
    t_comm = statistics.median(timed(comm) for _ in range(3))
    one = _seconds_per_call(lambda: torch.mm(a, b), sync, 0.05)
    k = torch.tensor([max(1.0, round(t_comm / one))], dtype=torch.float64, device=device)
    dist.all_reduce(k, op=dist.ReduceOp.MAX, group=group)  # every rank the same work
    k_int = int(k.item())
    # The three timed back to back in each round, so load that drifts (a machine others use
    # too) hits all three alike, and the overlap taken from each one's median over the rounds:
    # whole phases one after another gave 0.23 and 0.94 on this machine minutes apart, and a
    # median of per-round ratios swings as much (one slow round of the shorter term decides it).
    rows = [(timed(comm), timed(lambda: comp(k_int)), timed(lambda: both(k_int))) for _ in range(3 if quick else 7)]
    t_comm, t_comp, t_both = (statistics.median(r[i] for r in rows) for i in range(3))
    overlap = (t_comm + t_comp - t_both) / min(t_comm, t_comp)
    say(f"overlap: all-reduce {size >> 20} MiB {t_comm * 1e3:.1f} ms, {k_int} matmuls {t_comp * 1e3:.1f} ms, "
        f"both {t_both * 1e3:.1f} ms (medians of {len(rows)} rounds) -> {overlap:.2f}")
    return min(1.0, max(0.0, overlap))


def rank_measure(rank: int, world: int, local_world: int, device: torch.device, quick: bool,
                  t0: float, progress: bool) -> dict[str, Any] | None:
    """Every rank's part of a calibration, in an initialised process group; rank 0 gets the result."""
    def say(message: str) -> None:
        if rank == 0 and progress:
            print(f"  [calibrate {time.perf_counter() - t0:5.1f} s] {message}", file=sys.stderr, flush=True)

    say(f"{world} ranks ({dist.get_backend()}), measuring the device on every rank at once")
    dist.barrier()
    device_rates = measure_device(device, quick, say, between=dist.barrier)
    n_nodes = world // local_world if world > local_world and world % local_world == 0 else 1
    if n_nodes > 1:
        local_group, _ = dist.new_subgroups(group_size=local_world)
        say(f"intra-node link: {n_nodes} groups of {local_world} ranks")
        intra = _measure_collectives(local_group, local_world, device, quick, say, ALL_KINDS)
        say(f"inter-node link: all {world} ranks")
        inter = _measure_collectives(None, world, device, quick, say)
    else:
        intra, inter = _measure_collectives(None, world, device, quick, say, ALL_KINDS), None
    # smaller groups inside a node, all of them at once (as a mesh axis's groups run): a 2-rank
    # group is not a 4-rank ring with fewer hops where ranks share cores or links
    for size in (d for d in range(2, local_world) if local_world % d == 0):
        sub, _ = dist.new_subgroups(group_size=size)
        say(f"intra-node groups of {size} ranks, all at once")
        intra += _measure_collectives(sub, size, device, quick, say, ALL_KINDS)
    overlap = _measure_overlap(None, world, device, quick, say)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    everything: list[Any] = [None] * world
    dist.all_gather_object(everything, (device_rates, intra, inter, overlap, cores))
    if rank != 0:
        return None
    # the cores rank 0's node's ranks share: the union of their affinities (a rank pinned to one
    # core, as pin_to_core does, sees only its own)
    shared = set().union(*(e[4] for e in everything[:local_world]))
    return dict(device=_combine_device(everything), intra=_combine_points([e[1] for e in everything]),
                inter=None if inter is None else _combine_points([e[2] for e in everything]),
                n_ranks=world, devices_per_node=local_world, n_nodes=n_nodes,
                comm_overlap=statistics.median(e[3] for e in everything), shared_cores=len(shared))


def _combine_device(per_rank: list[Any]) -> dict[str, Any]:
    first = per_rank[0][0]
    out = dict(first)
    for key, value in first.items():
        if isinstance(value, float):
            out[key] = statistics.median(r[0][key] for r in per_rank)
    out["memory_bytes"] = min(r[0]["memory_bytes"] for r in per_rank)
    return out


def _combine_points(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A collective ends when its slowest rank does: the max over ranks, point by point."""
    return [dict(p, seconds=max(r[i]["seconds"] for r in per_rank)) for i, p in enumerate(per_rank[0])]


def pin_to_core(rank: int, world: int) -> int | None:
    """CPU ranks that outnumber this process's cores: pin ``rank`` to one core, round robin
    (4 ranks on 2 cores: 2 per core, always the same 2). Left to the OS scheduler, 4 busy ranks
    on 2 cores drift between cores and one core often runs 3 of them: the step, gated by the
    slowest rank, measured 230-320 ms on 4 equal processes where pinned they ran 262-277 ms.
    Calibration and the benchmarks that check its predictions pin alike, so the profile prices
    the sharing the runs see. Returns the core, or None where nothing was pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if world <= len(cores):
        return None
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _spawned_rank(rank: int, world: int, init_method: str, backend: str, quick: bool, t0: float,
                  progress: bool, result_path: str) -> None:
    torch.set_num_threads(1)
    if backend != "nccl":
        pin_to_core(rank, world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        result = rank_measure(rank, world, world, device, quick, t0, progress)
        if result is not None:
            with open(result_path, "w", encoding="utf-8") as fh:
                json.dump(result, fh)
    finally:
        dist.destroy_process_group()
    # The result is on disk and the group destroyed: leave without the interpreter's teardown.
    # gloo's threads (pt_gloo_runloop, gloo_tcp_loop) outlive destroy_process_group (torch 2.13),
    # and tearing the interpreter down around them aborted rank 0 after its last line ran
    # ("terminate called without an active exception"; 1 run in 4 under pytest, 2026-12-08).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(nproc: int, backend: str, quick: bool, t0: float, progress: bool) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autopar-calibrate-") as tmp:
        result_path = os.path.join(tmp, "measured.json")
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read by each rank's OpenMP at start-up; they share the cores
        try:
            # A file rendezvous, not a TCP port picked free beforehand: another job's gloo ranks
            # (a concurrent test launch) can take that port before rank 0 binds it, and a rank
            # that then talks to the wrong listener dies (CI saw a calibration rank SIGABRT).
            store = "file://" + os.path.join(tmp, "rendezvous")
            mp.spawn(_spawned_rank, args=(nproc, store, backend, quick, t0, progress, result_path),
                     nprocs=nproc, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            last = str(exc).strip().splitlines()[-1]
            raise CalibrationError(f"a calibration rank failed: {last}") from exc
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        with open(result_path, encoding="utf-8") as fh:
            return json.load(fh)
