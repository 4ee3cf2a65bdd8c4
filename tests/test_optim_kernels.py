"""The fused CPU optimizer kernels (csrc/fused_optim.cpp): AdamW/Adam steps equal
torch.optim.AdamW/Adam, LAMB's fused phases equal the torch-ops reference LAMB, to 1e-6
relative; the bf16 copy-out is the parameter rounded; bad input is refused. The fallback
(extension disabled) runs in a child process and equals torch too, with one warning."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from autopar.optim import LAMB, CPUAdamW, OptimizerConfigError
from autopar.optim.cpu_kernels import extension

# Only a machine without a C++ compiler may skip the kernel's tests (the fallback is tested
# below either way); where one exists, the build must work (test_extension_builds_here).
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_ext = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the torch fallback runs (tested below)")


@needs_ext
def test_extension_builds_here():
    assert extension() is not None, "a C++ compiler is here but csrc/fused_optim.cpp did not build (see the warning)"


def _params(seed=0, shapes=((300, 70), (1000,), (3, 5, 7), (1,))):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _run(opt_cls, kwargs, steps=5, seed=0):
    params = [torch.nn.Parameter(t) for t in _params(seed)]
    opt = opt_cls(params, **kwargs)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 0.1
        opt.step()
    return [p.detach() for p in params]


@needs_ext
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_fused_adam_step_equals_torch(decoupled):
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours = _run(CPUAdamW, dict(kw, decoupled=decoupled))
    ref = _run(torch.optim.AdamW if decoupled else torch.optim.Adam, dict(kw, foreach=False))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    moved = max((a - b).abs().max().item() for a, b in zip(ours, _params()))
    assert moved > 1e-2  # the step did move the parameters


@needs_ext
def test_fused_lamb_equals_reference_lamb():
    kw = dict(lr=1e-2, weight_decay=0.01, max_trust_ratio=10.0)
    fused, ref = _run(LAMB, dict(kw, fused=True)), _run(LAMB, dict(kw, fused=False))
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    moved = max((a - b).abs().max().item() for a, b in zip(fused, _params()))
    assert moved > 1e-3


@needs_ext
def test_bf16_copy_out_is_the_rounded_parameter():
    p = torch.nn.Parameter(torch.randn(70_000))
    copy = torch.empty(70_000, dtype=torch.bfloat16)
    opt = CPUAdamW([p], lr=1e-2, bf16_copies={p: copy})
    p.grad = torch.randn(70_000)
    opt.step()
    assert torch.equal(copy, p.detach().to(torch.bfloat16))


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(OptimizerConfigError, match=r"betas\[1\]=1.0"):
        LAMB([torch.nn.Parameter(torch.ones(2))], betas=(0.9, 1.0))
    with pytest.raises(OptimizerConfigError, match="fp32 CPU"):
        CPUAdamW([torch.nn.Parameter(torch.ones(2, dtype=torch.float64))])
    if extension() is not None:
        with pytest.raises(RuntimeError, match="exp_avg has 3 elements"):
            extension().adam_step(torch.ones(2), torch.ones(2), torch.ones(3), torch.ones(2), 1, 1e-3, 0.9, 0.999,
                                  1e-8, 0.0, True, None)


FALLBACK = r"""
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from autopar.optim import LAMB, CPUAdamW, FusedKernelWarning
    from autopar.optim.cpu_kernels import extension
    assert extension() is None and extension() is None
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(50, 30)) for _ in range(2)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a, b = CPUAdamW(ps, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(qs, lr=1e-2, weight_decay=0.1, foreach=False)
    lamb_fallback = LAMB([torch.nn.Parameter(torch.randn(40))], lr=1e-2)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape); q.grad = p.grad.clone()
        a.step(); b.step()
        lamb_fallback.param_groups[0]["params"][0].grad = torch.randn(40)
        lamb_fallback.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
n = sum(issubclass(w.category, FusedKernelWarning) for w in caught)
assert n == 1, [str(w.message) for w in caught]
print("fallback ok")
"""


def test_fallback_without_the_extension_equals_torch_with_one_warning():
    env = dict(os.environ, AUTOPAR_DISABLE_EXT="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", FALLBACK], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "fallback ok" in proc.stdout, proc.stderr[-3000:]
