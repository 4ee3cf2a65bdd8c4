"""The hardware profile and precision of the machine a program runs on.

``autopar.parallelize`` plans for the devices its ranks hold, not for a default GPU:

* ``hardware=`` (a profile name, a calibrated JSON file or a :class:`Hardware`) wins; then the
  ``AUTOPAR_HARDWARE`` environment variable (same forms);
* on CUDA, the built-in profile whose GPU matches ``torch.cuda.get_device_name()`` (A100 40/80 GB,
  H100, H200), with ``devices_per_node`` from ``LOCAL_WORLD_SIZE`` (torchrun sets it) when given;
* otherwise the ``cpu`` profile.

``default_mixed_precision`` is the one place that says which precision a run defaults to:
bf16 mixed precision on CUDA, fp32 on CPU (no bf16 matrix units on this project's CPUs).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .hardware import PROFILES, Hardware, HardwareError, get_hardware

__all__ = ["HARDWARE_ENV", "local_hardware", "gpu_profile_name", "default_mixed_precision"]

HARDWARE_ENV = "AUTOPAR_HARDWARE"

# (substring of the CUDA device name, profile); A100s are told apart by their memory below.
_GPU_NAMES = (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb"))


def gpu_profile_name(device_name: str, total_memory_bytes: int) -> str | None:
    """The built-in profile for a CUDA device name (``NVIDIA A100-SXM4-40GB``, ``NVIDIA H200``...),
    or None if none matches."""
    lowered = device_name.lower()
    for key, profile in _GPU_NAMES:
        if key in lowered:
            if profile == "a100-80gb" and ("40gb" in lowered or total_memory_bytes < 60 * 2**30):
                return "a100-40gb"
            return profile
    return None


def local_hardware(hardware: str | Hardware | None = None, device_type: str | None = None) -> Hardware:
    """The profile to plan with on this machine (see module doc)."""
    if hardware is not None:
        return get_hardware(hardware)
    if os.environ.get(HARDWARE_ENV):
        return get_hardware(os.environ[HARDWARE_ENV])
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cuda":
        return PROFILES["cpu"]
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    profile = gpu_profile_name(name, torch.cuda.get_device_properties(index).total_memory)
    if profile is None:
        raise HardwareError(
            f"no built-in hardware profile matches the GPU {name!r} (known: A100 40/80 GB, H100, H200); "
            f"measure one with `autopar calibrate` and pass hardware=PATH or set {HARDWARE_ENV}=PATH, "
            f"or pass the closest built-in profile by name (hardware='h100-80gb')")
    hw = PROFILES[profile]
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0:
        hw = dataclasses.replace(hw, devices_per_node=int(local))
    return hw


def default_mixed_precision(device_type: str | None = None) -> bool:
    """bf16 mixed precision on CUDA, fp32 on CPU: the default of ``parallelize`` and ``plan``
    where the caller does not say (``mixed_precision=True/False`` always wins)."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return device_type == "cuda"
