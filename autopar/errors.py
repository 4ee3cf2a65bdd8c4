"""Errors autopar raises for bad input: each names the problem and the fix."""

from __future__ import annotations

__all__ = ["AutoparError", "TraceError"]


class AutoparError(Exception):
    """Base class of autopar's user-facing errors."""


class TraceError(AutoparError):
    """The model could not be traced into a graph."""
