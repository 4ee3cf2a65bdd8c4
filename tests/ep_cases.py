"""Expert-parallel cases on gloo ranks, run by tests/test_expert_parallel.py through the shared
launcher (tests/launcher.py), in the session's 4-rank launch. Each rank trains a
tiny Hugging Face Mixtral (4 experts, top-2): ``case_mixtral_ep`` with the runtime kernel by hand
(experts split over all ranks, other weights data parallel), ``case_mixtral_planned`` through
``autopar.parallelize(model, strategy="ep")`` (the planner's region, pricing and lowering).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from byte_spy import ByteSpy

STEPS = 3
LR = 1e-3
EPS = 1e-6
BATCH, SEQ, VOCAB = 8, 8, 64


def build_mixtral(seed: int = 0, experts: int = 4, top_k: int = 2):
    """Tiny Mixtral (2 layers, ``experts`` experts, ``top_k``) and one batch ``(input_ids, labels)``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from autopar.models.hf import HFLossWrapper

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
                        num_experts_per_tok=top_k, max_position_embeddings=SEQ, use_cache=False,
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


def case_mixtral_planned(rank: int, world: int, top_k: int = 2) -> dict:
    """The planner's way: ``autopar.parallelize(model, strategy="ep")`` on the global batch, the
    single-process loop otherwise. Returns losses, gathered first gradients and final parameters,
    each rank's expert-weight shapes with the plan's layouts, the plan's all-to-all bytes and
    what the spy counted on every rank per step."""
    import autopar
    from dist_cases import shard_mismatches

    model, (ids, labels) = build_mixtral(top_k=top_k)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    # no example inputs: the optimizer built above is moved onto the shards at the first call
    pm = autopar.parallelize(model, strategy="ep", baselines=False, hardware="a100-80gb", mixed_precision=False)
    losses, grads, sent = [], None, []
    for step in range(STEPS):
        with ByteSpy() as spy:
            loss = pm(ids, labels)
            loss.backward()
        sent.append(spy.sent.get("all_to_all", 0.0))
        if step == 0:
            grads = {k: v.clone() for k, v in pm.full_grads().items()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    experts = {i.name: (tuple(i.tensor.shape), i.global_shape, i.dim_axes) for i in pm.shards() if ".experts." in i.name}
    per_rank_sent = [None] * world
    dist.all_gather_object(per_rank_sent, sent)
    per_rank_experts = [None] * world
    dist.all_gather_object(per_rank_experts, experts)
    plan = pm.plan
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), sent_per_rank=per_rank_sent,
                experts_per_rank=per_rank_experts, mesh=(plan.mesh.axes, plan.mesh.sizes),
                predicted=dict(plan.comm_bytes), shard_mismatches=shard_mismatches(pm),
                regions={n.name: n.input_layouts for n in plan.nodes if n.name.startswith("region_")})
