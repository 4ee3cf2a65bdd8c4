"""autopar: compiler-style auto-parallelization for PyTorch.

    gm = autopar.trace(model, example_inputs)          # torch.fx graph, shapes on every node
    autopar.annotate(gm, autopar.MeshSpec.parse("dp=2,tp=4"))   # candidate strategies per node
    plan = autopar.plan(model, 8, example_inputs)          # mesh, layouts, predicted time and memory
    model = autopar.parallelize(model)                      # under torchrun: plans on the first call
"""

from __future__ import annotations

from .errors import AutoparError, BadArgumentError, TraceError
from .mesh import Link, MeshError, MeshSpec
from .strategy import Cost, Layout, Strategy
from .trace import trace
from .passes import FALLBACK_KEY, STRATEGIES_KEY, UnknownOpWarning, annotate
from .passes.rules import register_rule, temporary_rule
from .plan import Plan
from .planner import plan

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
