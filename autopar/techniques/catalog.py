"""Import every technique file in this folder, so each one registers itself (``autopar.technique``).

A new technique is picked up by dropping its file here; nothing else names it. Modules that are
not techniques (``pins``, this one) register nothing. The search (``autopar.planner``),
the lowering (``passes.lower``) and the report import this module.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

from autopar.technique import techniques

__all__ = ["NAMES"]

_NOT_TECHNIQUES = {"pins", "catalog"}

for _info in sorted(pkgutil.iter_modules([os.path.dirname(__file__)]), key=lambda m: m.name):
    if _info.name not in _NOT_TECHNIQUES:
        importlib.import_module(f"{__package__}.{_info.name}")

NAMES = tuple(t.name for t in techniques())
