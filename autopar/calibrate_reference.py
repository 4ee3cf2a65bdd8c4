"""The reference training step of ``autopar calibrate`` (CPU ranks): a small language model's
whole step (forward, backward, fused AdamW) timed on every rank at once, and the ``efficiency``
that makes the cost model price that step as it ran.

Why: the kernel rates ``autopar calibrate`` measures (a 1024^3 matmul, 64 MiB streams) are
what one kernel reaches with a core to itself for a fraction of a second. A training step runs
hundreds of smaller, odd-shaped kernels with autograd between them, and where ranks share a
core (4 ranks on this project's 2 cores) each time slice starts with the other rank's data in
the caches. Measured on this machine (bench/fidelity.py, 4 ranks pinned 2 per core): every
plan's CPU time per rank came out 1.3-1.6x what the kernel rates priced, the same for data,
tensor and pipeline parallel plans; one process alone measured 1/0.85 of its own solo profile.
The step's compute is what goes missing, so the fix is a measured compute efficiency (the
``Hardware.efficiency`` the GPU profiles set from published figures), not a per-plan factor.

How: the cost model's prediction for the reference step is ``A / efficiency + B`` (``A``: the
matmul and streaming terms the efficiency divides; ``B``: what it does not touch, the per-op
overhead, softmax at its own measured rate, the optimizer step at its measured rate). Two
predictions (efficiency 1 and 1/2) give ``A`` and ``B``; the measured step ``S`` then gives
``efficiency = A / (S - B)``, kept in [0.2, 1] (1: the step ran as fast as the kernel rates
say; the rates are a ceiling, so nothing is scaled up).

Timed as a synchronous step: each step ends at a barrier over the ranks, so it takes as long as
its slowest rank. A data-, tensor- or pipeline-parallel step waits for every rank at its
collectives; ranks sharing cores do not finish together (4 ranks pinned 2 per core, this
machine, 2026-12-08: the slowest rank's reference step 1.04-1.08x the median rank's), and a
profile fitted to a rank alone priced every multi-rank plan that much too fast.

The reference model is deliberately not any model a benchmark checks: a 2-layer GPT of width
192 with 6 heads, a 4096-token vocabulary, 4 sequences of 128 tokens (autopar's zoo GPT, so the
runtime's kernels are the ones timed). CUDA profiles keep their efficiency of 1 (a step this
small is launch-bound on a GPU and would say nothing about a real model's kernels).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

__all__ = ["REFERENCE_SHAPE", "EfficiencyFit", "reference_model", "time_reference_step", "fit_efficiency"]

# (n_layer, n_head, n_embd, vocab_size, batch, seq): see the module docstring
REFERENCE_SHAPE = (2, 6, 192, 4096, 4, 128)
_EFFICIENCY_RANGE = (0.2, 1.0)


@dataclasses.dataclass(frozen=True)
class EfficiencyFit:
    measured_s: float  # the reference step, median over ranks of each rank's median step
    predicted_at_one_s: float  # the cost model's step at efficiency 1 (the kernel rates as measured)
    efficiency: float  # what the profile gets (module docstring)


def reference_model(device: torch.device | str = "cpu"):
    """(model, (tokens, targets)) of the reference step, the same on every rank (seeded)."""
    from .models import gpt

    n_layer, n_head, n_embd, vocab, batch, seq = REFERENCE_SHAPE
    torch.manual_seed(0)
    return gpt("gpt-tiny", batch_size=batch, seq_len=seq, device=device, n_layer=n_layer, n_head=n_head,
               n_embd=n_embd, vocab_size=vocab, block_size=seq)


def time_reference_step(device: torch.device, between: Callable[[], None], quick: bool) -> float:
    """Median seconds of the reference steps as a synchronous step meets them; ``between()`` (a
    barrier over the ranks) runs before each step, so every rank's step runs while the others run
    theirs, and after it, inside the timing: each step takes as long as the slowest rank's (module
    docstring). One process (``between`` a no-op): its own step."""
    model, inputs = reference_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # autopar.make_optimizer's
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for k in range(2 + (3 if quick else 7)):
        between()
        t0 = time.perf_counter()
        model(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        between()
        if k >= 2:  # two warm-up steps: the optimizer's state, the allocator's first blocks
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_efficiency(hardware, measured_s: float) -> EfficiencyFit:
    """The efficiency under which ``hardware`` prices the reference step at ``measured_s``
    (module docstring); ``hardware`` as calibrated, its efficiency ignored."""
    from .planner import plan
    from .trace import trace

    gm = trace(*reference_model("meta"), stack_traces=False)  # traced once, priced twice

    def predicted(efficiency: float) -> float:
        hw = dataclasses.replace(hardware, efficiency=efficiency)
        p = plan(gm, 1, hardware=hw, strategy="dp", mixed_precision=False, baselines=False, pipeline=False,
                 recompute="none")
        return p.step_seconds

    at_one, at_half = predicted(1.0), predicted(0.5)
    scaled = at_half - at_one  # A: the terms 1/efficiency multiplies
    fixed = at_one - scaled  # B: the rest
    lo, hi = _EFFICIENCY_RANGE
    efficiency = hi if measured_s <= at_one else max(lo, min(hi, scaled / (measured_s - fixed)))
    return EfficiencyFit(measured_s, at_one, efficiency)
