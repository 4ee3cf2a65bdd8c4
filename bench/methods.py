"""The training methods the runtime benchmark compares, each set up on one rank of a running
process group: autopar (any strategy family), torch DDP, torch FSDP2 and a hand-written
Megatron-style tensor parallelism on ``torch.distributed.tensor.parallel``.

Every ``setup_*`` takes the full model (built identically on every rank from one seed) and the
global batch, and returns a :class:`Runner`: the module to train, the parameter groups for the
optimizer, this rank's inputs and how to read the step's global loss. Each method sees the same
global batch per step: DDP and FSDP2 cut it by rank, tensor parallelism feeds it whole to every
rank, autopar takes it whole and cuts what its plan says.
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Runner", "SETUPS", "setup"]


@dataclass
class Runner:
    module: nn.Module
    param_groups: list[dict[str, Any]]
    inputs: tuple[torch.Tensor, ...]
    mesh: str
    global_loss: Callable[[torch.Tensor], float]  # this rank's loss -> the global batch's loss
    step_context: Callable[[], Any] = contextlib.nullcontext  # around forward and backward
    info: dict[str, Any] = field(default_factory=dict)  # plan figures (autopar)


def _rank_slice(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    if t.shape[0] % world:
        raise ValueError(f"global batch {t.shape[0]} does not split over {world} ranks")
    return t.chunk(world, dim=0)[rank].contiguous()


def _mean_over_ranks(loss: torch.Tensor) -> float:
    x = loss.detach().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def setup_autopar(model: nn.Module, inputs, family: str, hardware: str) -> Runner:
    from autopar.runtime.parallel_module import parallelize

    pm = parallelize(model, example_inputs=inputs, hardware=hardware, strategy=family, baselines=False,
                     mixed_precision=False)
    p = pm.plan
    # parameters the returned module holds besides the ones its program trains (e.g. the traced
    # graph's copy of the unsharded weights): counted by the memory tracker, reported apart
    trained = {id(t) for t in pm.program.parameters()}
    held_bytes = sum(t.numel() * t.element_size() for t in pm.parameters() if id(t) not in trained)
    info = dict(retained_untrained_param_bytes=held_bytes, n_param_tensors=len(list(pm.parameters())),
                n_trained_param_tensors=len(trained),
                predicted_step_s=p.step_seconds, predicted_peak_bytes=p.peak_memory_bytes_per_device,
                predicted_comm_bytes=dict(p.comm_bytes), plan_s=p.solver.plan_seconds,
                predicted_compute_s=p.compute_seconds, predicted_comm_s=p.comm_seconds)
    return Runner(pm, [{"params": list(pm.parameters())}], tuple(inputs), str(p.mesh),
                  lambda loss: loss.item(), info=info)


def setup_ddp(model: nn.Module, inputs, hardware: str) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights (identical anyway)
    return Runner(ddp, [{"params": list(ddp.parameters())}], tuple(_rank_slice(t) for t in inputs),
                  f"dp={dist.get_world_size()}", _mean_over_ranks)


def setup_fsdp2(model: nn.Module, inputs, hardware: str) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:  # one all-gather / reduce-scatter group per transformer block
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the rest: embeddings, final norm, head
    return Runner(model, [{"params": list(model.parameters())}], tuple(_rank_slice(t) for t in inputs),
                  f"dp={world} (FSDP2, reshard after forward)", _mean_over_ranks)


def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """SelfAttention.forward on this rank's heads: q/k/v are column-parallel, so each rank
    holds n_head / tp whole heads (as torchtitan's parallelize sets n_heads per rank)."""
    b, t, _ = x.shape
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    local_heads = q.shape[-1] // self.head_dim
    q, k, v = (z.view(b, t, local_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
    y = y.transpose(1, 2).reshape(b, t, local_heads * self.head_dim)
    return self.resid_dropout(self.out_proj(y))


def setup_tp(model: nn.Module, inputs, hardware: str) -> Runner:
    """Megatron 1D tensor parallelism over all ranks (one ``tp`` axis of size world): q/k/v and
    fc_in column-parallel, out_proj and fc_out row-parallel (one all-reduce each in forward and
    backward per sub-layer), the token embedding vocab-parallel, lm_head column-parallel with the
    loss computed on vocab shards (``loss_parallel``). Norms and position embedding replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                   parallelize_module)

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i, block in enumerate(model.blocks):
        if block.attn.n_head % world:
            raise ValueError(f"n_head={block.attn.n_head} does not split over tp={world}")
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.out_proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc_in"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc_out"] = RowwiseParallel()
        block.attn.forward = types.MethodType(_tp_attention_forward, block.attn)
    parallelize_module(model, mesh, plan)
    # foreach AdamW cannot mix DTensor and plain tensors in one list: two groups
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]

    def global_loss(loss: torch.Tensor) -> float:
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()

    return Runner(model, [{"params": sharded}, {"params": plain}], tuple(inputs), f"tp={world} (DTensor TP)",
                  global_loss, step_context=loss_parallel)


SETUPS: dict[str, Callable[..., Runner]] = {"ddp": setup_ddp, "fsdp2": setup_fsdp2, "tp": setup_tp}


def setup(method: str, model: nn.Module, inputs, hardware: str) -> tuple[Runner, float]:
    """``method`` is ``ddp``, ``fsdp2``, ``tp`` or ``autopar-FAMILY``; returns the runner and
    the setup wall time on this rank (for autopar: trace, plan on rank 0, shard)."""
    t0 = time.perf_counter()
    if method.startswith("autopar-"):
        runner = setup_autopar(model, inputs, method[len("autopar-"):], hardware)
    elif method in SETUPS:
        runner = SETUPS[method](model, inputs, hardware)
    else:
        raise ValueError(f"unknown method {method!r}; pick ddp, fsdp2, tp or autopar-<strategy family>")
    return runner, time.perf_counter() - t0
