"""Prices of the runtime algorithms that replace plain reshards: ring attention, SUMMA, the sharded
layer norm and the vocabulary-parallel cross-entropy.

Each function lists the collectives one rank runs, as :class:`~autopar.cost_model.reshard.CommStep`
records (one per call), so the problem prices them with ``steps_seconds`` and the evaluator
counts their bytes exactly as the runtime's byte counter does (``runtime.ring_attention``,
``runtime.summa``; their tests assert the two agree).
"""

from __future__ import annotations

from .reshard import CommStep

import math

__all__ = ["ring_attention_steps", "summa_steps", "sharded_norm_steps", "vocab_parallel_ce_steps"]


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


def summa_steps(rows_local: int, k: int, n_local: int, q_r: int, q_c: int, row_axis: int, col_axis: int,
                elem_bytes: float, need_x_grad: bool, need_w_grad: bool, backward: bool) -> list[CommStep]:
    """SUMMA (``runtime.summa``) for ``x @ W.T`` with x's ``rows_local x k/q_c`` block and W's
    ``n_local x k/q_r`` block: ``lcm(q_r, q_c)`` panels of ``p = k / lcm`` columns of K. Per
    panel the forward broadcasts an x panel (``rows_local x p``) over the col axis and a W panel
    (``p x n_local``) over the row axis; the backward broadcasts the W panel again and reduces
    the x-gradient panel over the col axis (for x's gradient), and broadcasts the x panel again
    and reduces the W-gradient panel over the row axis (for W's). A size-1 axis moves nothing."""
    n_panels = math.lcm(q_r, q_c)
    p = k / n_panels
    a_panel, b_panel = rows_local * p * elem_bytes, p * n_local * elem_bytes
    a_b = [CommStep("broadcast", col_axis, a_panel)] if q_c > 1 else []
    b_b = [CommStep("broadcast", row_axis, b_panel)] if q_r > 1 else []
    per_panel = a_b + b_b
    if backward and need_x_grad:
        per_panel += b_b + ([CommStep("reduce", col_axis, a_panel)] if q_c > 1 else [])
    if backward and need_w_grad:
        per_panel += a_b + ([CommStep("reduce", row_axis, b_panel)] if q_r > 1 else [])
    return per_panel * n_panels


def sharded_norm_steps(rows_local: int, axis: int, elem_bytes: float, backward: bool) -> list[CommStep]:
    """Layer norm over a split hidden dim (``runtime.sharded_norm``): the forward all-reduces
    the per-row sum and then the per-row squared deviation (one fp32 value per row each), the
    backward both per-row gradient sums in one all-reduce."""
    stat = rows_local * max(elem_bytes, 4.0)
    steps = [CommStep("all_reduce", axis, stat), CommStep("all_reduce", axis, stat)]
    if backward:
        steps.append(CommStep("all_reduce", axis, 2 * stat))
    return steps


def vocab_parallel_ce_steps(rows: int, n: int, axis: int, elem_bytes: float) -> list[CommStep]:
    """Cross-entropy over logits split on the class dim (``runtime.vocab_parallel_ce``): one
    all-gather of three per-row statistics (max, sum of exponentials, the target's logit), in
    fp32 or wider, from each of the ``n`` ranks; the backward is local. Recompute repeats it."""
    if n <= 1:
        return []
    return [CommStep("all_gather", axis, n * rows * 3 * max(elem_bytes, 4.0))]
