"""The one-line API on real ranks (gloo on CPU), run by tests/test_api.py in one launch.

Each rank runs exactly the single-device loop plus ``model = autopar.parallelize(model, ...)``:
the optimizer is built on ``model.parameters()`` before the first forward, no example inputs are
given. Rank 0 saves losses, the gathered first-step gradients and the gathered parameters after
the last step, each rank's shard check against the plan, and the bytes sent per collective.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dist_cases import EPS, LR, STEPS, all_ranks, shard_mismatches  # noqa: E402

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             vocab_size=128, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
             tie_word_embeddings=False)


def llama(device: str = "cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(LlamaConfig(**LLAMA))


def build(name: str, weights: str | None = None):
    """(model, args, kwargs) for a case: ``model(*args, **kwargs)`` is the user's forward."""
    torch.manual_seed(0)
    if name == "gpt-tiny":
        from autopar.models import get_model

        model, inputs = get_model("gpt-tiny", batch_size=8, seq_len=16)
        return model, inputs, {}
    ids = torch.randint(0, LLAMA["vocab_size"], (8, 16), generator=torch.Generator().manual_seed(1))
    if name == "llama":
        return llama(), (), dict(input_ids=ids, labels=ids)
    if name == "llama-meta":  # a model that never exists whole: weights= or init on shards
        return llama("meta"), (), dict(input_ids=ids, labels=ids)
    if name == "llama-pretrained":  # the single-process reference of a checkpoint
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(weights), (), dict(input_ids=ids, labels=ids)
    raise KeyError(name)


def run_case(name: str, options: dict) -> dict:
    import autopar
    from autopar.runtime import count_bytes

    options = dict(options)
    model, args, kwargs = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)  # before parallelize and the first forward
    model = autopar.parallelize(model, baselines=False, **options)
    losses, grads, sent, out_type = [], None, [], None
    for step in range(STEPS):
        with count_bytes() as counted:
            out = model(*args, **kwargs)
            loss = out if isinstance(out, torch.Tensor) else out.loss  # a Hugging Face ModelOutput
            loss.backward()
        if step == 0:
            grads = model.full_grads()
            out_type = type(out).__name__, tuple(getattr(out, "logits", torch.empty(0)).shape)
        losses.append(loss.item())
        sent.append(dict(counted))
        opt.step()
        opt.zero_grad()
    shards = model.shards()
    opt_params = opt.param_groups[0]["params"]
    params = {s.tensor for s in shards if s.is_param}
    return dict(
        losses=losses, grads=grads, params=model.full_state_dict(), sent=sent, predicted=dict(model.plan.comm_bytes),
        shard_mismatches=[m for ms in all_ranks(shard_mismatches(model)) for m in ms],
        cut_params=sum(1 for s in shards if s.is_param and s.split_axes),
        local_numel=all_ranks(sum(s.tensor.numel() for s in shards if s.is_param and s.tied_to is None)),
        # the optimizer built before planning steps exactly this rank's shards
        optimizer_holds_shards=len(opt_params) == len(params) and all(any(p is q for q in params) for p in opt_params),
        devices=sorted({p.device.type for p in opt_params}), hardware=model.plan.hardware,
        mixed_precision=model.plan.mixed_precision, mesh=str(model.plan.mesh), output_type=out_type,
        peak_source_bytes=all_ranks(model.parallel_module.shard_source_peak_bytes))


def signature_error() -> str:
    """A second call with another batch shape: the lazy module's error."""
    import autopar

    model, args, _ = build("gpt-tiny")
    model = autopar.parallelize(model, baselines=False, strategy="dp")
    model(*args)
    try:
        model(torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))
    except autopar.AutoparError as exc:
        return str(exc)
    return ""


def main(rank: int, world: int, port: int, cases: list, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for key, name, options in cases:
            try:
                results[key] = dict(refused=signature_error()) if name == "signature" else run_case(name, options)
            except Exception as exc:  # reported per case by the test
                import traceback

                results[key] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
            dist.barrier()
    finally:
        if rank == 0:
            torch.save(results, out_path)
        dist.destroy_process_group()


if __name__ == "__main__":
    import json

    import torch.multiprocessing as mp

    world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(main, args=(world, port, json.loads(sys.argv[4]), out_path), nprocs=world)
