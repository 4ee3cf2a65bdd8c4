"""Multi-process cases of activation recompute, run by tests/test_recompute.py in one launch.

Each rank runs every case: parallelize a freshly seeded model with a recompute option, train 3
AdamW steps, and record what dist_cases records (losses, first-step gradients, parameters after
the last step, bytes per collective per step), plus which blocks the program checkpoints and
the live bytes the first step's forward leaves for backward and the peak of its forward +
backward, both above what was live before it (``bench/memtrack.py``: every storage an op
touches, from first sight until freed).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from dist_cases import EPS, LR, STEPS, build as build_zoo  # noqa: E402

LLAMA_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)


def build(name: str):
    """The zoo's models, and a tiny Hugging Face Llama built from its config (no download)."""
    if name != "hf-llama-tiny":
        return build_zoo(name)
    from transformers import LlamaConfig, LlamaForCausalLM

    from autopar.models.hf import HFLossWrapper

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_TINY, use_cache=False, attn_implementation="sdpa", attention_dropout=0.0,
                         tie_word_embeddings=False)
    model = HFLossWrapper(LlamaForCausalLM(config)).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 16), generator=g)
    return model, (ids, torch.randint(0, 128, (8, 16), generator=g))


def case_key(case) -> str:
    name, options = case
    return name + "".join(f"/{k}={v}" for k, v in sorted(options.items()))


def run_case(name: str, options: dict) -> dict:
    from memtrack import LiveBytes

    from autopar.passes.recompute_regions import RECOMPUTED_KEY
    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize

    model, inputs = build(name)
    pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=False, baselines=False,
                     **options)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses, sent_per_step, grads, peak, kept = [], [], None, 0.0, 0.0
    for step in range(STEPS):
        with count_bytes() as sent:
            if step == 0:
                with LiveBytes() as mem:
                    mem.track(list(pm.parameters()) + list(inputs))
                    base = mem.live_bytes
                    loss = pm(*inputs)
                    kept = mem.live_bytes - base  # what the forward left alive for backward
                    loss.backward()
                peak = mem.peak_bytes - base
            else:
                loss = pm(*inputs)
                loss.backward()
        if step == 0:
            grads = pm.full_grads()
        losses.append(loss.item())
        sent_per_step.append(dict(sent))
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), sent=sent_per_step,
                predicted=dict(pm.plan.comm_bytes), mesh=str(pm.plan.mesh), recompute=list(pm.plan.recompute),
                checkpointed=list(pm.program.meta.get(RECOMPUTED_KEY, [])), peak_bytes=peak, kept_bytes=kept,
                predicted_activation_bytes=pm.plan.activation_bytes,
                strategies={n.name: n.strategy for n in pm.plan.nodes})


def case(rank: int, world: int, name: str, options: dict) -> dict:
    """One case on this rank (run by tests/launcher.py)."""
    return run_case(name, options)
