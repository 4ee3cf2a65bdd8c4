"""Hyper-parameter checks shared by autopar's optimizers: a bad value is refused before any
state exists, with the value and the range it must lie in."""

from __future__ import annotations

import math

from autopar.errors import AutoparError

__all__ = ["OptimizerConfigError", "check_range"]


class OptimizerConfigError(AutoparError, ValueError):
    """An optimizer hyper-parameter out of its range (also a ValueError, as torch's optimizers raise)."""


def check_range(optimizer: str, name: str, value: float, lo: float = 0.0, hi: float = math.inf,
                hi_open: bool = False) -> None:
    """Raise unless lo <= value <= hi (value < hi when ``hi_open``)."""
    ok = lo <= value and (value < hi if hi_open else value <= hi)
    if not ok or math.isnan(value):
        top = f"< {hi}" if hi_open else (f"<= {hi}" if math.isfinite(hi) else "")
        raise OptimizerConfigError(f"{optimizer}: {name}={value!r} is out of range; pass {lo} <= {name} {top}".rstrip())
