"""LAMB and LARS in one process follow their papers' update rules, written out here by hand
for one tensor (the single-process optimizer is the reference the sharded runs are held to, so
it must itself be right): bias-corrected Adam direction plus decoupled weight decay scaled by
||w|| / ||u|| (LAMB, arXiv 1904.00962), the trust coefficient's local lr with momentum (LARS,
arXiv 1708.03888), the clipping options, and non-adaptive groups."""

import math

import pytest
import torch

from autopar.optim import LAMB, LARS, OptimizerConfigError


def _grads(n_steps, shape, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) * 0.1 for _ in range(n_steps)]


def _lamb_by_hand(w, grads, lr, b1, b2, eps, wd, clip=None, max_ratio=None):
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * w
        wn = w.norm().item()
        if clip:
            wn = min(max(wn, clip[0]), clip[1])
        ratio = wn / u.norm().item()
        if max_ratio is not None:
            ratio = min(ratio, max_ratio)
        w = w - lr * ratio * u
    return w


@pytest.mark.parametrize("fused", [False, None], ids=["torch-ops", "kernel-if-built"])
@pytest.mark.parametrize("options", [{}, {"weight_norm_clip": (0.0, 1.0)}, {"max_trust_ratio": 0.5}],
                         ids=["plain", "weight-norm-clip", "max-trust-ratio"])
def test_lamb_follows_the_paper(fused, options):
    w0 = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    grads = _grads(4, w0.shape)
    p = torch.nn.Parameter(w0.clone())
    opt = LAMB([p], lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, fused=fused, **options)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _lamb_by_hand(w0, grads, 0.05, 0.9, 0.99, 1e-6, 0.1, options.get("weight_norm_clip"),
                         options.get("max_trust_ratio"))
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)
    assert (p.detach() - w0).abs().max() > 1e-3


def _lars_by_hand(w, grads, lr, momentum, wd, eta, eps, max_ratio=None):
    w, buf = w.double().clone(), None
    for g in grads:
        g = g.double()
        wn, gn = w.norm().item(), g.norm().item()
        local = eta * wn / (gn + wd * wn + eps)
        if max_ratio is not None:
            local = min(local, max_ratio)
        d = local * (g + wd * w)
        buf = d if buf is None else momentum * buf + d
        w = w - lr * buf
    return w


@pytest.mark.parametrize("max_ratio", [None, 0.01])
def test_lars_follows_the_paper(max_ratio):
    w0 = torch.randn(50, 20, generator=torch.Generator().manual_seed(1))
    grads = _grads(4, w0.shape)
    p = torch.nn.Parameter(w0.clone())
    opt = LARS([p], lr=0.5, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, max_trust_ratio=max_ratio)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _lars_by_hand(w0, grads, 0.5, 0.9, 1e-3, 0.02, 1e-9, max_ratio)
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_non_adaptive_groups_take_plain_steps():
    """adaptive=False: LAMB is AdamW-like (ratio 1), LARS is momentum SGD with weight decay."""
    w0 = torch.randn(10, generator=torch.Generator().manual_seed(2))
    g = torch.randn(10, generator=torch.Generator().manual_seed(4))
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    LARS([p], lr=0.1, momentum=0.9, weight_decay=0.01, adaptive=False).step()
    torch.testing.assert_close(p.detach(), w0 - 0.1 * (g + 0.01 * w0))
    q = torch.nn.Parameter(w0.clone())
    q.grad = g.clone()
    LAMB([q], lr=0.1, eps=1e-6, weight_decay=0.0, adaptive=False, fused=False).step()
    # first step, bias-corrected: m_hat = g, v_hat = g^2, so u = g / (|g| + eps)
    torch.testing.assert_close(q.detach(), w0 - 0.1 * g / (g.abs() + 1e-6))


def test_bad_hyper_parameters_name_value_and_range():
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(OptimizerConfigError, match=r"LARS: momentum=1.5 is out of range; pass 0.0 <= momentum < 1.0"):
        LARS(p, momentum=1.5)
    with pytest.raises(OptimizerConfigError, match=r"LAMB: lr=-1"):
        LAMB(p, lr=-1)
    with pytest.raises(OptimizerConfigError, match=r"weight_norm_clip\[1\]=0.1"):
        LAMB(p, weight_norm_clip=(1.0, 0.1))
    assert math.isclose(LAMB(p).param_groups[0]["lr"], 1e-3)  # defaults are valid
