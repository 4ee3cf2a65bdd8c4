"""autopar.optim: large-batch optimizers that are correct on sharded parameters, and fused
CPU optimizer steps.

    from autopar.optim import LAMB, LARS, CPUAdamW
    opt = LAMB(pm.parameters(), lr=2e-3, weight_decay=0.01)   # pm = autopar.runtime.parallel_module.parallelize(...)

LAMB and LARS read each local Parameter's ShardInfo (set by ``parallelize``) and reduce their
trust-ratio norms over exactly the mesh axes it is split on; on an unparallelized model they
are ordinary single-process optimizers. ``CPUAdamW`` runs the fused kernel of ``csrc/`` (or
its torch fallback) on fp32 CPU tensors, e.g. an offloaded master copy.
"""

from __future__ import annotations

from .cpu_adamw import CPUAdamW
from .cpu_kernels import FusedKernelWarning, adam_step
from .hyper import OptimizerConfigError
from .lamb import LAMB
from .lars import LARS

__all__ = ["LAMB", "LARS", "CPUAdamW", "adam_step", "FusedKernelWarning", "OptimizerConfigError"]
