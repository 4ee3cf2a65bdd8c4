"""The fused CPU optimizer kernels of ``csrc/fused_optim.cpp``, built once, with a torch fallback.

``extension()`` JIT-builds the C++ extension with ``torch.utils.cpp_extension.load`` into a
fixed folder (``AUTOPAR_EXT_DIR``, else ``<venv>/var/autopar-ext/torch-<version>``, else the
user cache), so the build (~1 min) happens once, from ``scripts/setup_env.sh``; later loads
reuse it (load() rebuilds only when the source changed). Where it cannot build (no compiler,
no ninja) it returns None after one ``FusedKernelWarning``, and callers run the torch ops of
this module instead: ``adam_step`` is the public entry point either way.
``AUTOPAR_DISABLE_EXT=1`` forces the fallback (its test uses it).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["FusedKernelWarning", "extension", "build_dir", "adam_step", "DISABLE_ENV"]

DISABLE_ENV = "AUTOPAR_DISABLE_EXT"
_SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "fused_optim.cpp"


class FusedKernelWarning(UserWarning):
    """The fused CPU optimizer kernel could not be built or loaded; the torch fallback runs."""


def build_dir() -> Path:
    """Where the extension is built and cached."""
    if os.environ.get("AUTOPAR_EXT_DIR"):
        return Path(os.environ["AUTOPAR_EXT_DIR"])
    tag = f"torch-{torch.__version__.replace('+', '_')}"
    if sys.prefix != sys.base_prefix:  # a virtual environment: keep it with the environment
        return Path(sys.prefix) / "var" / "autopar-ext" / tag
    return Path.home() / ".cache" / "autopar-ext" / tag


@functools.cache
def extension():
    """The loaded extension module, or None (with one warning) when it cannot be built."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        warnings.warn(f"{DISABLE_ENV} is set: fused CPU optimizer kernels disabled, torch fallback in use",
                      FusedKernelWarning, stacklevel=2)
        return None
    try:
        from torch.utils.cpp_extension import load  # on first use only: it imports setuptools and more

        if not _SOURCE.exists():
            raise FileNotFoundError(f"{_SOURCE} (an installed copy without csrc/)")
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        flags = ["-O3", "-fno-math-errno", "-fopenmp-simd"] + (["-march=native"] if _is_x86_or_arm() else [])
        return load(name="autopar_fused_optim", sources=[str(_SOURCE)], build_directory=str(folder),
                    extra_cflags=flags, verbose=False)
    except Exception as exc:  # any build or load failure: the fallback works everywhere
        warnings.warn(f"autopar's fused CPU optimizer kernel could not be built ({type(exc).__name__}: "
                      f"{str(exc)[:300]}); using the torch fallback (slower). Install a C++ compiler and "
                      f"ninja (pip install ninja), then run scripts/setup_env.sh", FusedKernelWarning, stacklevel=2)
        return None


def _is_x86_or_arm() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
              lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool = True,
              param_bf16: torch.Tensor | None = None) -> None:
    """One Adam (``decoupled=False``: L2) or AdamW step in place on fp32 CPU tensors, the same
    arithmetic as ``torch.optim.AdamW``; writes ``param_bf16`` (a bf16 copy) when given."""
    ext = extension()
    if ext is not None:
        ext.adam_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, decoupled,
                      param_bf16)
        return
    if decoupled:
        param.mul_(1 - lr * weight_decay)
    else:
        grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
    if param_bf16 is not None:
        param_bf16.copy_(param)
