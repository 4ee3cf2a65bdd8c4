"""Expert-parallel cases on gloo ranks, run by tests/test_expert_parallel.py through the shared
launcher (tests/launcher.py), in the session's 4-rank launch. Each rank trains a
tiny Hugging Face Mixtral (4 experts, top-2) whose experts are split over all ranks
(``runtime.expert_parallel``) and whose other weights are replicated (data parallel: the
gradient all-reduced); every rank holds its own slice of the batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from byte_spy import ByteSpy

STEPS = 3
LR = 1e-3
EPS = 1e-6
BATCH, SEQ, VOCAB = 8, 8, 64


def build_mixtral(seed: int = 0, experts: int = 4):
    """Tiny Mixtral (2 layers, ``experts`` experts, top-2) and one batch ``(input_ids, labels)``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from autopar.models.hf import HFLossWrapper

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=2, max_position_embeddings=SEQ, use_cache=False,
                        attn_implementation="sdpa", router_jitter_noise=0.0)
    torch.manual_seed(seed)
    model = HFLossWrapper(MixtralForCausalLM(cfg)).train()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return model, (ids, ids.clone())


def _gather_experts(local: torch.Tensor, world: int) -> torch.Tensor:
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local.contiguous())
    return torch.cat(pieces)


def case_mixtral_ep(rank: int, world: int, break_combine_scale: bool = False, experts: int = 4) -> dict:
    from autopar.runtime.expert_parallel import ExpertAxis, ExpertParallelExperts, shard_experts

    model, (ids, labels) = build_mixtral(experts=experts)
    num_experts = model.model.config.num_local_experts
    axis = ExpertAxis(group=None, size=world, rank=rank, num_experts=num_experts)
    replaced = shard_experts(model, axis)
    experts = {n for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    expert_params = {n for n, _ in model.named_parameters() if n.rpartition(".")[0] in experts}
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n in expert_params}
    rows = BATCH // world
    my_ids, my_labels = ids[rank * rows:(rank + 1) * rows], labels[rank * rows:(rank + 1) * rows]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads, sent = [], {}, []
    for step in range(STEPS):
        with ByteSpy() as spy:
            loss = model(my_ids, my_labels)
            loss.backward()
            a2a = spy.sent.get("all_to_all", 0.0)
        # Global loss = mean of the ranks' losses (equal token counts): dense gradients are
        # averaged; an expert's gradient already sums every rank's tokens (the all-to-all's
        # backward brought them), so it is divided by the world size only.
        for name, p in model.named_parameters():
            if name in expert_params:
                p.grad /= 1 if break_combine_scale else world
            else:
                dist.all_reduce(p.grad)
                p.grad /= world
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        sent.append(a2a)
        if step == 0:
            grads = {n: (_gather_experts(p.grad, world) if n in expert_params else p.grad.clone())
                     for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {n: (_gather_experts(p.detach(), world) if n in expert_params else p.detach().clone())
              for n, p in model.named_parameters()}
    per_rank_sent = [None] * world
    dist.all_gather_object(per_rank_sent, sent)
    return dict(losses=losses, grads=grads, params=params, local_expert_shapes=shapes, replaced=replaced,
                sent_per_rank=per_rank_sent)
