"""The all-reduces of whole-tensor norms that LAMB and LARS add to a step (``autopar.optim``).

Each step reduces, per mesh axis, one fp32 vector holding two squared norms (LAMB: the
parameter and its update; LARS: the parameter and its gradient) of every parameter whose
piece is split on that axis (cut by its layout, or a ZeRO-2 flat piece): exactly what
``autopar.optim.shard_norms.reduce_squared_norms`` sends. Latency-bound (a few bytes per
parameter), so it is priced in ``evaluate`` (plans, baselines, explain) and not given to the
ILP, where it would only shift every option on an axis by about the same latency.
"""

from __future__ import annotations

from collections import Counter

from .problem import Problem

__all__ = ["NORMS_PER_PARAM", "norm_allreduce_bytes"]

# Squared norms per parameter per step that an optimizer reduces over the parameter's split axes.
NORMS_PER_PARAM = {"lamb": 2, "lars": 2}
_FP32_BYTES = 4


def norm_allreduce_bytes(problem: Problem, choice: dict[str, int], optimizer: str) -> dict[int, float]:
    """Mesh axis -> bytes of the one norm all-reduce on it per step (empty for other optimizers)."""
    per_param = NORMS_PER_PARAM.get(optimizer, 0)
    if not per_param:
        return {}
    params_on_axis: Counter[int] = Counter()
    for key, d in problem.decisions.items():
        if not d.is_param:
            continue
        strategy, zero_axes = d.options[choice[key]][0], d.options[choice[key]][1]
        cut = {a for a, code in enumerate(strategy.output.codes) if code >= 0}
        for axis in cut | set(zero_axes):
            params_on_axis[axis] += problem.counts.get(key, 1)  # repeated blocks share one decision
    return {a: float(k * per_param * _FP32_BYTES) for a, k in sorted(params_on_axis.items())}
