"""AsyncPP (the ``asyncpp`` optimizer) against a hand-written NAdamW: synchronous, and under the one-step 2BW delay.

The reference is written from the update rule (Dozat 2016 as ``torch.optim.NAdam`` documents it, with decoupled
weight decay), not from torch's code: scheduled momentum ``mu_t = beta1 (1 - 0.5 * 0.96^(t psi))``, moments ``m``,
``v``, and the step ``lr (1 - mu_t) / (1 - prod mu) g / d + lr mu_(t+1) / (1 - prod mu * mu_(t+1)) m / d`` with
``d = sqrt(v / (1 - beta2^t)) + eps``.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_async.optim import DelayedOptimizer
from lightning_async.optim.asyncpp import ASYNCPP_DEFAULTS, scheduled_momentum
from lightning_async.optim.zoo import build_optimizer, group_parameters
from workload import BATCHES, LRS, WEIGHT_DECAY, loss_of, make_model, max_diff, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-6


class HandNAdamW:
    """NAdamW by hand, one state per parameter name; decay ``p *= 1 - lr wd`` on the names in ``decayed``."""

    def __init__(self, lr: float, weight_decay: float, decayed: set[str], beta1=0.99, beta2=0.999, psi=0.004, eps=1e-8):
        self.lr, self.wd, self.decayed = lr, weight_decay, decayed
        self.beta1, self.beta2, self.psi, self.eps = beta1, beta2, psi, eps
        self.t, self.mu_product, self.m, self.v = 0, 1.0, {}, {}

    def update(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new weights after one step from ``weights`` with ``grads`` (the gradient may be a stale one)."""
        self.t += 1
        t, b1, b2 = self.t, self.beta1, self.beta2
        mu = b1 * (1 - 0.5 * 0.96 ** (t * self.psi))
        mu_next = b1 * (1 - 0.5 * 0.96 ** ((t + 1) * self.psi))
        self.mu_product *= mu
        out = {}
        for name, w in weights.items():
            g = grads[name]
            w = w * (1 - self.lr * self.wd) if name in self.decayed else w.clone()
            m = self.m[name] = b1 * self.m.get(name, torch.zeros_like(g)) + (1 - b1) * g
            v = self.v[name] = b2 * self.v.get(name, torch.zeros_like(g)) + (1 - b2) * g * g
            d = (v / (1 - b2 ** t)).sqrt() + self.eps
            w = w - self.lr * (1 - mu) / (1 - self.mu_product) * g / d
            out[name] = w - self.lr * mu_next / (1 - self.mu_product * mu_next) * m / d
        return out


def _gradients(model, weights: dict[str, torch.Tensor], batch) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    model.zero_grad()
    loss_of(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _hand_run(delay: int) -> dict[str, torch.Tensor]:
    """The hand rule on the shared workload: batch t evaluated at x(t - delay), its update applied to x(t)."""
    model = make_model()
    decayed = {n for kind in ("matrix", "embedding") for n, _ in group_parameters(model.named_parameters())[kind]}
    rule = HandNAdamW(LRS["asyncpp"], WEIGHT_DECAY, decayed)
    history = [snapshot(model)]
    for t, batch in enumerate(BATCHES):
        grads = _gradients(model, history[max(t - delay, 0)], batch)
        history.append(rule.update(history[-1], grads))
    return history[-1]


def _zoo_run(delay: int) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = build_optimizer("asyncpp", model.named_parameters(), lr=LRS["asyncpp"], weight_decay=WEIGHT_DECAY)
    stepper = DelayedOptimizer(opt, delay=delay, pairing="2bw") if delay else opt
    for batch in BATCHES:
        loss_of(model, batch).backward()
        stepper.step()
        stepper.zero_grad()
    if not delay:
        return snapshot(model)
    newest = {id(p): w for p, w in zip(stepper.params, stepper.newest_weights())}
    return {n: newest[id(p)].clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("delay", [0, 1])
def test_asyncpp_follows_the_hand_written_nadamw(delay: int):
    """Sync, and the method proper: NAdamW on the gradient of the previous weights (2BW pairing)."""
    hand, zoo = _hand_run(delay), _zoo_run(delay)
    assert max_diff(hand, zoo) < TOL
    assert max_diff(hand, snapshot(make_model())) > 1e-3  # it trained


def test_the_delay_changes_the_result():
    assert max_diff(_hand_run(1), _hand_run(0)) > 1e-4


def test_published_settings():
    model = make_model()
    opt = build_optimizer("asyncpp", model.named_parameters(), lr=3e-4, weight_decay=0.01)
    assert isinstance(opt, torch.optim.NAdam)
    group = opt.param_groups[0]
    assert group["betas"] == (0.99, 0.999) and group["momentum_decay"] == 0.004 and group["decoupled_weight_decay"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]  # no decay on norms and biases
    assert ASYNCPP_DEFAULTS["betas"][0] == 0.99
    with pytest.raises(TypeError, match="does not take decoupled_weight_decay"):
        build_optimizer("asyncpp", model.named_parameters(), lr=3e-4, decoupled_weight_decay=False)


def test_scheduled_momentum_is_far_below_its_nominal_value_on_short_runs():
    # mu_t = 0.99 (1 - 0.5 * 0.96^(0.004 t)): 0.99 * 0.50008 at t=1; 0.96^9.6 = 0.6758 at t=2400
    assert scheduled_momentum(1) == pytest.approx(0.99 * (1 - 0.5 * 0.96 ** 0.004), rel=1e-12)
    assert scheduled_momentum(1) == pytest.approx(0.4951, abs=1e-4)
    assert scheduled_momentum(2400) == pytest.approx(0.99 * (1 - 0.5 * math.exp(9.6 * math.log(0.96))), rel=1e-12)
    assert scheduled_momentum(2400) == pytest.approx(0.6555, abs=1e-4)
    assert scheduled_momentum(10_000) == pytest.approx(0.8932, abs=1e-4)
