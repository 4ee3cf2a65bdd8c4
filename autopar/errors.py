"""Errors autopar raises for bad input: each names the problem, the value and the fix."""

from __future__ import annotations

__all__ = ["AutoparError", "TraceError", "BadArgumentError"]


class AutoparError(Exception):
    """Base class of autopar's user-facing errors."""


class TraceError(AutoparError):
    """The model could not be traced into a graph."""


class BadArgumentError(AutoparError, ValueError):
    """An argument of an autopar call (or a CLI option) has the wrong type or is out of range."""


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``840.0 KiB`` or ``96 B``: messages stay readable at any size."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
