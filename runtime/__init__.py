"""What runs on the ranks: autograd-aware collectives, the parallel module, its state.

The package namespace holds only the byte counter: ``autopar.runtime.parallel_module`` (the
driver, ``parallelize``) sits above the lowering pass, which itself calls the kernels here
(``collectives``, ``fsdp``, ...), so importing the driver from this ``__init__`` would make
``import autopar.passes.lower`` circular. Use ``autopar.parallelize`` (or
``autopar.runtime.parallel_module``).
"""

from .collectives import COUNTER, count_bytes

__all__ = ["count_bytes", "COUNTER"]
