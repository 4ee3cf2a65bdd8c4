"""Prices of the runtime algorithms that replace plain reshards: ring attention and SUMMA.

Each function lists the collectives one rank runs, as :class:`~autopar.cost_model.reshard.CommStep`
records (one per call), so the problem prices them with ``steps_seconds`` and the evaluator
counts their bytes exactly as the runtime's byte counter does (``runtime.ring_attention``,
``runtime.summa``; their tests assert the two agree).
"""

from __future__ import annotations

from .reshard import CommStep

__all__ = ["ring_attention_steps"]


def ring_attention_steps(k_local_bytes: float, v_local_bytes: float, n: int, axis: int,
                         backward: bool, elem_bytes: float = 4.0) -> list[CommStep]:
    """Ring attention over ``n`` ranks of ``axis``: forward, ``n - 1`` steps that each send the
    current K and V blocks (one message) to the next rank; backward, K and V travel the ring
    again (``n - 1`` steps) and their gradient accumulators, kept in fp32 whatever the
    activations' ``elem_bytes``, travel one step further (``n`` sends) back to the owner."""
    if n <= 1:
        return []
    kv = CommStep("p2p", axis, k_local_bytes + v_local_bytes)
    steps = [kv] * (n - 1)
    if backward:
        grad = CommStep("p2p", axis, (k_local_bytes + v_local_bytes) * max(elem_bytes, 4.0) / elem_bytes)
        steps += [kv] * (n - 1) + [grad] * n
    return steps
