"""Multi-process cases of activation recompute and ZeRO-Offload, run by tests/test_recompute.py in one launch.

Each rank runs every case: parallelize a freshly seeded model with recompute / offload options,
train 3 AdamW steps with the optimizer the plan asks for (``runtime/offload.py``: state on the
host when the plan offloads), and record what dist_cases records (losses, first-step
gradients, parameters after the last step, bytes per collective per step), plus which blocks
the program checkpoints and, on the second step (the optimizer state exists by then), the live
bytes the forward leaves for backward, the peak of forward + backward above what was live
before it, the device bytes of parameters, gradients and device-side optimizer state, the
whole step's device peak, and the host bytes (``bench/memtrack.py``: every storage an op
touches, from first sight until freed; offloaded state counted as host)"""

from __future__ import annotations

import contextlib
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
    if name == "gpt-vocab":  # logits (batch x sequence x vocabulary) dwarf the hidden states, as in real LMs
        from autopar.models.gpt import gpt

        torch.manual_seed(0)
        return gpt("gpt-tiny", batch_size=16, seq_len=32, vocab_size=2048)
    if name == "gpt-fidelity":  # bench/fidelity.py's GPT (7.4 M parameters, logits 4x its hidden states)
        from runtime_vs_baselines import FULL, build_model

        torch.manual_seed(0)
        return build_model(FULL)
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


# The profile bench/fidelity.py calibrated (``autopar calibrate``, 4 gloo ranks on 2 cores) for its
# run of 2026-12-04: gloo's millisecond latency makes the planner cut the fidelity GPT's head on the
# vocabulary (its logits reduce-scattered, their gradient all-gathered back), where an A100's links
# make it gather the head's input instead. A case picks it with ``hardware="gloo-cpu"``.
GLOO_CPU = dict(name="gloo-cpu", devices_per_node=4, peak_flops=3.157e10, peak_flops_fp32=3.157e10,
                memory_bandwidth_bytes_per_s=1.11e10, memory_bytes=2.53e10,
                intra_node=dict(name="gloo-loopback", bandwidth_bytes_per_s=1.73e9, latency_s=9.19e-4),
                inter_node=dict(name="gloo-loopback", bandwidth_bytes_per_s=1.73e9, latency_s=9.19e-4),
                kernel_overhead_s=3.82e-6, efficiency=1.0, host_link_bytes_per_s=2.5e10,
                host_memory_bytes=2.75e11, host_adam_params_per_s=7.12e8, comm_overlap=0.0,
                optimizer_params_per_s=1.66e8, softmax_bytes_per_s=2.64e9, shared_cores=2.0)

# The profile of bench/fidelity.py's run of 2026-12-09 (rounded to 4 digits; per-collective rates):
# under it the 2D plan gathers the fidelity GPT's head weight on both axes (the ZeRO-3 gather reads
# the column-gathered half), a layout the older profile does not pick. ``hardware="cpu-calibrated"``.
_MEASURED_RATES = [["all_gather", 2, 2.505e8, 1.516e-3], ["all_gather", 4, 3.739e8, 1.444e-3],
                   ["all_reduce", 2, 5.12e8, 7.577e-4], ["all_reduce", 4, 6.903e8, 1.149e-3],
                   ["broadcast", 2, 1.032e9, 1.547e-3], ["broadcast", 4, 1.082e9, 5.909e-4], ["p2p", 2, 8.682e8, 4.514e-3],
                   ["reduce_scatter", 2, 1.685e8, 1.762e-3], ["reduce_scatter", 4, 2.303e8, 2.433e-3]]
_MEASURED_LINK = dict(name="gloo-loopback-measured", bandwidth_bytes_per_s=5.755e8, latency_s=1.268e-3,
                      per_collective=_MEASURED_RATES)
CPU_CALIBRATED = dict(name="calibrated-cpu", devices_per_node=4, peak_flops=3.373e10, peak_flops_fp32=3.373e10,
                      memory_bandwidth_bytes_per_s=3.136e9, memory_bytes=2.532e10, intra_node=_MEASURED_LINK,
                      inter_node=_MEASURED_LINK, kernel_overhead_s=7.913e-6, efficiency=1.0,
                      host_link_bytes_per_s=2.5e10, host_memory_bytes=2.75e11, host_adam_params_per_s=1.734e8,
                      comm_overlap=0.1318, optimizer_params_per_s=1.515e8, softmax_bytes_per_s=1.928e9,
                      shared_cores=2.0, backward_ratio=2.273)
_PROFILES = {"gloo-cpu": GLOO_CPU, "cpu-calibrated": CPU_CALIBRATED}


def _hardware(name: str):
    from autopar.cost_model.hardware import Hardware

    return Hardware.from_json(_PROFILES[name]) if name in _PROFILES else name


def case_key(case) -> str:
    name, options = case
    return name + "".join(f"/{k}={v}" for k, v in sorted(options.items()))


def run_case(name: str, options: dict) -> dict:
    from memtrack import LiveBytes, bucket_buffers, optimizer_tensors

    from autopar.passes.recompute_regions import RECOMPUTED_KEY
    from autopar.runtime import count_bytes
    from autopar.runtime.parallel_module import parallelize
    from autopar.runtime.offload import make_optimizer

    model, inputs = build(name)
    options = dict(options)
    hardware = _hardware(options.pop("hardware", "a100-80gb"))
    pm = parallelize(model, example_inputs=inputs, hardware=hardware, mixed_precision=False, baselines=False,
                     **options)
    # AdamW as the plan asks: state on the device, or on the host when the plan offloads
    opt = make_optimizer(pm, lr=LR, eps=EPS)
    host = list(opt.host_tensors()) if hasattr(opt, "host_tensors") else []
    losses, sent_per_step, grads = [], [], None
    for step in range(STEPS):
        # memory is measured on the second step: the optimizer state exists from the first on
        with LiveBytes() if step == 1 else contextlib.nullcontext() as mem:
            if mem is not None:
                mem.host(host)  # offloaded state counts as host memory, never as the device's
                mem.track(optimizer_tensors(pm, opt) + list(inputs) + bucket_buffers(pm))
                base = mem.live_bytes
            with count_bytes() as sent:
                loss = pm(*inputs)
                if mem is not None:
                    kept = mem.live_bytes - base  # what the forward left alive for backward
                loss.backward()
            if mem is not None:
                peak = mem.peak_bytes - base
            opt.step()
            if mem is not None:
                state_bytes = _bytes(optimizer_tensors(pm, opt), mem)  # device: params, grads, device state
                step_peak, host_bytes = mem.peak_bytes, mem.host_bytes  # the whole step, on the device
        if step == 0:
            grads = pm.full_grads()
        losses.append(loss.item())
        sent_per_step.append(dict(sent))
        opt.zero_grad()
    return dict(losses=losses, grads=grads, params=pm.full_state_dict(), sent=sent_per_step,
                predicted=dict(pm.plan.comm_bytes), mesh=str(pm.plan.mesh), recompute=list(pm.plan.recompute),
                checkpointed=list(pm.program.meta.get(RECOMPUTED_KEY, [])), peak_bytes=peak, kept_bytes=kept,
                predicted_activation_bytes=pm.plan.activation_bytes,
                strategies={n.name: n.strategy for n in pm.plan.nodes},
                offloaded=bool(host), host_bytes=host_bytes, predicted_host_bytes=pm.plan.host_bytes,
                offload_params=list(pm.plan.offload_params),
                device_state_bytes=state_bytes,
                predicted_device_state_bytes=pm.plan.param_state_bytes - pm.plan.bucket_bytes,  # buckets apart
                predicted_bucket_bytes=pm.plan.bucket_bytes,
                step_peak_bytes=step_peak, predicted_peak_bytes=pm.plan.peak_memory_bytes_per_device)


def _bytes(tensors, mem) -> int:
    """Device bytes of ``tensors`` (each storage once; host storages left out)."""
    seen = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        st = t.untyped_storage()
        if not mem.is_host(t):
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def case(rank: int, world: int, name: str, options: dict) -> dict:
    """One case on this rank (run by tests/launcher.py)."""
    return run_case(name, options)


def pipeline_case(rank: int, world: int, name: str, pipeline: dict, hardware: str) -> dict:
    """A pipeline pinned by hand (``pipeline_stages.hand_pipeline_plan``: pp, micro-batches,
    schedule, virtual stages), planned on rank 0 and run on every rank as bench/fidelity.py
    does: the second step's peak live bytes, max over the ranks (the last stage holds the head)."""
    from memtrack import LiveBytes, optimizer_tensors

    from autopar.plan import Plan
    from autopar.pipeline_stages import hand_pipeline_plan
    from autopar.planner import plan
    from autopar.runtime.offload import make_optimizer
    from autopar.runtime.parallel_module import parallelize

    model, inputs = build(name)
    box = [None]
    if rank == 0:
        box[0] = hand_pipeline_plan(model, inputs, world, stage_mesh=None, stage_blocks=None, plan_fn=plan,
                                    baselines=False, hardware=_hardware(hardware), mixed_precision=False,
                                    **pipeline).to_json()
    dist.broadcast_object_list(box, src=0)
    the_plan = Plan.from_json(box[0])
    pm = parallelize(model, example_inputs=inputs, plan=the_plan, hardware=_hardware(hardware), mixed_precision=False)
    opt = make_optimizer(pm, lr=LR, eps=EPS)
    for step in range(2):
        with LiveBytes() if step == 1 else contextlib.nullcontext() as mem:
            if mem is not None:
                mem.track(optimizer_tensors(pm, opt) + list(inputs))
            pm.step(*inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
    peaks = [None] * world
    dist.all_gather_object(peaks, mem.peak_bytes)
    return dict(step_peak_bytes=max(peaks), predicted_peak_bytes=the_plan.peak_memory_bytes_per_device,
                mesh=str(the_plan.mesh))
