"""What runs on the ranks: autograd-aware collectives, the parallel module, its state."""

from .collectives import COUNTER, count_bytes

__all__ = ["parallelize", "ParallelModule", "count_bytes", "COUNTER"]


def __getattr__(name: str):
    # parallelize imports the lowering pass, which imports the collectives above: loading it
    # on first use keeps `import autopar.passes.lower` free of an import cycle.
    if name in ("parallelize", "ParallelModule"):
        import importlib

        return getattr(importlib.import_module(f"{__name__}.parallel_module"), name)
    raise AttributeError(f"module 'autopar.runtime' has no attribute {name!r}")
