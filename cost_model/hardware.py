"""Hardware profiles: what one device computes and stores, and the links between devices.

A :class:`Hardware` is pure data, like :class:`~autopar.mesh.MeshSpec`: the planner prices a
plan for 1024 GPUs from a profile without touching any. The built-in profiles carry public
figures, each with its source next to it (see FACTS.md at the workspace root); measured
figures from ``autopar calibrate`` (a JSON profile) are better than any of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import AutoparError
from ..mesh import Link, MeshSpec

__all__ = ["Hardware", "HardwareError", "PROFILES", "get_hardware", "list_hardware"]


class HardwareError(AutoparError, ValueError):
    """An unknown hardware profile name, or a malformed JSON profile."""


@dataclass(frozen=True)
class Hardware:
    """One kind of device, how many sit in a node, and the links inside and between nodes.

    ``peak_flops`` is dense bf16/fp16 (tensor-core) math, ``peak_flops_fp32`` plain fp32 math
    (torch does not use TF32 for matmuls by default). ``efficiency`` is the fraction of peak
    FLOP/s and memory bandwidth that dense kernels reach; ``kernel_overhead_s`` the floor on
    any one kernel's time (launch and tail).
    """

    name: str
    devices_per_node: int
    peak_flops: float
    peak_flops_fp32: float
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    kernel_overhead_s: float = 7e-6
    efficiency: float = 0.7
    # The host, for ZeRO-Offload (cost_model/offload.py). Link: PCIe 4 x16 as achieved per
    # direction, ~25 GB/s (FACTS.md; PCIe 5 ~50 GB/s on H100/H200). Memory: a DGX A100 640GB or
    # DGX H100 node has 2 TB for 8 GPUs, 256 GB each (NVIDIA DGX datasheets). AdamW rate: torch
    # 2.13's fused CPU AdamW measured 1.26e8 fp32 elements/s on one thread here (8M elements,
    # median of 5, shared 2-core machine); 8 host threads per GPU assumed: 1e9/s. Calibrate.
    host_link_bytes_per_s: float = 25e9
    host_memory_bytes: float = 256 * 2**30
    host_adam_params_per_s: float = 1e9
    # Fraction of the communication the runtime runs asynchronously (bucketed gradient
    # all-reduces, ZeRO-3 prefetched gathers and reduce-scatters) that actually hides behind
    # compute (cost_model/overlap.py). ``autopar calibrate`` measures it (an all-reduce in
    # flight while matmuls run). 0 (nothing hidden) for profiles that do not say, such as JSON
    # profiles written before it was measured; the GPU profiles below assume 0.9.
    comm_overlap: float = 0.0
    # Parameter elements per second torch's AdamW (its defaults) updates on one device, measured
    # by ``autopar calibrate``: its per-tensor loop makes several passes over weights, gradients
    # and moments (~6x one stream of them on CPU). 0: the step is priced as one stream at
    # ``memory_bandwidth_bytes_per_s`` (a fused kernel's floor; the built-in profiles).
    optimizer_params_per_s: float = 0.0
    # Bytes per second (input + output) of softmax-like ops: softmax, log-softmax and the
    # cross-entropy loss built on it, whose exp/log and row reductions run well below the
    # streaming rate on CPU (measured here: log-softmax over 8192-wide rows ~2-5x slower per byte
    # than ``c = a + b``). ``autopar calibrate`` measures it (log-softmax over vocabulary-wide
    # rows). 0: priced at ``memory_bandwidth_bytes_per_s`` like any elementwise op (the GPU
    # profiles: there these kernels are bound by HBM bandwidth).
    softmax_bytes_per_s: float = 0.0
    # CPU cores the devices of one node share (0: every device computes on its own, as GPUs
    # do). CPU ranks outnumbering the cores (4 gloo ranks on this 2-core machine) run at a
    # share of a core when all are busy, which is what ``autopar calibrate`` measures; a rank
    # that waits (a pipeline bubble) hands its share to the busy ones (``idle_speedup``).
    shared_cores: float = 0.0
    # A contraction's backward time over its forward: 2 by FLOPs (the built-in profiles);
    # ``autopar calibrate`` measures a linear layer's (on CPU ~2.4-2.7).
    backward_ratio: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise HardwareError(
                f"hardware {self.name!r}: devices_per_node must be a positive integer, got {self.devices_per_node!r}"
            )
        for field_name in ("peak_flops", "peak_flops_fp32", "memory_bandwidth_bytes_per_s", "memory_bytes",
                           "host_link_bytes_per_s", "host_memory_bytes", "host_adam_params_per_s"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise HardwareError(f"hardware {self.name!r}: {field_name} must be a positive number, got {value!r}")
        if not isinstance(self.kernel_overhead_s, (int, float)) or self.kernel_overhead_s < 0:
            raise HardwareError(
                f"hardware {self.name!r}: kernel_overhead_s must be >= 0, got {self.kernel_overhead_s!r}"
            )
        if not isinstance(self.shared_cores, (int, float)) or not 0 <= self.shared_cores < math.inf:
            raise HardwareError(f"hardware {self.name!r}: shared_cores must be >= 0 (0: devices do not share "
                                f"cores), got {self.shared_cores!r}")
        if not isinstance(self.optimizer_params_per_s, (int, float)) or not 0 <= self.optimizer_params_per_s < math.inf:
            raise HardwareError(f"hardware {self.name!r}: optimizer_params_per_s must be >= 0 (0: priced from "
                                f"memory bandwidth), got {self.optimizer_params_per_s!r}")
        if not isinstance(self.softmax_bytes_per_s, (int, float)) or not 0 <= self.softmax_bytes_per_s < math.inf:
            raise HardwareError(f"hardware {self.name!r}: softmax_bytes_per_s must be >= 0 (0: priced at "
                                f"memory_bandwidth_bytes_per_s), got {self.softmax_bytes_per_s!r}")
        if not isinstance(self.backward_ratio, (int, float)) or not 0 < self.backward_ratio < math.inf:
            raise HardwareError(f"hardware {self.name!r}: backward_ratio must be a positive number (a matmul's "
                                f"backward time over its forward; 2 by FLOPs), got {self.backward_ratio!r}")
        if not isinstance(self.comm_overlap, (int, float)) or not 0 <= self.comm_overlap <= 1:
            raise HardwareError(f"hardware {self.name!r}: comm_overlap must be in [0, 1] (the fraction of "
                                f"asynchronous communication hidden behind compute), got {self.comm_overlap!r}")
        if not isinstance(self.efficiency, (int, float)) or not 0 < self.efficiency <= 1:
            raise HardwareError(f"hardware {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")
        for link_name in ("intra_node", "inter_node"):
            link = getattr(self, link_name)
            if not isinstance(link, Link):
                raise HardwareError(f"hardware {self.name!r}: {link_name} must be a Link, got {link!r}")
            if link.bandwidth_bytes_per_s <= 0 or link.latency_s < 0:
                raise HardwareError(
                    f"hardware {self.name!r}: {link_name} needs bandwidth > 0 and latency >= 0, got {link}"
                )

    def idle_speedup(self, n_devices: int) -> float:
        """How much faster one busy rank runs than when all ranks of its node are busy: ranks
        / cores when CPU ranks share fewer cores (1 thread each, so at most one core a rank),
        else 1."""
        if self.shared_cores <= 0:
            return 1.0
        return max(1.0, min(n_devices, self.devices_per_node) / self.shared_cores)

    def pipeline_core_shares(self, p: int, per_stage: int) -> tuple[tuple[float, ...], ...]:
        """For each core the ranks of ``p`` pipeline stages (``per_stage`` consecutive ranks each)
        share, the fraction of its ranks that run each stage: local rank r pinned to core
        r % shared_cores, as ``autopar calibrate`` pins ranks that outnumber the cores
        (``cost_model.pipeline``'s per-core bound). () where no ranks share a core."""
        n = p * per_stage
        cores = int(self.shared_cores)
        if cores < 1 or self.idle_speedup(n) <= 1.0:
            return ()
        counts: dict[tuple[int, int], list[int]] = {}
        for r in range(n):
            core = (r // self.devices_per_node, (r % self.devices_per_node) % cores)
            counts.setdefault(core, [0] * p)[r // per_stage] += 1
        return tuple(tuple(c / sum(row) for c in row) for _, row in sorted(counts.items()))

    # ----------------------------------------------------------------------------------- mesh

    def mesh_links(self, sizes: tuple[int, ...]) -> tuple[Link, ...]:
        """The link each mesh axis runs over.

        Devices are numbered row-major over the mesh (the last axis is innermost, so its
        groups are contiguous device ids) and nodes hold ``devices_per_node`` consecutive
        ids. An axis whose every group of devices stays inside one node gets
        ``intra_node``, otherwise ``inter_node``. When the product of an axis's size and all
        inner sizes divides ``devices_per_node`` this is exactly "that product <=
        devices_per_node"; odd sizes are checked group by group.
        """
        sizes = tuple(sizes)
        for s in sizes:
            if not isinstance(s, int) or s < 1:
                raise HardwareError(f"mesh sizes must be positive integers, got {sizes}")
        dpn = self.devices_per_node
        n_devices = math.prod(sizes)
        links = []
        for i, size in enumerate(sizes):
            stride = math.prod(sizes[i + 1 :])  # device-id distance between neighbours on axis i
            block = stride * size  # every group of axis i lies in an aligned block of this many ids
            if size == 1 or n_devices <= dpn:
                intra = True
            elif block > dpn:
                intra = False
            elif dpn % block == 0:
                intra = True
            else:
                intra = _groups_within_nodes(n_devices, stride, size, dpn)
            links.append(self.intra_node if intra else self.inter_node)
        return tuple(links)

    def mesh_spec(self, axes: tuple[str, ...], sizes: tuple[int, ...]) -> MeshSpec:
        """A :class:`MeshSpec` over ``axes``/``sizes`` whose links come from :meth:`mesh_links`."""
        return MeshSpec(tuple(axes), tuple(sizes), self.mesh_links(tuple(sizes)))

    # ----------------------------------------------------------------------------------- json

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; links become ``{name, bandwidth_bytes_per_s, latency_s}``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_json() if isinstance(value, Link) else value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Hardware":
        """Inverse of :meth:`to_json`; names missing or unknown fields in its error."""
        if not isinstance(data, Mapping):
            raise HardwareError(f"a hardware profile is a JSON object, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
        unknown = sorted(set(data) - set(fields))
        missing = [n for n in required if n not in data]
        if unknown or missing:
            parts = []
            if missing:
                parts.append(f"missing {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown {', '.join(unknown)}")
            raise HardwareError(
                f"hardware profile {data.get('name', '?')!r}: {'; '.join(parts)} "
                f"(fields are {', '.join(fields)})"
            )
        kwargs = dict(data)
        for link_name in ("intra_node", "inter_node"):
            kwargs[link_name] = _link_from_json(kwargs[link_name], link_name)
        kwargs["devices_per_node"] = _as_int(kwargs["devices_per_node"], "devices_per_node")
        return cls(**kwargs)

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.devices_per_node}/node, {self.peak_flops / 1e12:g} TFLOP/s "
            f"(fp32 {self.peak_flops_fp32 / 1e12:g}), {self.memory_bandwidth_bytes_per_s / 1e12:g} TB/s, "
            f"{self.memory_bytes / 2**30:.0f} GiB, intra {self.intra_node}, inter {self.inter_node}"
        )


def _groups_within_nodes(n_devices: int, stride: int, size: int, dpn: int) -> bool:
    """True when every group of an axis (ids base + j*stride, j < size) lies inside one node."""
    block = stride * size
    for block_start in range(0, n_devices, block):
        for base in range(block_start, block_start + stride):
            if base // dpn != (base + (size - 1) * stride) // dpn:
                return False
    return True


def _as_int(value: Any, field_name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int):
        raise HardwareError(f"hardware profile: {field_name} must be an integer, got {value!r}")
    return value


def _link_from_json(value: Any, field_name: str) -> Link:
    if isinstance(value, Link):
        return value
    keys = ("name", "bandwidth_bytes_per_s", "latency_s")
    if not isinstance(value, Mapping) or not set(keys) <= set(value) <= set(keys) | {"per_collective"}:
        raise HardwareError(f"hardware profile: {field_name} must be an object with keys {', '.join(keys)} "
                            f"(and optionally per_collective); got {value!r}")
    try:
        return Link.from_json(value)
    except (TypeError, ValueError) as exc:
        raise HardwareError(f"hardware profile: {field_name}.per_collective must be a list of [collective, "
                            f"n_ranks, bandwidth_bytes_per_s, latency_s] rows; got "
                            f"{value.get('per_collective')!r} ({exc})") from exc


# --------------------------------------------------------------------------------- profiles
#
# Link latency: the alpha-beta model has one per-hop latency, NCCL's tuning model
# (src/graph/tuning.cc, FACTS.md) a base latency plus a per-hop one. Latency only matters
# for small messages, where NCCL picks the LL protocol (Ring LL: base 6.6 us; per hop NVLink
# 0.6 us, network 2.7 us), so alpha = per-hop + base / 14, the base spread over the
# 2(n-1) = 14 steps of an 8-rank ring all-reduce:
#   NVLink   0.6 + 6.6/14 ~= 1.1 us     network   2.7 + 6.6/14 ~= 3.2 us
# (an 8-GPU NVLink all-reduce of a few bytes then costs ~15 us, NCCL's own estimate).
_NVLINK_ALPHA_S = 1.1e-6
_IB_ALPHA_S = 3.2e-6

# Link bandwidth is the per-GPU *bus* bandwidth a ring collective sees (nccl-tests busBW:
# t = 2(n-1)/n * S / busBW for all-reduce), not the link's line rate.
_A100_NVLINK = Link(
    "nvlink3",
    200e9,  # A100 8x NVLink ring all-reduce busBW ~200 GB/s measured (nccl-tests issue 149; FACTS.md)
    _NVLINK_ALPHA_S,
)
_H100_NVLINK = Link(
    "nvlink4",
    370e9,  # H100 8-GPU ring all-reduce busBW ~370 GB/s measured, NVLS ~480 (nccl-tests issue 212; FACTS.md)
    _NVLINK_ALPHA_S,
)
_HDR_IB = Link(
    "ib-hdr",
    25e9,  # one InfiniBand HDR 200 Gb/s port per GPU = 25 GB/s line rate (FACTS.md, Links); an upper bound
    _IB_ALPHA_S,
)
_NDR_IB = Link(
    "ib-ndr",
    50e9,  # one InfiniBand NDR 400 Gb/s port per GPU = 50 GB/s line rate (FACTS.md, Links); an upper bound
    _IB_ALPHA_S,
)

# Every GPU profile prices kernels as autoparallel does: 70% of peak and a 7 us floor per
# kernel (meta-pytorch/autoparallel docs/how_autoparallel_chooses_a_strategy.md; FACTS.md).
_GPU_EFFICIENCY = 0.7
_GPU_KERNEL_OVERHEAD_S = 7e-6
# NCCL kernels run on their own SMs beside compute kernels, and DDP / FSDP hide much of their
# bucketed / prefetched traffic, but how much is not measured for these profiles: they assume
# none (0.0) until `autopar calibrate` on the GPUs measures it (a calibrated profile carries it)
_GPU_COMM_OVERLAP = 0.0

PROFILES: dict[str, Hardware] = {
    "a100-40gb": Hardware(
        name="a100-40gb",
        devices_per_node=8,  # DGX/HGX A100: 8 GPUs per node
        peak_flops=312e12,  # bf16 dense, NVIDIA A100 datasheet (FACTS.md; same chip as the 80 GB part)
        peak_flops_fp32=19.5e12,  # fp32 non-tensor, NVIDIA A100 datasheet (glennklockwood.com/garden/processors/A100)
        memory_bandwidth_bytes_per_s=1.555e12,  # 40 GB HBM2, NVIDIA A100 datasheet (glennklockwood.com/garden/processors/A100)
        memory_bytes=42_405_855_232,  # deviceQuery on an A100 40GB SXM: 40441 MiB (upb-pc2 wiki, NVIDIA A100 40GB with NVLINK)
        intra_node=_A100_NVLINK,
        inter_node=_HDR_IB,
        kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S,
        efficiency=_GPU_EFFICIENCY,
        comm_overlap=_GPU_COMM_OVERLAP,
    ),
    "a100-80gb": Hardware(
        name="a100-80gb",
        devices_per_node=8,
        peak_flops=312e12,  # bf16 dense (FACTS.md: A100 80GB 312 TFLOP/s)
        peak_flops_fp32=19.5e12,  # fp32 non-tensor, NVIDIA A100 datasheet (glennklockwood.com/garden/processors/A100)
        memory_bandwidth_bytes_per_s=2.039e12,  # HBM2e (FACTS.md: 2.04 TB/s)
        memory_bytes=80 * 2**30,  # 80 GB HBM2e, nominal (FACTS.md); calibrate for the exact usable figure
        intra_node=_A100_NVLINK,
        inter_node=_HDR_IB,
        kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S,
        efficiency=_GPU_EFFICIENCY,
        comm_overlap=_GPU_COMM_OVERLAP,
    ),
    "h100-80gb": Hardware(
        name="h100-80gb",
        devices_per_node=8,  # DGX/HGX H100: 8 GPUs per node
        peak_flops=989e12,  # bf16 dense, H100 SXM (FACTS.md)
        peak_flops_fp32=66.9e12,  # fp32 non-tensor, H100 SXM datasheet (glennklockwood.com/garden/processors/h100)
        memory_bandwidth_bytes_per_s=3.35e12,  # HBM3, H100 SXM (FACTS.md)
        memory_bytes=80 * 2**30,  # 80 GB HBM3, nominal (glennklockwood.com/garden/processors/h100); calibrate for usable
        intra_node=_H100_NVLINK,
        inter_node=_NDR_IB,
        kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S,
        efficiency=_GPU_EFFICIENCY,
        comm_overlap=_GPU_COMM_OVERLAP,
    ),
    "h200-141gb": Hardware(
        name="h200-141gb",
        devices_per_node=8,  # DGX/HGX H200: 8 GPUs per node
        peak_flops=989e12,  # bf16 dense: same GH100 chip as H100 SXM (FACTS.md); measured ~790 TFLOP/s 8192^3 here
        peak_flops_fp32=66.9e12,  # fp32 non-tensor, same chip as H100 SXM (glennklockwood.com/garden/processors/h100)
        memory_bandwidth_bytes_per_s=4.8e12,  # HBM3e, NVIDIA H200 spec; measured ~4.3 TB/s device copy here (FACTS.md)
        memory_bytes=141e9,  # 141 GB HBM3e (FACTS.md); CUDA shows ~139 GiB (~149e9) on the lent H200, so this keeps ~5% headroom
        intra_node=_H100_NVLINK,  # NVLink4 900 GB/s bidirectional like H100 (FACTS.md); busBW assumed as H100's
        inter_node=_NDR_IB,
        kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S,
        efficiency=_GPU_EFFICIENCY,
        comm_overlap=_GPU_COMM_OVERLAP,
    ),
    # Ranks of gloo over loopback on this project's small CPU machines (2 cores, 23 GiB). Each
    # "device" is a process; all of them share the cores, so these figures are rough - fit your
    # own with `autopar calibrate`.
    "cpu": Hardware(
        name="cpu",
        devices_per_node=8,
        # fp32 1024^3 matmul, torch on 2 threads here: ~53 GFLOP/s measured. NOTE bf16 matmul on
        # these CPUs (no AVX512-BF16) measured ~0.9 GFLOP/s; 50e9 assumes fp32 runs.
        peak_flops=50e9,
        peak_flops_fp32=50e9,
        memory_bandwidth_bytes_per_s=10e9,  # rough; a 64 MiB tensor copy measured ~17 GB/s read+write here
        memory_bytes=24 * 2**30,  # machine RAM (free -g: 23 GiB), shared by all ranks
        intra_node=Link(
            "gloo-loopback",
            1.9e9,  # gloo loopback 4 MB all-reduce ~1.9 GB/s (torchft PR 199; FACTS.md)
            200e-6,  # gloo small all-reduce ~0.2 ms (torchft PR 199; FACTS.md)
        ),
        inter_node=Link("gloo-loopback", 1.9e9, 200e-6),  # one box: same as intra (FACTS.md)
        kernel_overhead_s=10e-6,  # rough eager-mode per-op dispatch cost on CPU; calibrate
        efficiency=1.0,  # peak_flops above is already a measured matmul rate
        # 4 gloo ranks on 2 cores, 1 thread each: an all-reduce in flight beside matmuls took
        # longer than the two one after the other (autopar calibrate: measured 0, clamped)
        comm_overlap=0.0,
        shared_cores=2.0,  # this project's machines: 2 cores for all the ranks (calibrate measures it)
    ),
}


def list_hardware() -> list[str]:
    """Names of the built-in profiles."""
    return list(PROFILES)


def get_hardware(name_or_path: str) -> Hardware:
    """A built-in profile by name (case-insensitive), or a JSON profile file by path.

    A JSON profile holds the fields of :class:`Hardware`, links as
    ``{"name", "bandwidth_bytes_per_s", "latency_s"}`` (``autopar calibrate`` writes one).
    """
    if isinstance(name_or_path, Hardware):
        return name_or_path
    text = str(name_or_path).strip()
    key = text.lower()
    if key in PROFILES:
        return PROFILES[key]
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HardwareError(f"cannot read hardware profile {text!r}: {exc}; fix the file, or write a new one "
                                "with autopar calibrate --out PATH") from exc
        return Hardware.from_json(data)
    if text.endswith(".json") or os.sep in text:
        raise HardwareError(f"hardware profile file {text!r} does not exist; write one with autopar calibrate")
    names = ", ".join(PROFILES)
    close = difflib.get_close_matches(key, list(PROFILES), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise HardwareError(
        f"unknown hardware {text!r}; pick one of {names}, or a JSON profile path (see autopar calibrate){hint}"
    )
