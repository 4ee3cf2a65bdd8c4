"""Multi-process ring attention cases, run by tests/test_ring_attention.py on 4 gloo ranks
(one case of tests/launcher.py).

Every rank runs every case. A case draws (from a seed all ranks share) full-sequence q, k, v and an
upstream gradient, cuts this rank's sequence block on the case's axis group, runs
:func:`ring_attention` forward and backward while counting the bytes sent, and runs
``F.scaled_dot_product_attention`` on the full tensors as the reference. Groups: the world (4),
both axes of a 2x2 mesh - inner {0,1},{2,3} and outer {0,2},{1,3}, the one whose group-to-global
rank mapping matters - and groups of one rank. Rank 0 returns every rank's blocks, reference blocks
and byte counts; tests/test_ring_attention.py compares them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (group, causal, dtype)
CASES = [(g, causal, "float32") for g in ("world", "inner", "outer", "single") for causal in (False, True)]
CASES += [("world", True, "bfloat16")]


def case_key(case) -> str:
    g, causal, dtype = case
    return f"{g}/{'causal' if causal else 'full'}/{dtype}"


def _groups():
    """Axis groups of this rank: name -> AxisGroup."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.runtime.collectives import AxisGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    single, _ = dist.new_subgroups(group_size=1)
    return {
        "world": AxisGroup("world", dist.group.WORLD, world, rank),
        "outer": AxisGroup("outer", mesh.get_group("outer"), 2, mesh.get_local_rank("outer")),
        "inner": AxisGroup("inner", mesh.get_group("inner"), 2, mesh.get_local_rank("inner")),
        "single": AxisGroup("single", single, 1, 0),
    }


def run_case(index: int, case, groups: dict) -> dict:
    from autopar.runtime.collectives import count_bytes
    from autopar.runtime.ring_attention import ring_attention, ring_attention_bytes

    name, causal, dtype_name = case
    g = groups[name]
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(1000 + index)  # the same draw on every rank
    b, h, d = (int(torch.randint(1, hi + 1, (1,), generator=gen)) for hi in (2, 3, 8))
    s_local = int(torch.randint(2, 6, (1,), generator=gen))  # >= 2: a real causal triangle
    full = [torch.randn(b, h, g.size * s_local, d, generator=gen) for _ in range(4)]
    q_full, k_full, v_full, dout_full = (t.to(dtype) for t in full)

    def block(t):
        return t.narrow(2, g.rank * s_local, s_local).detach().clone()

    q, k, v = (block(t).requires_grad_() for t in (q_full, k_full, v_full))
    with count_bytes() as fwd_sent:
        out = ring_attention(q, k, v, g, causal=causal)
    with count_bytes() as bwd_sent:
        out.backward(block(dout_full))

    # The reference runs in fp32 on the same (possibly bf16-rounded) inputs.
    ref_in = [t.float().requires_grad_() for t in (q_full, k_full, v_full)]
    ref_out = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
    ref_out.backward(dout_full.float())
    elem = q.element_size()
    return dict(
        shape=(b, h, s_local, d), group_ranks=dist.get_process_group_ranks(g.group), axis_rank=g.rank,
        got={"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
        ref={"out": block(ref_out), "dq": block(ref_in[0].grad), "dk": block(ref_in[1].grad),
             "dv": block(ref_in[2].grad)},
        sent_fwd=fwd_sent.get("p2p", 0.0), sent_bwd=bwd_sent.get("p2p", 0.0),
        other_collectives=sorted((set(fwd_sent) | set(bwd_sent)) - {"p2p"}),
        bytes_fwd=ring_attention_bytes(b, h, s_local, d, elem, g.size, backward=False),
        bytes_total=ring_attention_bytes(b, h, s_local, d, elem, g.size, backward=True),
    )


def all_cases(rank: int, world: int) -> dict:
    """Every case on this rank (run by tests/launcher.py): {case key: [each rank's record]}."""
    groups = _groups()
    mine = {case_key(c): run_case(i, c, groups) for i, c in enumerate(CASES)}
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, mine)
    return {key: [r[key] for r in per_rank] for key in mine}
