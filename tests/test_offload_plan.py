"""ZeRO-Offload in the planner (cost_model/offload.py): optimizer state and fp32 master weights
priced in host memory, device and host bytes kept apart, the step priced on the host link and
CPU. The run itself is checked in tests/test_recompute.py (the shared 4-rank launch)."""

import dataclasses

import pytest

import autopar
from autopar.cost_model.costs import TrainingSpec
from autopar.cost_model.hardware import HardwareError, get_hardware
from autopar.cost_model.offload import param_option_cost
from autopar.mesh import MeshSpec
from autopar.models import get_model
from autopar.strategy import Layout


def test_offload_moves_state_to_the_host_and_prices_the_link_and_cpu_step():
    hw = get_hardware("a100-80gb")
    mesh = MeshSpec(("dp",), (1,))
    rep = Layout.replicated(1)
    n = 10**9
    t_dev, dev, host = param_option_cost(n, rep, mesh, hw, TrainingSpec("adamw", True, "none", False))
    assert (dev, host) == (16 * n, 0.0)  # 2 + 2 + 12 bytes per parameter (ZeRO paper)
    t_off, dev, host = param_option_cost(n, rep, mesh, hw, TrainingSpec("adamw", True, "none", True))
    assert (dev, host) == (4 * n, 16 * n)  # host: moments 8, fp32 master 4, fp32 gradient buffer 4
    # 2 x 2 bytes per parameter over the host link, and the host's AdamW over every element
    assert t_off == pytest.approx(4 * n / hw.host_link_bytes_per_s + n / hw.host_adam_params_per_s)
    assert t_off > t_dev


def test_a_measured_adamw_rate_prices_the_device_step_else_one_stream_of_state():
    # torch's per-tensor AdamW makes several passes: calibrate measures its rate; profiles
    # without one price one stream of weights, gradients and moments at memory bandwidth
    base = get_hardware("cpu")
    mesh = MeshSpec(("dp",), (4,))
    n = 4 * 10**6
    fp32 = TrainingSpec("adamw", False, "none", False)
    streamed, _, _ = param_option_cost(n, Layout.replicated(1), mesh, base, fp32)
    assert base.optimizer_params_per_s == 0 and streamed == pytest.approx(16 * n / base.memory_bandwidth_bytes_per_s)
    hw = dataclasses.replace(base, optimizer_params_per_s=5e7)
    measured, _, _ = param_option_cost(n, Layout.replicated(1), mesh, hw, fp32)
    assert measured == pytest.approx(n / 5e7)
    zero2, _, _ = param_option_cost(n, Layout.replicated(1), mesh, hw, fp32, zero_axes=(0,))
    assert zero2 == pytest.approx(n / 4 / 5e7)  # each rank steps its quarter
    with pytest.raises(HardwareError, match="optimizer_params_per_s must be >= 0"):
        dataclasses.replace(base, optimizer_params_per_s=-1.0)


def test_offloaded_plan_reports_device_and_host_bytes_apart():
    model, inputs = get_model("gpt-tiny", batch_size=8, seq_len=16)
    kw = dict(hardware="a100-80gb", mixed_precision=True, baselines=False, strategy="dp", recompute="none")
    keep = autopar.plan(model, 2, inputs, **kw)
    off = autopar.plan(model, 2, inputs, offload=True, **kw)
    assert keep.host_bytes == 0 and off.host_bytes > 0
    # what left the device (12 bytes per element: moments and master) is on the host, with the
    # host's fp32 gradient buffer (4 more); data parallel: the same layouts
    assert off.host_bytes == pytest.approx((keep.param_state_bytes - off.param_state_bytes) * 16 / 12)
    assert off.step_seconds > keep.step_seconds
    assert autopar.Plan.from_json(off.to_json()).host_bytes == off.host_bytes
    from autopar.report import format_report

    assert "host memory / device" in format_report(off)
