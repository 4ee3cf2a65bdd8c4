"""Step time with communication overlapped: which collectives hide behind which compute.

The runtime runs some collectives asynchronously, beside compute:

* replicated parameters' gradient all-reduces, bucketed (``runtime.grad_buckets``): a bucket
  launches as soon as backward has produced its gradients and runs while backward goes on;
* ZeRO-3's gathers, prefetched one ahead in forward and in backward, and its gradient
  reduce-scatters, launched asynchronously (``runtime.fsdp``).

Everything else is on the critical path, because the next op reads its result: tensor-parallel
all-reduces and every other reshard of an activation, ZeRO-2's gathers, the norms' all-reduces
of LAMB/LARS, a pipeline's once-per-step gradient syncs (``runtime.pipeline`` runs them after
the schedule). So a step takes::

    compute + critical_comm + async_comm - hidden,
    hidden = comm_overlap * min(async_comm, window)

where ``window`` is the forward and backward compute (recompute included; not the optimizer
step, which runs after every collective has landed) and ``comm_overlap`` the hardware's
measured fraction of asynchronous communication that actually hides (``autopar calibrate``
runs an all-reduce while matmuls run and compares with both alone: on a GPU NCCL has its own
SMs and hides nearly all of it; CPU ranks that share their cores with gloo's threads hide
less). ``evaluate`` prices the chosen plan, every baseline and ``explain`` this way; the ILP
minimises the same step: a min is concave, so a column h under two rows (h <= overlap * async,
h <= overlap * window) that the objective subtracts takes its value at the optimum
(``cost_model.ilp_model._add_overlap``).
"""

from __future__ import annotations

__all__ = ["hidden_comm_seconds"]


def hidden_comm_seconds(async_comm_s: float, window_s: float, comm_overlap: float) -> float:
    """Seconds of ``async_comm_s`` that run hidden behind ``window_s`` of compute (see module doc)."""
    if async_comm_s <= 0.0 or window_s <= 0.0:
        return 0.0
    return comm_overlap * min(async_comm_s, window_s)
