"""autopar: compiler-style auto-parallelization for PyTorch.

    gm = autopar.trace(model, example_inputs)          # torch.fx graph, shapes on every node
    autopar.annotate(gm, autopar.MeshSpec.parse("dp=2,tp=4"))   # candidate strategies per node
    plan = autopar.plan(model, 8, example_inputs)          # mesh, layouts, predicted time and memory
    model = autopar.parallelize(model)                      # under torchrun: plans on the first call
"""

from __future__ import annotations

import gc

# The imports below load torch (its C extension, torch.distributed, sympy): ~270K objects and
# none of them garbage, yet the cyclic collector walked them all in 4-5 full collections that
# freed next to nothing, 0.3 s of a 5-s `autopar plan gpt2 --gpus 8`. It is paused for them
# and left as it was found.
_collecting = gc.isenabled()
gc.disable()
try:
    from .errors import AutoparError, BadArgumentError, TraceError
    from .mesh import Link, MeshError, MeshSpec
    from .strategy import Cost, Layout, Strategy
    from .trace import trace
    from .passes import FALLBACK_KEY, STRATEGIES_KEY, UnknownOpWarning, annotate
    from .passes.rules import register_rule, temporary_rule
    from .plan import Plan
    from .planner import plan
finally:
    if _collecting:
        gc.enable()
    del _collecting

__all__ = [
    "trace", "annotate", "plan", "parallelize", "Plan", "MeshSpec", "Link", "Layout", "Strategy", "Cost", "register_rule", "temporary_rule",
    "AutoparError", "BadArgumentError", "TraceError", "MeshError", "UnknownOpWarning", "STRATEGIES_KEY", "FALLBACK_KEY",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The runtime (torch.distributed, the lowering) loads on first use: `import autopar` stays light,
    # and autopar.parallelize is autopar.runtime.parallel_module.parallelize, the same function.
    if name == "parallelize":
        from .runtime.parallel_module import parallelize

        return parallelize
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
