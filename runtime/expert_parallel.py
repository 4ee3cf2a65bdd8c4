"""Expert parallelism at run time: tokens go to the ranks that hold their experts and come back.

Experts are split over one mesh axis (``ep``): rank ``r`` of the axis holds experts
``[r * E/ep, (r + 1) * E/ep)``. Each rank routes its own tokens (its batch shard), then

1. sorts its (token, slot) pairs by expert and counts them per expert;
2. exchanges the per-expert counts (one ``all_to_all_single`` of ``E`` integers), so every
   rank knows how many rows it will receive from each rank, for each of its experts;
3. sends the rows with ``all_to_all_single`` of uneven split sizes (dispatch), runs its
   experts on what arrived, and sends the results back the same way (combine);
4. weights each result by its router probability and sums the slots of each token.

The send is autograd-aware: the backward of a dispatch is the combine of the gradients with
the split sizes swapped, and the reverse, so expert weights get the gradient of every token
routed to them from every rank. Written by hand because torch has no autograd-aware
all-to-all with uneven splits (``_functional_collectives.all_to_all_single_autograd`` exists
but its split sizes must be Python ints known to every rank, which needs step 2 anyway and
gives no byte count); DeepSpeed-MoE, Megatron and torchtitan do the same exchange.

Bytes one rank sends per MoE layer and step (what :func:`predict_bytes` returns and the cost
model prices; all-to-all sends the rows bound for other ranks, none to itself): the counts
(``E`` int64 per pass) plus ``rows_out * H * itemsize`` for dispatch, ``rows_in * H * itemsize``
for combine, and the same again in backward, where ``rows_out`` are this rank's (token, slot)
pairs routed to experts on other ranks and ``rows_in`` the pairs other ranks route to this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertAxis", "all_to_all_rows", "exchange_counts", "expert_parallel_moe", "ExpertParallelExperts", "shard_experts",
           "predict_bytes", "local_expert_range", "grouped_experts_moe", "ACTIVATIONS"]


@dataclass(frozen=True)
class ExpertAxis:
    """The mesh axis experts are split over, as seen from this rank."""

    group: object  # a torch.distributed ProcessGroup (None: the default group)
    size: int
    rank: int
    num_experts: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> range:
    per = num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


class _AllToAllRows(torch.autograd.Function):
    """Rows of ``x`` sent in uneven pieces; backward sends the gradient rows back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group) -> torch.Tensor:
        ctx.send_rows, ctx.recv_rows, ctx.group = send_rows, recv_rows, group
        out = x.new_empty((sum(recv_rows),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.send_rows),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_rows, ctx.recv_rows, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group=None) -> torch.Tensor:
    """Send ``send_rows[r]`` rows of ``x`` (in order) to rank ``r``; receive ``recv_rows[r]`` from it."""
    return _AllToAllRows.apply(x, list(send_rows), list(recv_rows), group)


def exchange_counts(counts_per_expert: torch.Tensor, axis: ExpertAxis) -> torch.Tensor:
    """This rank's rows per expert ``[E]`` -> rows each rank sends to each local expert ``[ep, E/ep]``."""
    received = torch.empty_like(counts_per_expert)
    dist.all_to_all_single(received, counts_per_expert.contiguous(), group=axis.group)
    return received.view(axis.size, axis.local_experts)


ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]  # (local expert index, its rows) -> output rows


def expert_parallel_moe(hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
                        expert_fn: ExpertFn, axis: ExpertAxis) -> torch.Tensor:
    """The mixture of this rank's tokens, each (token, slot) run by the rank holding its expert."""
    num_tokens, k = top_k_index_TK.shape
    expert_ids = top_k_index_TK.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # pairs grouped by expert, ranks in order
    counts = torch.bincount(expert_ids, minlength=axis.num_experts).to(torch.int64)
    recv_counts = exchange_counts(counts, axis)  # [source rank, local expert]
    send_rows = counts.view(axis.size, axis.local_experts).sum(1).tolist()
    recv_rows = recv_counts.sum(1).tolist()
    rows = all_to_all_rows(hidden_TH[order // k], send_rows, recv_rows, axis.group)
    # Arrived grouped by source rank, then by expert; run each local expert on its rows.
    local_ids = torch.repeat_interleave(
        torch.arange(axis.local_experts).repeat(axis.size), recv_counts.reshape(-1))
    by_expert = torch.argsort(local_ids, stable=True)
    grouped = rows[by_expert]
    sizes = torch.bincount(local_ids, minlength=axis.local_experts).tolist()
    outs = [expert_fn(e, piece) for e, piece in enumerate(torch.split(grouped, sizes)) if piece.shape[0]]
    done = torch.cat(outs) if outs else grouped[:, :0].new_zeros((0, hidden_TH.shape[1]))
    done = done[torch.argsort(by_expert)]  # back to arrival order
    back = all_to_all_rows(done, recv_rows, send_rows, axis.group)
    pairs = back[torch.argsort(order)]  # back to (token, slot) order
    weighted = pairs * top_k_weights_TK.reshape(-1, 1).to(pairs.dtype)
    return weighted.view(num_tokens, k, -1).sum(dim=1).to(hidden_TH.dtype)


ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu, "relu": nn.functional.relu}


def grouped_experts_moe(hidden_TH: torch.Tensor, top_k_index_TK: torch.Tensor, top_k_weights_TK: torch.Tensor,
                        gate_up_EOH: torch.Tensor, down_EHI: torch.Tensor, axis_group, num_experts: int,
                        act: str) -> torch.Tensor:
    """A Hugging Face MoE block (gated experts ``gate_up_proj [E/ep, 2I, H]``, ``down_proj
    [E/ep, H, I]``, this rank's) run expert-parallel over ``axis_group`` (an ``AxisGroup``:
    ``group``, ``size``, ``rank``): the call the planner's lowering emits in place of the block
    (``autopar/techniques/expert_parallel.py``)."""
    axis = ExpertAxis(axis_group.group, axis_group.size, axis_group.rank, num_experts)
    act_fn = ACTIVATIONS[act]

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, gate_up_EOH[e]).chunk(2, dim=-1)
        return nn.functional.linear(act_fn(gate) * up, down_EHI[e])

    return expert_parallel_moe(hidden_TH, top_k_index_TK, top_k_weights_TK, expert, axis)


class ExpertParallelExperts(nn.Module):
    """A Hugging Face ``*Experts`` module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
    ``act_fn``; Mixtral, Qwen-MoE) holding only this rank's experts; same call signature."""

    def __init__(self, experts: nn.Module, axis: ExpertAxis) -> None:
        super().__init__()
        mine = local_expert_range(axis.num_experts, axis.size, axis.rank)
        self.axis = axis
        self.act_fn = experts.act_fn
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[mine.start:mine.stop].clone())
        self.down_proj = nn.Parameter(experts.down_proj.detach()[mine.start:mine.stop].clone())

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_moe(hidden_states, top_k_index, top_k_weights, self._expert, self.axis)


def predict_bytes(top_k_index_per_rank: list[torch.Tensor], num_experts: int, hidden: int, itemsize: int,
                  backward: bool = True) -> list[dict[str, float]]:
    """Bytes each rank sends by all-to-all in one MoE layer, from every rank's routing (the
    measured counts, not a capacity bound). Returns per rank ``{"all_to_all": bytes}``."""
    ep = len(top_k_index_per_rank)
    per = num_experts // ep
    dest = [torch.bincount(idx.reshape(-1) // per, minlength=ep) for idx in top_k_index_per_rank]
    passes = 2 if backward else 1
    out = []
    for r in range(ep):
        rows_out = int(dest[r].sum() - dest[r][r])
        rows_in = sum(int(dest[s][r]) for s in range(ep) if s != r)
        counts = num_experts * 8 * (ep - 1) / ep  # int64 counts, the even all-to-all share
        out.append({"all_to_all": counts + passes * (rows_out + rows_in) * hidden * itemsize})
    return out


def shard_experts(model: nn.Module, axis: ExpertAxis) -> list[str]:
    """Replace every experts module of ``model`` (3-D ``gate_up_proj`` and ``down_proj``) by an
    :class:`ExpertParallelExperts` holding this rank's experts; returns the replaced names."""
    names = [name for name, m in model.named_modules()
             if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3
             and isinstance(getattr(m, "down_proj", None), torch.Tensor)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, ExpertParallelExperts(getattr(parent, child), axis))
    return names
