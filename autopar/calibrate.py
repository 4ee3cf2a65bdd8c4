"""``autopar calibrate``: measure the machine and write a hardware profile for ``autopar plan``.

What is measured, on every rank at once (each rank is one "device" of the profile):

- ``peak_flops_fp32``: square fp32 matmuls (``n^3 * 2`` FLOPs each) for a fixed wall time.
- ``peak_flops``: the same in bf16 where the device runs bf16 matmuls natively (CUDA with
  ``torch.cuda.is_bf16_supported()``). On CPU the bf16 rate is measured and printed, but
  ``peak_flops`` takes the fp32 rate: autopar's CPU runtime trains in fp32, so that is the rate
  the compute actually runs at, whatever precision the planner assumes for its byte counts.
- ``memory_bandwidth_bytes_per_s``: ``c = a + b`` on tensors far larger than any cache,
  counting two reads and one write - the bytes the cost model's roofline charges an
  elementwise op (its inputs plus its output). A plain copy is measured and printed too.
- ``softmax_bytes_per_s``: log-softmax over 8192-wide fp32 rows, input + output bytes: the
  rate of softmax-like ops (softmax, log-softmax, the cross-entropy loss), whose exp/log and
  row reductions run below the streaming rate on CPU (``cost_model/costs.py``).
- ``kernel_overhead_s``: time per op of back-to-back 1-element adds (dispatch and launch).
- ``optimizer_params_per_s``: parameter elements per second the AdamW ``autopar.make_optimizer``
  builds (torch's fused kernel) updates: the optimizer step's price (``cost_model/offload.py``).
- ``backward_ratio``: a linear layer's backward time over its forward (tokens x hidden ->
  4 hidden): what a matmul's backward costs over its forward (``cost_model/costs.py``).
- ``host_adam_params_per_s``: the same for the host AdamW ZeRO-Offload runs
  (``autopar.optim.cpu_kernels.adam_step``, as ``runtime/offload.py`` calls it), on the CPU
  whatever the device: the offloaded step's price. Profiles not calibrated keep a default.
- ``memory_bytes``: device memory (CUDA) or the machine's RAM (CPU; all local ranks share it).
- ``shared_cores`` (CPU): the cores the ranks share (the union of the node's ranks'
  ``os.sched_getaffinity``: a rank pinned to one core sees only its own), so that the
  pipeline's bubble is priced as the oversubscribed machine runs it (``cost_model/pipeline.py``).
- ``comm_overlap``: how much of an asynchronous all-reduce hides behind matmuls running at the
  same time (``cost_model/overlap.py`` hides that fraction of the bucketed gradient all-reduces
  and ZeRO-3's prefetched collectives): both alone, then both together, on every rank at once;
  the median over ranks. One rank cannot measure it: it comes from ``links_from`` then.
- ``intra_node`` / ``inter_node`` links: all-reduce and all-gather times over message sizes
  from KiBs to MiBs (up to 8 MiB on CPU, 512 MiB on CUDA; on CPU each call after a piece of
  compute on every rank, less that compute alone: ranks sharing cores meet a collective in a
  step so, about twice as slow as back to back), fitted by least squares on
  *relative* error (small and large messages weigh the same) to the ring formulas of
  :mod:`autopar.cost_model.comm`::

      all-reduce  t = 2(n-1)/n * S/B + 2(n-1) a      all-gather  t = (n-1)/n * S/B + (n-1) a

  so those formulas, given the fitted ``B`` and ``a``, reproduce what was measured (the
  summary prints each point's error). With one node, ``inter_node`` copies ``intra_node``:
  nothing crossed a node boundary to measure. Under ``torchrun`` over several nodes the
  intra-node link is fitted on each node's own ranks and the inter-node link on all ranks.

``efficiency``: on CUDA 1.0 (the cost model divides by ``efficiency * peak``, and a measured
matmul or copy rate is already what dense kernels reach). On CPU it is fitted to a reference
training step every rank times at once, as a synchronous step (a barrier after each: the
slowest rank's time, what a parallel step waits for; ``autopar/calibrate_reference.py``): a
small GPT's forward, backward and AdamW, which ran at 0.64-0.85 of what the kernel rates price
on this project's machine (4 ranks, 2 cores); the fitted value makes the cost model price that
step as it ran.

Ranks measure concurrently because that is how they run: on a CPU box the ranks share the
cores and the memory bus, and a rank's rate is its share. Per-rank device rates are combined
by the median; a collective's time is the slowest rank's. ``OMP_NUM_THREADS=1`` is set for
spawned ranks (torchrun users set it themselves).

Without ``torchrun``, :func:`calibrate` spawns ``nproc`` local ranks (gloo on CPU, NCCL on
CUDA) with :mod:`torch.multiprocessing`. One rank measures the device only; its links must
then come from a built-in profile (``links_from``) and the summary says so.

The measuring itself (timing loops, collectives, spawned ranks) is ``autopar/calibrate_measure.py``;
this module holds the profile's data, the fit, the driver and the summary.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from .calibrate_reference import REFERENCE_SHAPE, EfficiencyFit, fit_efficiency
from .calibrate_measure import CalibrationError, measure_device, rank_measure, spawn_ranks
from .cost_model.comm import collective_s
from .cost_model.hardware import Hardware, get_hardware
from .mesh import Link

__all__ = ["Calibration", "CalibrationError", "CollectivePoint", "DeviceMeasurements", "LinkFit",
           "calibrate", "calibrate_in_group", "calibration_to_dict", "fit_link", "fit_per_collective", "format_summary",
           "with_per_collective"]

DEFAULT_CPU_RANKS = 4


@dataclass(frozen=True)
class CollectivePoint:
    """One measured collective: ``bytes_per_rank`` means what it means in cost_model.comm."""

    collective: str
    bytes_per_rank: int
    n_ranks: int
    seconds: float


@dataclass(frozen=True)
class LinkFit:
    """A link fitted to measured collectives, and how well the ring formulas then match them."""

    link: Link
    points: tuple[CollectivePoint, ...]

    def predicted_seconds(self, point: CollectivePoint) -> float:
        return collective_s(point.collective, point.bytes_per_rank, point.n_ranks, self.link)  # type: ignore[arg-type]

    def relative_errors(self) -> tuple[float, ...]:
        """(model - measured) / measured for every point."""
        return tuple(self.predicted_seconds(p) / p.seconds - 1 for p in self.points)

    @property
    def rms_relative_error(self) -> float:
        errors = self.relative_errors()
        return math.sqrt(sum(e * e for e in errors) / len(errors))

    @property
    def max_relative_error(self) -> float:
        return max(abs(e) for e in self.relative_errors())


@dataclass(frozen=True)
class DeviceMeasurements:
    """Per-device rates, the median over ranks that measured at the same time."""

    device: str
    matmul_n: int
    matmul_fp32_flops: float
    matmul_bf16_flops: float
    bf16_native: bool  # bf16 matmul is a first-class path here (CUDA); on CPU it is emulated/slow
    stream_bytes: int
    copy_bytes_per_s: float
    add_bytes_per_s: float
    tiny_op_seconds: float
    memory_bytes: float
    adamw_params_per_s: float = 0.0  # torch's fused AdamW step (0: not measured)
    backward_ratio: float = 0.0  # a linear layer's backward time over its forward (0: not measured)
    softmax_bytes_per_s: float = 0.0  # log-softmax over 8192-wide rows, input + output bytes (0: not measured)
    host_adam_params_per_s: float = 0.0  # the host AdamW of ZeRO-Offload (0: not measured)
    reference_step_seconds: float = 0.0  # autopar/calibrate_reference.py's step (0: not measured, CUDA)


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured, the fitted links, and the profile built from them."""

    hardware: Hardware
    device: DeviceMeasurements
    backend: str
    n_ranks: int
    n_nodes: int
    intra: LinkFit | None  # None: links copied from ``links_from``
    inter: LinkFit | None  # None: one node (inter copies intra), or links copied
    links_from: str | None
    seconds: float
    comm_overlap: float | None = None  # measured; None: copied from links_from
    # one fit per (collective, group size) measured inside a node: the intra link's per_collective rows
    per_collective: tuple[LinkFit, ...] = ()
    reference: EfficiencyFit | None = None  # the efficiency fitted to the reference step (CPU)


# ------------------------------------------------------------------------------ fitting


def _coefficients(p: CollectivePoint) -> tuple[float, float]:
    """(c, d) with t = c / B + d * a for ``p``'s ring formula (cost_model.comm)."""
    n = p.n_ranks
    if p.collective in ("broadcast", "reduce"):  # pipelined ring: S/B + (n-1) a
        return float(p.bytes_per_rank), float(n - 1)
    if p.collective == "p2p":  # one send: S/B + a
        return float(p.bytes_per_rank), 1.0
    steps = 2 * (n - 1) if p.collective == "all_reduce" else n - 1
    return steps / n * p.bytes_per_rank, float(steps)


def fit_link(points: list[CollectivePoint] | tuple[CollectivePoint, ...], name: str) -> LinkFit:
    """Least-squares ``B`` and ``a`` (both >= 0) minimising the relative error over ``points``.

    Each point gives one row ``(c/t, d/t) . (1/B, a) = 1``. If the unconstrained optimum has a
    negative latency, the latency-free fit is taken instead; a bandwidth is always fitted.
    """
    import numpy as np

    points = tuple(points)
    if not points or any(p.n_ranks < 2 or p.seconds <= 0 for p in points):
        raise CalibrationError(f"link {name!r}: need collective times on >= 2 ranks to fit, got {points!r}")
    rows = np.array([_coefficients(p) for p in points]) / np.array([[p.seconds] for p in points])
    ones = np.ones(len(points))
    inv_bw, alpha = np.linalg.lstsq(rows, ones, rcond=None)[0]
    if inv_bw <= 0 or alpha < 0:
        # Both one-variable fits; a latency-only fit is useless (no bandwidth), so only S/B.
        col = rows[:, 0]
        inv_bw, alpha = float(col @ ones / (col @ col)), 0.0
    if not (inv_bw > 0 and math.isfinite(inv_bw)):
        raise CalibrationError(
            f"link {name!r}: collective times do not grow with message size, so no bandwidth can be fitted; "
            f"measured {[(p.collective, p.bytes_per_rank, p.seconds) for p in points]}")
    return LinkFit(Link(name, float(1.0 / inv_bw), float(alpha)), points)


def fit_per_collective(points: list[CollectivePoint] | tuple[CollectivePoint, ...], name: str
                       ) -> tuple[LinkFit, ...]:
    """One :func:`fit_link` per (collective, group size) among ``points``, in sorted order; a
    pair whose times do not grow with the message size (no bandwidth to fit) is left out, and
    the link's own pair prices it."""
    groups: dict[tuple[str, int], list[CollectivePoint]] = {}
    for p in points:
        groups.setdefault((p.collective, p.n_ranks), []).append(p)
    fits = []
    for (kind, n), pts in sorted(groups.items()):
        if len(pts) < 2:
            continue
        try:
            fits.append(fit_link(pts, f"{name}:{kind}/{n}"))
        except CalibrationError:
            continue
    return tuple(fits)


def with_per_collective(link: Link, fits: tuple[LinkFit, ...]) -> Link:
    """``link`` carrying each fit's rates as a ``Link.per_collective`` row."""
    rows = tuple((f.points[0].collective, f.points[0].n_ranks, f.link.bandwidth_bytes_per_s, f.link.latency_s)
                 for f in fits)
    return dataclasses.replace(link, per_collective=rows)


# ------------------------------------------------------------------------------ driver


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def calibrate(out: str | None = None, *, nproc: int | None = None, quick: bool = False, name: str | None = None,
              links_from: str | None = None, device: str = "auto", progress: bool = True) -> Calibration | None:
    """Measure this machine, write the profile to ``out`` (if given) and return the calibration.

    Under ``torchrun`` every rank must call this; rank 0 gets the :class:`Calibration`, the
    others ``None``. Otherwise ``nproc`` local ranks are spawned (default: every CUDA device,
    or 4 on CPU). ``quick`` measures fewer sizes for shorter times (tests).
    """
    t0 = time.perf_counter()
    if device not in ("auto", "cpu", "cuda"):
        raise CalibrationError(f"device must be auto, cpu or cuda, got {device!r}")
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise CalibrationError("device cuda asked for, but torch sees no CUDA device; use --device cpu")
    backend = "nccl" if cuda else "gloo"
    base = get_hardware(links_from) if links_from else None
    if _under_torchrun():
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend)
        try:
            return calibrate_in_group(out, quick=quick, name=name, links_from=links_from, progress=progress, t0=t0)
        finally:
            dist.destroy_process_group()
    nproc = nproc if nproc is not None else (torch.cuda.device_count() if cuda else DEFAULT_CPU_RANKS)
    if nproc < 1 or (cuda and nproc > torch.cuda.device_count()):
        most = f" and at most {torch.cuda.device_count()} (the CUDA devices)" if cuda else ""
        raise CalibrationError(f"--nproc {nproc}: need at least 1 rank{most}; pass e.g. --nproc 4")
    if nproc == 1:
        if base is None:
            raise CalibrationError("one rank cannot measure a link; use --nproc 2 or more, or copy the links "
                                   "from a built-in profile with --links-from NAME (e.g. h100-80gb)")
        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        say = (lambda m: print(f"  [calibrate {time.perf_counter() - t0:5.1f} s] {m}", file=sys.stderr,
                               flush=True)) if progress else (lambda m: None)
        measured = dict(device=measure_device(dev, quick, say), intra=None, inter=None, n_ranks=1,
                        devices_per_node=1, n_nodes=1, comm_overlap=None)
    else:
        measured = spawn_ranks(nproc, backend, quick, t0, progress)
    return _finish(measured, backend, name, links_from, base, t0, out)


def calibrate_in_group(out: str | None = None, *, quick: bool = False, name: str | None = None,
                       links_from: str | None = None, progress: bool = True, t0: float | None = None
                       ) -> Calibration | None:
    """Calibrate with the process group this job has already initialised: every rank calls it,
    rank 0 gets the :class:`Calibration` (and writes ``out``), the others ``None``. A job measures
    the machine in place, as its own processes load it (``bench/fidelity.py`` calibrates between
    the rounds it times this way). CUDA ranks measure their current device; ``LOCAL_WORLD_SIZE``
    (torchrun's) says how many ranks share a node, else all do."""
    t0 = time.perf_counter() if t0 is None else t0
    backend = dist.get_backend()
    cuda = backend == "nccl"
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    measured = rank_measure(rank, world, local_world, dev, quick, t0, progress)
    if measured is None:
        return None
    base = get_hardware(links_from) if links_from else None
    return _finish(measured, "nccl" if cuda else "gloo", name, links_from, base, t0, out)


def _finish(measured: dict[str, Any], backend: str, name: str | None, links_from: str | None,
            base: Hardware | None, t0: float, out: str | None) -> Calibration:
    result = _build(measured, backend, name, links_from, base, time.perf_counter() - t0)
    if out is not None:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(result.hardware.to_json(), fh, indent=1)
            fh.write("\n")
    return result


def _build(measured: dict[str, Any], backend: str, name: str | None, links_from: str | None,
           base: Hardware | None, seconds: float) -> Calibration:
    dev = DeviceMeasurements(**measured["device"])
    link_name = f"{backend}-{'nvlink/pcie' if backend == 'nccl' else 'loopback'}-measured"
    intra, per_kind = None, ()
    if base is None:
        # the link's own pair: all-reduce and all-gather on a whole node, as before; then rates of
        # each collective and group size measured (reduce-scatter, broadcast, smaller groups)
        points = [CollectivePoint(**p) for p in measured["intra"]]
        node = int(measured["devices_per_node"])
        intra = fit_link([p for p in points if p.n_ranks == node and p.collective in ("all_reduce", "all_gather")]
                         or points, link_name)
        per_kind = fit_per_collective(points, link_name)
    inter = None
    if base is None and measured["inter"] is not None:
        inter = fit_link([CollectivePoint(**p) for p in measured["inter"]], f"{backend}-inter-node-measured")
    if base is not None:
        intra_link, inter_link = base.intra_node, base.inter_node
    else:
        intra_link = with_per_collective(intra.link, per_kind)
        inter_link = inter.link if inter is not None else intra_link
    overlap = measured.get("comm_overlap")
    kind = "cpu" if dev.device == "cpu" else dev.device.lower().replace("nvidia ", "").replace(" ", "-")
    hardware = Hardware(
        name=name or f"calibrated-{kind}",
        devices_per_node=int(measured["devices_per_node"]) if base is None else base.devices_per_node,
        peak_flops=dev.matmul_bf16_flops if dev.bf16_native else dev.matmul_fp32_flops,
        peak_flops_fp32=dev.matmul_fp32_flops,
        memory_bandwidth_bytes_per_s=dev.add_bytes_per_s,
        memory_bytes=dev.memory_bytes,
        intra_node=intra_link,
        inter_node=inter_link,
        kernel_overhead_s=dev.tiny_op_seconds,
        optimizer_params_per_s=dev.adamw_params_per_s,
        softmax_bytes_per_s=dev.softmax_bytes_per_s,
        **({"backward_ratio": dev.backward_ratio} if dev.backward_ratio else {}),
        **({"host_adam_params_per_s": dev.host_adam_params_per_s} if dev.host_adam_params_per_s else {}),
        efficiency=1.0,  # measured rates already include kernel efficiency; CPU: fitted below
        comm_overlap=float(overlap) if overlap is not None else (base.comm_overlap if base is not None else 0.0),
        # CPU ranks share this machine's cores (the rates above are each rank's share of them)
        shared_cores=float(measured.get("shared_cores") or len(os.sched_getaffinity(0)))
        if dev.device == "cpu" else 0.0,
    )
    reference = fit_efficiency(hardware, dev.reference_step_seconds) if dev.reference_step_seconds > 0 else None
    if reference is not None:
        hardware = dataclasses.replace(hardware, efficiency=reference.efficiency)
    return Calibration(hardware, dev, backend, int(measured["n_ranks"]), int(measured["n_nodes"]), intra, inter,
                       links_from if base is not None else None, seconds,
                       None if overlap is None else float(overlap), per_kind, reference)


# ------------------------------------------------------------------------------ summary


def _fmt_bytes(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b >= 2**20 else f"{b / 2**10:,.1f} KiB"


def _link_lines(label: str, fit: LinkFit) -> list[str]:
    link = fit.link
    lines = [f"{label}: {link.name}, {fit.points[0].n_ranks} ranks; fitted bandwidth B = "
             f"{link.bandwidth_bytes_per_s / 1e9:,.3f} GB/s, latency a = {link.latency_s * 1e6:,.1f} us; "
             f"relative error rms {fit.rms_relative_error:.0%}, max {fit.max_relative_error:.0%}",
             f"  {'collective':12s} {'bytes/rank':>12s} {'measured':>11s} {'model':>11s} {'error':>7s}"]
    for p, err in zip(fit.points, fit.relative_errors()):
        lines.append(f"  {p.collective:12s} {_fmt_bytes(p.bytes_per_rank):>12s} {p.seconds * 1e3:8.3f} ms "
                     f"{fit.predicted_seconds(p) * 1e3:8.3f} ms {err:+7.0%}")
    return lines


def format_summary(cal: Calibration) -> str:
    """The table ``autopar calibrate`` prints: measured values, fitted links, fit residuals."""
    d, hw = cal.device, cal.hardware
    bf16_use = "-> peak_flops" if d.bf16_native else "(not used: CPU runs fp32; peak_flops = fp32 rate)"
    rows = [
        (f"matmul fp32 {d.matmul_n}^3", f"{d.matmul_fp32_flops / 1e9:,.2f} GFLOP/s",
         "-> peak_flops_fp32" + ("" if d.bf16_native else ", peak_flops")),
        ("matmul bf16", f"{d.matmul_bf16_flops / 1e9:,.2f} GFLOP/s", bf16_use),
        (f"copy {_fmt_bytes(d.stream_bytes)}", f"{d.copy_bytes_per_s / 1e9:,.2f} GB/s", "(read + write)"),
        ("add c = a + b", f"{d.add_bytes_per_s / 1e9:,.2f} GB/s",
         "(2 reads + 1 write) -> memory_bandwidth_bytes_per_s"),
        ("log-softmax 8192-wide rows", f"{d.softmax_bytes_per_s / 1e9:,.2f} GB/s",
         "(input + output) -> softmax_bytes_per_s"),
        ("tiny op (1-element add)", f"{d.tiny_op_seconds * 1e6:,.2f} us", "-> kernel_overhead_s"),
        ("AdamW step (fused)", f"{d.adamw_params_per_s / 1e6:,.1f} M params/s", "-> optimizer_params_per_s"),
        ("linear backward / forward", f"{d.backward_ratio:.2f}", "-> backward_ratio"),
        ("host AdamW (offload)", f"{d.host_adam_params_per_s / 1e6:,.1f} M params/s", "-> host_adam_params_per_s"),
        ("memory", f"{d.memory_bytes / 2**30:,.2f} GiB", "-> memory_bytes"),
        ("all-reduce beside matmuls", "not measured (1 rank)" if cal.comm_overlap is None else
         f"{cal.comm_overlap:.2f} hidden", "-> comm_overlap"),
    ]
    lines = [
        f"autopar calibrate: {cal.n_ranks} rank(s), {cal.backend}, {d.device}, {cal.n_nodes} node(s), "
        f"{cal.seconds:.1f} s",
        "device (median over ranks measuring at the same time)",
        *(f"  {label:26s} {value:>18s}  {use}" for label, value, use in rows),
        f"  devices_per_node {hw.devices_per_node}, efficiency {hw.efficiency:.3g} " + (
            "(rates are measured)" if cal.reference is None else
            f"(fitted: the reference step, GPT {'x'.join(map(str, REFERENCE_SHAPE[:3]))}, measured "
            f"{cal.reference.measured_s * 1e3:.1f} ms, {cal.reference.predicted_at_one_s * 1e3:.1f} ms priced at "
            f"the kernel rates)"),
    ]
    if cal.intra is None:
        lines.append(f"links copied from {cal.links_from!r} (not measured): intra {hw.intra_node}, "
                     f"inter {hw.inter_node}")
    else:
        lines += _link_lines("intra_node", cal.intra)
        if cal.per_collective:
            lines.append("intra_node rates per collective and group size (Link.per_collective; the pair "
                         "above prices the rest)")
            for f in cal.per_collective:
                p0 = f.points[0]
                lines.append(f"  {p0.collective:14s} {p0.n_ranks} ranks: B = {f.link.bandwidth_bytes_per_s / 1e9:,.3f} "
                             f"GB/s, a = {f.link.latency_s * 1e6:,.1f} us; error rms {f.rms_relative_error:.0%}, "
                             f"max {f.max_relative_error:.0%}")
        if cal.inter is None:
            lines.append("inter_node: same as intra_node (one node: nothing crossed a node boundary)")
        else:
            lines += _link_lines("inter_node", cal.inter)
    return "\n".join(lines)


def calibration_to_dict(cal: Calibration) -> dict[str, Any]:
    """Everything measured, for a ``--measurements`` file (not a profile: Hardware rejects extra keys)."""
    return {"hardware": cal.hardware.to_json(), "device": asdict(cal.device), "backend": cal.backend,
            "n_ranks": cal.n_ranks, "n_nodes": cal.n_nodes, "seconds": cal.seconds, "links_from": cal.links_from,
            "comm_overlap": cal.comm_overlap,
            "intra": None if cal.intra is None else [asdict(p) for p in cal.intra.points],
            "inter": None if cal.inter is None else [asdict(p) for p in cal.inter.points]}
