"""Import every technique file in this folder, so each one registers itself on ``base``.

A new technique is picked up by dropping its file here; nothing else names it. Modules that are
not techniques (``base``, ``pins``, this one) register nothing. The search (``autopar.planner``),
the lowering (``passes.lower``) and the report import this module.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from . import base

__all__ = ["NAMES"]

_NOT_TECHNIQUES = {"base", "pins", "catalog"}

for _info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda m: m.name):
    if _info.name not in _NOT_TECHNIQUES:
        importlib.import_module(f"{__package__}.{_info.name}")

NAMES = tuple(t.name for t in base.techniques())
