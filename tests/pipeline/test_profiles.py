"""Delay profiles: WPipe's single-device rule g(t) = grad f_t(A(t - 1), B(t)) against a hand-written loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_async.optim.delay import DelayedOptimizer
from lightning_async.pipeline.profiles import describe, parameter_delays, stage_delays, unit_delays

STEPS, LR = 6, 0.1


def _units() -> list[tuple[str, nn.Module]]:
    torch.manual_seed(0)
    return [(f"u{i}", nn.Linear(3, 3)) for i in range(4)]


def _loss(units, x) -> torch.Tensor:
    for _, unit in units:
        x = torch.tanh(unit(x))
    return x.pow(2).mean()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 3, generator=g) for _ in range(STEPS)]


def test_wpipe_profile_makes_the_first_half_stale():
    assert stage_delays("wpipe", 2, 1) == [1, 1, 0, 0]
    assert unit_delays(_units(), "wpipe", 2, delay=1) == {"u0": 1, "u1": 1, "u2": 0, "u3": 0}
    assert describe("wpipe", 4, 1) == "wpipe-4"
    with pytest.raises(ValueError, match="'wpipe' delay profile needs the number of stages"):
        stage_delays("wpipe", None, 1)


def _wpipe_by_hand(half: int) -> list[torch.Tensor]:
    """WPipe's rule written out with SGD: A (the first ``half`` units) read at A(t - 1), B at B(t)."""
    units = _units()
    params = [list(u.parameters()) for _, u in units]
    a_hist = [[p.detach().clone() for ps in params[:half] for p in ps]]  # A(0), A(1), ...
    b = [p.detach().clone() for ps in params[half:] for p in ps]
    for t, x in enumerate(_batches()):
        a_read = a_hist[max(t - 1, 0)]
        leaves = [w.clone().requires_grad_(True) for w in a_read + b]
        with torch.no_grad():
            for p, w in zip([p for ps in params for p in ps], leaves):
                p.copy_(w)
        loss = _loss(units, x)
        grads = torch.autograd.grad(loss, [p for ps in params for p in ps])
        ga, gb = grads[:len(a_read)], grads[len(a_read):]
        a_hist.append([w - LR * g for w, g in zip(a_hist[-1], ga)])  # A(t + 1) = A(t) - u(g_A(t))
        b = [w - LR * g for w, g in zip(b, gb)]  # B(t + 1) = B(t) - u(g_B(t))
    return a_hist[-1] + b


def _delayed_optimizer_run(profile_delays) -> list[torch.Tensor]:
    units = _units()
    params = [p for _, u in units for p in u.parameters()]
    by_param = parameter_delays(units, profile_delays)
    opt = DelayedOptimizer(torch.optim.SGD(params, lr=LR), delay=0, pairing="2bw", parameter_delays=by_param)
    for x in _batches():
        opt.zero_grad()
        _loss(units, x).backward()
        opt.step()
    return [w.detach().clone() for w in opt.newest_weights()]


def test_wpipe_profile_follows_wpipes_rule_on_one_device():
    expected = _wpipe_by_hand(half=2)
    got = _delayed_optimizer_run(unit_delays(_units(), "wpipe", 2, delay=1))
    assert max((a - b).abs().max().item() for a, b in zip(got, expected)) < 1e-6
    # negative controls: 2BW (everything stale) and no delay at all are other rules
    for other in ({n: 1 for n, _ in _units()}, {n: 0 for n, _ in _units()}):
        moved = _delayed_optimizer_run(other)
        assert max((a - b).abs().max().item() for a, b in zip(moved, expected)) > 1e-4


def test_paci_is_a_microbatch_rule_not_unit_delays():
    # its per-stage numbers are the most steps a stage's forwards are stale; the rule itself is pipeline/paci.py's
    assert stage_delays("paci", 4, 1) == [1, 1, 1, 0] and describe("paci", 4, 1) == "paci-4"
    with pytest.raises(ValueError, match=r"rule per micro-batch, not a delay per unit: run it with DelaySimulation"):
        unit_delays(_units(), "paci", 2, delay=1)
    with pytest.raises(ValueError, match="'paci' delay profile needs the number of stages"):
        stage_delays("paci", None, 1)
