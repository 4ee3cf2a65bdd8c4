"""3D tensor parallelism (arXiv 2105.14450) on ``x y z``: rows split over ``x`` (weights stored
split there and gathered for use), and the weight used split on both ``y`` and ``z`` (one axis
cuts k, giving a Partial output that is reduce-scattered: the 3D matmul's reduce-scatter; the
other cuts n): 1/q^3 of weights, activations and compute per device.

A family only: its collectives are reshards the cost model already prices. Family ``3d``.
"""

from __future__ import annotations

from .base import Family, Technique, register
from .pins import GridPin

__all__ = ["TENSOR_3D"]


def _meshes(n: int, hw) -> list:
    cube = round(n ** (1 / 3))
    sizes = [(cube, cube, cube)] if cube ** 3 == n and cube >= 2 else [
        (a, b, n // (a * b)) for a in range(2, n) for b in range(2, n) if n % (a * b) == 0 and n // (a * b) >= 2]
    return [(hw.mesh_spec(("x", "y", "z"), s), GridPin((0,), (0,), (1, 2), (1, 2))) for s in sizes[:6]]


TENSOR_3D = register(Technique(
    name="tensor_3d",
    title="3D tensor parallel (weights split on three axes; the matmul's k and n on two of them)",
    families=(Family("3d", "3D tensor parallel on x y z", _meshes, rank=32),),
))
