"""Multi-process runtime cases, run by tests/test_runtime.py in one launch (gloo on CPU).

Each rank runs every case: parallelize a freshly seeded model under a plan family, train 3
AdamW steps, and record losses, the gathered gradients of the first step, the gathered
parameters after the last step, and the bytes sent per collective per step. Rank 0's record
goes back to the test (tests/launcher.py), which compares it with a single-process run.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
from byte_spy import ByteSpy
from torch.utils.flop_counter import FlopCounterMode

STEPS = 3
LR = 1e-3
# eps well above fp32 noise: with the default 1e-8, a gradient that is ~0 up to rounding turns
# into a full-size update whose sign is the rounding noise, in the single-device run as well.
EPS = 1e-6


def train_single(model, args, kwargs=None, steps: int = STEPS, lr: float = LR, eps: float = EPS,
                 every_name: bool = False):
    """The single-process reference, no autopar: ``steps`` AdamW steps on the same batch.
    Returns the losses, the first step's gradients (``every_name``: under each name of a tied
    weight) and the state dict after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses, grads = [], None
    for step in range(steps):
        out = model(*args, **(kwargs or {}))
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=not every_name)
                     if p.grad is not None}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach() for k, v in model.state_dict().items()}


# An op autopar has no sharding rule for (a custom op with its own autograd): the planner must
# run it replicated, with reshards around it, and the result must still equal one device's.
@torch.library.custom_op("autopar_rt::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 1.5


@scaled_tanh.register_fake
def _(x):
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _scaled_tanh_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 1.5 * (1 - torch.tanh(x) ** 2)


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class CustomOpMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 8)

    def forward(self, x, y):
        h = torch.ops.autopar_rt.scaled_tanh(self.fc1(x))
        return torch.nn.functional.mse_loss(self.fc2(h), y)


def build(name: str):
    from autopar.models import get_model

    torch.manual_seed(0)
    if name == "mlp":
        from autopar.models import MLPConfig, mlp

        return mlp(MLPConfig(in_features=32, hidden=64, out_features=8, depth=2), batch_size=16)
    if name == "mlp-customop":
        model = CustomOpMLP()
        return model, (torch.randn(16, 32), torch.randn(16, 8))
    if name == "gpt-longseq":  # one long sequence: activations, not weights, fill the memory
        from autopar.models.gpt import gpt

        return gpt("gpt-tiny", batch_size=1, seq_len=1024, block_size=1024)
    if name == "hf-llama-tiny":  # transformers' Llama built from a config (no download)
        from transformers import LlamaConfig, LlamaForCausalLM

        from autopar.models.hf import HFLossWrapper

        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                             use_cache=False, attn_implementation="sdpa")
        ids = torch.randint(0, 128, (8, 16))
        return HFLossWrapper(LlamaForCausalLM(config)).train(), (ids, ids)
    return get_model(name, batch_size=8, seq_len=16)


def refused(name: str, family: str) -> str:
    """parallelize with a plan made for another model / world size: the error it raises."""
    import autopar
    from autopar.runtime.parallel_module import parallelize

    model, inputs = build(name)
    world = torch.distributed.get_world_size()
    if family == "refuse-other-model":
        other, other_inputs = build("mlp" if name != "mlp" else "gpt-tiny")
        plan = autopar.plan(other, world, other_inputs, baselines=False)
    else:  # refuse-other-world
        plan = autopar.plan(model, world * 2, inputs, baselines=False)
    try:
        parallelize(model, example_inputs=inputs, plan=plan.to_json())
    except autopar.AutoparError as exc:
        return str(exc)
    return ""


def local_outputs(family: str) -> dict:
    """A model that returns its activations: with ``local_outputs=True`` each rank gets its
    piece of what the whole-output call returns, where ``output_slices`` says."""
    from autopar.runtime.parallel_module import parallelize

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(16, 32)
    pm = parallelize(model, example_inputs=(x,), strategy=family, baselines=False)
    whole = pm(x)
    piece = pm(x, local_outputs=True)
    (sl,) = pm.output_slices()
    return dict(err=(piece - whole[sl]).abs().max().item(), piece_shape=tuple(piece.shape),
                whole_shape=tuple(whole.shape), single=(whole - model(x)).abs().max().item())


def _expected_piece(shape, dim_axes, coords, sizes) -> tuple[int, ...]:
    """The local shape a layout gives, computed here from chunk arithmetic alone (not from
    the runtime's own slicing code): each cut takes chunk ``coords[axis]`` of ``sizes[axis]``."""
    shape = list(shape)
    for axis, dim in dim_axes:
        pieces = torch.arange(shape[dim]).chunk(sizes[axis])
        shape[dim] = pieces[coords[axis]].numel() if coords[axis] < len(pieces) else 0
    return tuple(shape)


def shard_mismatches(pm) -> list[str]:
    """Every parameter and buffer whose local tensor is not the piece the plan's layout names."""
    sizes = pm.plan.mesh.sizes
    rank, coords = dist.get_rank(), []
    for s in reversed(sizes):
        coords.append(rank % s)
        rank //= s
    coords = coords[::-1]
    bad = []
    for info in pm.shards():
        want = _expected_piece(info.global_shape, info.dim_axes, coords, sizes)
        if info.zero2_axes:
            k = 1
            for a in info.zero2_axes:
                k *= sizes[a]
            numel = 1
            for d in want:
                numel *= d
            want = (-(-numel // k),)
        if tuple(info.tensor.shape) != want:
            bad.append(f"rank {dist.get_rank()} {info.name}: {tuple(info.tensor.shape)} != {want}")
    return bad


def _single_flops(name: str) -> int:
    """Matmul/attention FLOPs of one forward and backward of the whole model in one process
    (torch's FlopCounterMode): what the ranks' FLOPs are compared with."""
    model, inputs = build(name)
    with FlopCounterMode(display=False) as counter:
        model(*inputs).backward()
    return counter.get_total_flops()


def all_ranks(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_case(name: str, family: str, mesh: str | None, options: dict | None = None):
    import warnings

    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize

    if family.startswith("refuse"):
        return dict(refused=refused(name, family))
    if name == "local-outputs":
        return local_outputs(family)
    model, inputs = build(name)
    options = dict(options or {})
    local_inputs = bool(options.pop("local_inputs", False))
    mixed_precision = bool(options.pop("mixed_precision", False))  # bf16 (tests/test_mixed_precision.py)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(model, example_inputs=inputs, hardware="a100-80gb", mixed_precision=mixed_precision,
                         strategy=family, mesh=mesh, baselines=False, **options)
    if local_inputs:  # each rank reads only its own piece of the batch
        inputs = tuple(x if sl is None else x[sl].clone() for x, sl in zip(inputs, pm.input_slices()))
    unknown_ops = sorted({str(w.message) for w in caught if w.category.__name__ == "UnknownOpWarning"})
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    losses, sent_per_step, spied_per_step, calls_per_step, grads = [], [], [], [], None
    flops = FlopCounterMode(display=False)
    for step in range(STEPS):
        with count_bytes() as sent, ByteSpy() as spy, (flops if step == 0 else contextlib.nullcontext()):
            loss = pm(*inputs, local_inputs=local_inputs)
            loss.backward()
        if step == 0:
            grads = pm.full_grads()
            dtypes = dict(loss=loss.dtype, params=sorted({str(p.dtype) for p in pm.parameters()}),
                          grads=sorted({str(p.grad.dtype) for p in pm.parameters() if p.grad is not None}))
        losses.append(loss.item())
        sent_per_step.append(dict(sent))
        spied_per_step.append(spy.sent)
        calls_per_step.append(dict(collections.Counter(kind for kind, *_ in spy.calls)))
        opt.step()
        opt.zero_grad()
    mismatched = [m for ms in all_ranks(shard_mismatches(pm)) for m in ms]
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), sent=sent_per_step,
                sent_by_rank=all_ranks(sent_per_step), spied_by_rank=all_ranks(spied_per_step), calls=calls_per_step,
                flops_by_rank=all_ranks(flops.get_total_flops()), single_flops=_single_flops(name),
                shard_mismatches=mismatched, cut_params=sum(1 for s in pm.shards() if s.is_param and s.split_axes),
                predicted=dict(pm.plan.comm_bytes), mesh=str(pm.plan.mesh), unknown_ops=unknown_ops,
                strategies={n.name: n.strategy for n in pm.plan.nodes},
                zero2_params=sum(1 for n in pm.plan.nodes if n.zero_axes),
                param_numel=sum(p.numel() for p in pm.parameters()),
                full_numel=sum(p.numel() for p in build(name)[0].parameters()),
                param_devices=sorted({p.device.type for p in pm.parameters()}), dtypes=dtypes,
                state_keys=sorted(pm.state_dict()))


def case_key(case) -> str:
    name, family, mesh, *options = case
    extra = "".join(f"/{k}={v:g}" for k, v in (options[0] if options else {}).items())
    return f"{name}/{family}/{mesh}{extra}"


def case(rank: int, world: int, spec: tuple) -> dict:
    """One (name, family, mesh[, options]) case on this rank (run by tests/launcher.py)."""
    name, family, mesh, *options = spec
    return run_case(name, family, mesh, *options)
