"""2.5D tensor parallelism (Tesseract, arXiv 2105.14500) on ``dep x row x col``: 2D on
``row x col``, and the ``dep`` axis splits the rows again with the weights replicated over it
(their gradients all-reduced there): parameter memory 1/q^2, activations 1/(d q^2).

A family only: its matmuls are the 2D ones (plain, or SUMMA's panel loop), its collectives
reshards and gradient syncs the cost model already prices. Family ``2.5d``.
"""

from __future__ import annotations

import math

from .base import Family, Technique, register
from .pins import GridPin

__all__ = ["TESSERACT"]


def _meshes(n: int, hw) -> list:
    out = []
    for q in range(2, int(math.isqrt(n // 2)) + 1):
        if n % (q * q) == 0 and n // (q * q) >= 2:
            out.append((hw.mesh_spec(("dep", "row", "col"), (n // (q * q), q, q)), GridPin((0, 1), (1,), (2,), (2,))))
    return out


TESSERACT = register(Technique(
    name="tesseract",
    title="2.5D tensor parallel (Tesseract: 2D on two axes, the batch split again over a depth axis)",
    families=(Family("2.5d", "2.5D tensor parallel (Tesseract) on dep x row x col", _meshes, rank=31),),
))
