"""BatchedMuon and NorMuon against torch.optim.Muon and a hand-written NorMuon reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import torch.optim._muon as torch_muon
from lightning_async.optim.muon import BatchedMuon, NorMuon, adjusted_lr, batched_newton_schulz

# square, wide, tall, repeated shapes, and a tall/wide pair that share one oriented bucket
SHAPES = [(16, 16), (8, 24), (24, 8), (8, 24), (16, 16), (24, 8), (12, 20)]
A, B, C = 3.4445, -4.775, 2.0315


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in SHAPES]


def gradients(steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(*s, generator=g) for s in SHAPES] for _ in range(steps)]


def run(optimizer, params, grads):
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad.clone()
        optimizer.step()
    return params


def ns_fp32(x: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quintic Newton-Schulz of one matrix (fp32 unless told), from Jordan et al.'s description."""
    tall = x.shape[0] > x.shape[1]
    y = x.to(dtype).T if tall else x.to(dtype)
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        a = y @ y.T
        y = A * y + (B * a + C * a @ a) @ y
    return y.T if tall else y


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_batched_muon_matches_torch_muon_bf16(nesterov, adjust_lr_fn):
    grads = gradients(4)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref_params = make_params()
    run(torch.optim.Muon(ref_params, **kwargs), ref_params, grads)
    ours = make_params()
    run(BatchedMuon(ours, **kwargs), ours, grads)
    start = make_params()
    for r, o, s in zip(ref_params, ours, start):
        assert not torch.equal(r, s)  # the optimizer moved the weights
        # bf16 Newton-Schulz: the update is ~lr/sqrt(cols); 1e-4 is well below any lr-scaling error
        torch.testing.assert_close(o, r, rtol=0, atol=1e-4)


def test_batched_muon_fp32_matches_torch_muon_with_fp32_newton_schulz(monkeypatch):
    """With both iterations in fp32 the only differences are batching and summation order: ~1e-7."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", lambda g, coeffs, steps, eps: ns_fp32(g, steps, eps))
    grads = gradients(5)
    kwargs = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn="original")
    ref_params = make_params()
    run(torch.optim.Muon(ref_params, **kwargs), ref_params, grads)
    ours = make_params()
    run(BatchedMuon(ours, ns_dtype=torch.float32, **kwargs), ours, grads)
    for r, o in zip(ref_params, ours):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)


def test_batched_newton_schulz_orthogonalises():
    x = torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(0))
    y = batched_newton_schulz(x, dtype=torch.float32)
    singular = torch.linalg.svdvals(y)
    assert singular.min() > 0.4 and singular.max() < 1.3  # the quintic's S' ~ U(0.5, 1.5) band
    for i in range(3):
        torch.testing.assert_close(y[i], ns_fp32(x[i]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        batched_newton_schulz(x.mT)  # must be oriented wide


def torch_bf16_ns(u: torch.Tensor) -> torch.Tensor:
    return torch_muon._zeropower_via_newtonschulz(u, (A, B, C), 5, 1e-7)


def normuon_reference(params, grads, lr, wd, momentum, beta2, adjust_lr_fn=None, eps=1e-10, ns=ns_fp32):
    """NorMuon (Li et al. 2025, Algorithm 1) on torch.optim.Muon's momentum, per matrix, fp32."""
    bufs = [torch.zeros_like(p) for p in params]
    moments = [torch.zeros(p.shape[0], 1) for p in params]
    with torch.no_grad():
        for step_grads in grads:
            for p, g, buf, v in zip(params, step_grads, bufs, moments):
                buf.mul_(momentum).add_(g, alpha=1 - momentum)
                u = g * (1 - momentum) + buf * momentum  # Nesterov
                o = ns(u).float()
                v.mul_(beta2).add_((o**2).mean(dim=1, keepdim=True), alpha=1 - beta2)
                o_hat = o / (v.sqrt() + eps)
                o_hat = o_hat * o.norm() / (o_hat.norm() + eps)
                p.mul_(1 - lr * wd)
                p.sub_(o_hat, alpha=adjusted_lr(lr, adjust_lr_fn, p.shape))
    return params


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_normuon_matches_reference(adjust_lr_fn):
    grads = gradients(4)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.95, beta2=0.9)
    ref = normuon_reference(make_params(), grads, adjust_lr_fn=adjust_lr_fn, **{k: kwargs[k] for k in ("lr", "momentum", "beta2")}, wd=0.1)
    ours = make_params()
    opt = NorMuon(ours, ns_dtype=torch.float32, adjust_lr_fn=adjust_lr_fn, **kwargs)
    run(opt, ours, grads)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    # the row second moment is per output row, in the parameter's own orientation
    assert all(opt.state[p]["second_moment"].shape == (p.shape[0], 1) for p in ours)
    # and it is not Muon: the row normalisation changed the result
    muon = make_params()
    run(BatchedMuon(muon, ns_dtype=torch.float32, adjust_lr_fn=adjust_lr_fn, lr=0.02, weight_decay=0.1), muon, grads)
    assert max((m - o).abs().max().item() for m, o in zip(muon, ours)) > 1e-4


def test_normuon_bf16_matches_bf16_reference():
    grads = gradients(3)
    ref = normuon_reference(make_params(), grads, lr=0.02, wd=0.1, momentum=0.95, beta2=0.95, ns=torch_bf16_ns)
    ours = make_params()
    run(NorMuon(ours, lr=0.02, weight_decay=0.1), ours, grads)  # default: bf16 iteration, like torch's Muon
    for r, o in zip(ref, ours):
        # bf16 iterations written differently disagree by ~1e-3 here; with torch's own, only batching differs
        torch.testing.assert_close(o, r, rtol=0, atol=2e-5)


def test_normuon_update_rms_matches_muon():
    """The Frobenius rescale keeps Muon's update norm: one step from zero momentum, no decay."""
    grads = gradients(1)
    muon, nor = make_params(), make_params()
    run(BatchedMuon(muon, lr=1.0, weight_decay=0.0, ns_dtype=torch.float32), muon, grads)
    run(NorMuon(nor, lr=1.0, weight_decay=0.0, ns_dtype=torch.float32), nor, grads)
    for s, m, n in zip(make_params(), muon, nor):
        assert math.isclose((s - m).norm().item(), (s - n).norm().item(), rel_tol=1e-4)


@pytest.mark.parametrize("cls", [BatchedMuon, NorMuon])
def test_grads_untouched_and_state_round_trip(cls):
    grads = gradients(6)
    params = make_params()
    opt = cls(params, lr=0.02)
    run(opt, params, grads[:3])
    before = [g.clone() for g in grads[3]]
    saved_params = copy.deepcopy([p.detach() for p in params])
    saved = copy.deepcopy(opt.state_dict())
    run(opt, params, grads[3:])
    assert all(torch.equal(g, b) for g, b in zip(grads[3], before))  # p.grad was a clone, but check anyway
    for p, g in zip(params, grads[5]):
        assert torch.equal(p.grad, g)  # the optimizer did not modify p.grad in place

    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = cls(resumed, lr=0.02)
    opt2.load_state_dict(saved)
    run(opt2, resumed, grads[3:])
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)


def test_rejects_non_matrix():
    with pytest.raises(ValueError, match="2-D"):
        BatchedMuon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError):
        BatchedMuon(make_params(), adjust_lr_fn="bogus")


def test_adjusted_lr_matches_torch():
    for shape in [(8, 24), (24, 8), (16, 16)]:
        for fn in (None, "original", "match_rms_adamw"):
            assert adjusted_lr(0.02, fn, shape) == torch_muon._adjust_lr(0.02, fn, torch.Size(shape))
