"""Fine-tune a Hugging Face Llama-architecture model from a save_pretrained directory, on CPU ranks,
with the one-line API. The model is made on the meta device and never exists whole on any rank:
each rank reads only its slices of the safetensors checkpoint.

    torchrun --nproc_per_node 4 examples/finetune_hf.py [--dir /tmp/tiny-llama] [--steps 30] [--strategy zero3]

Without a checkpoint at --dir, rank 0 first writes a small one, built from a config (no download).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

import autopar


def batches(vocab: int, batch: int, seq: int, seed: int):
    """A learnable corpus: each sequence counts up from a random start with a random stride (mod vocab)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        yield (start + stride * torch.arange(seq)) % vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/autopar-tiny-llama")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--strategy", default="auto", help="auto, or pin a family: dp, zero3, megatron, ...")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        if rank == 0:
            torch.manual_seed(0)
            config = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=256, max_position_embeddings=128,
                                 tie_word_embeddings=False)
            LlamaForCausalLM(config).save_pretrained(args.dir)
        dist.barrier()

    config = AutoConfig.from_pretrained(args.dir)
    config.use_cache = False  # training: no KV cache in the outputs
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = autopar.parallelize(model, weights=args.dir, strategy=args.strategy)  # the one added line
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    data = batches(config.vocab_size, args.batch, args.seq, seed=1)
    for step in range(args.steps):
        ids = next(data)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {out.loss.item():.4f}  logits {tuple(out.logits.shape)}", flush=True)
    if rank == 0:
        plan = model.plan
        held = sum(p.numel() for p in model.parameters())
        print(f"plan: {plan.strategy} on mesh {plan.mesh}, hardware {plan.hardware}; rank 0 holds {held:,} of "
              f"{sum(_numel(s.global_shape) for s in model.shards() if s.is_param and s.tied_to is None):,} "
              f"parameters")
    dist.destroy_process_group()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
