"""Update-level corrections: Error Feedback (Zmushko et al., 2026), an adaptive EF strength, and a
Nesterov-style look-ahead along the update momentum.

All three see the optimizer's full update ``u`` (everything its step changed, decoupled weight decay
included unless ``extrapolate_weight_decay=False``) and add to the displacement it applied:

* ``ef``           ``x <- x - u - lam (u - u_prev)``; ``lam = 1`` is the paper's ``x(t+1) = x(t) - 2u(t-1) + u(t-2)``.
                   A parameter ``k`` steps stale gets the k-step form ``x <- x - u - lam (u - u_(t-k))`` (docs/delay.md).
* ``adaptive-ef``  the same with ``lam`` chosen per tensor from the update sequence itself (our rule, below).
* ``nesterov``     ``v <- beta v + (1 - beta) u``; ``x <- x - u - gamma (v - v_prev)``: the weights are kept
                   ``gamma v`` ahead of the plain trajectory, a look-ahead along the smoothed update.

Every one telescopes while its strength is constant: the corrected steps sum to the plain steps plus one bounded
offset (``lam u_last``, ``gamma v_last``), so none adds drift. ``nesterov`` with ``momentum=0`` is ``ef``.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from lightning_async.identity import DEFAULT_STRENGTHS
from lightning_async.optim.corrections import base
from lightning_async.optim.corrections.base import Correction, ParameterBuffers


class UpdateCorrection(Correction):
    """Base of the update-level corrections: computes ``u`` per group of parameters, subclasses change ``x``.

    Args:
        strength: how much of the correction to apply (0 switches it off).
        extrapolate_weight_decay: if True (the paper's form) decoupled weight decay is part of ``u``; if False
            the decay displacement ``lr * wd * x`` is removed from ``u`` first.
    """

    def __init__(self, strength: float = 1.0, extrapolate_weight_decay: bool = True) -> None:
        super().__init__(strength)
        self.extrapolate_weight_decay = bool(extrapolate_weight_decay)

    @torch.no_grad()
    def correct_(self, optimizer: Optimizer, before: dict) -> None:
        if not self.enabled:
            return
        for group in optimizer.param_groups:
            decay = 0.0 if self.extrapolate_weight_decay else group.get("lr", 0.0) * group.get("weight_decay", 0.0)
            params = [p for p in group["params"] if p in before]
            for chunk in base.chunks(params, base.CHUNK_ELEMENTS):
                old = [before[p] for p in chunk]
                updates = torch._foreach_sub(old, chunk)  # u = before - after
                if decay:
                    torch._foreach_sub_(updates, old, alpha=decay)
                self._correct_chunk(chunk, updates)

    def _correct_chunk(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def describe(self) -> dict:
        return {**super().describe(), "extrapolate_weight_decay": self.extrapolate_weight_decay}

    def state_dict(self, params) -> dict:
        return {**super().state_dict(params), "extrapolate_weight_decay": self.extrapolate_weight_decay}


class ErrorFeedbackCorrection(UpdateCorrection):
    """``x <- x - u - strength (u - u_(t-k))`` for a parameter ``k`` steps stale: the weights are kept the sum of
    the last ``k`` updates ahead of the plain trajectory, so a gradient taken now lands where the weights will
    be (the derivation: docs/delay.md, "Error Feedback for k-step delays").

    ``k`` is each parameter's delay (:meth:`set_delays`; 1 unless set, as under 2BW). ``k = 1`` is the paper's
    EF with one buffer (``u_prev``, zero at first); ``k > 1`` keeps the last ``k`` updates; a parameter with
    ``k = 0`` (a current stage) is left alone. ``k_step=False`` applies the one-step rule to every parameter
    whatever its delay (the baseline the k-step form is measured against).
    """

    method = "ef"

    def __init__(self, strength: float = DEFAULT_STRENGTHS["ef"], extrapolate_weight_decay: bool = True, k_step: bool = True) -> None:
        super().__init__(strength, extrapolate_weight_decay)
        self.k_step = bool(k_step)
        self.previous_update = ParameterBuffers()  # k = 1: u_(t-1)
        self.update_history = ParameterBuffers()  # k > 1: the last k updates, a ring of shape [k, *p.shape]
        self.updates_seen = ParameterBuffers(scalar=True)  # k > 1: how many updates the ring has taken
        self.delays: dict[torch.Tensor, int] = {}

    def set_delays(self, delays) -> None:
        if self.k_step:
            self.delays = {p: int(k) for p, k in delays.items() if k != 1}

    def _correct_chunk(self, params, updates) -> None:
        one_step = [(p, u) for p, u in zip(params, updates) if self.delays.get(p, 1) == 1]
        if len(one_step) == len(params):
            self._correct_one_step(params, updates)
            return
        if one_step:
            self._correct_one_step(*map(list, zip(*one_step)))
        for p, u in zip(params, updates):
            k = self.delays.get(p, 1)
            if k > 1:
                p.sub_(u - self._push(p, u, k), alpha=self.strength)

    def _correct_one_step(self, params, updates) -> None:
        previous = [self.previous_update.get(p) for p in params]
        torch._foreach_sub_(params, torch._foreach_sub(updates, previous), alpha=self.strength)
        self.previous_update.update(zip(params, updates))

    def _push(self, p: torch.Tensor, u: torch.Tensor, k: int) -> torch.Tensor:
        """Store ``u`` in ``p``'s ring of the last ``k`` updates; return the one it replaces, ``u_(t-k)``."""
        ring = self.update_history.tensors.get(p)
        if ring is None or ring.shape[0] != k:
            ring = torch.zeros((k, *p.shape), device=p.device, dtype=p.dtype)
            self.update_history.update([(p, ring)])
        seen = int(self.updates_seen.get(p))
        slot = ring[seen % k]
        oldest = slot.clone()  # zero until k updates were taken: the ring fills like a freshly started pipeline
        slot.copy_(u)
        self.updates_seen.update([(p, torch.tensor(float(seen + 1)))])
        return oldest

    def describe(self) -> dict:
        return {**super().describe(), "k_step": self.k_step}

    def state_dict(self, params) -> dict:
        return {**super().state_dict(params), "k_step": self.k_step}


class AdaptiveErrorFeedback(UpdateCorrection):
    """EF whose strength each tensor sets for itself from its own updates (our rule; the paper leaves it open).

    EF extrapolates the update sequence one step: it applies ``u_t + lam d_t`` with ``d_t = u_t - u_(t-1)``, i.e.
    it predicts the next difference as ``lam d_t``. The ``lam`` that predicts it best in least squares is the
    regression coefficient of ``d_(t+1)`` on ``d_t``, which this correction estimates online per tensor::

        c <- beta c + (1 - beta) <d_t, d_(t-1)>      s <- beta s + (1 - beta) |d_(t-1)|^2
        lam_t = clamp(c / s, 0, strength)

    Smooth, trending updates (AdamW's) give ``lam`` near the cap; updates whose consecutive differences
    cancel (a sign update's flips: ``<d_t, d_(t-1)> < 0``) give 0, where plain EF would amplify the noise.
    ``lam`` stays 0 until a tensor has two differences. Memory: two parameter-sized buffers (``u_prev``,
    ``d_prev``) and two scalars per tensor.

    Args:
        strength: the cap on ``lam`` (1: at most the paper's EF).
        decay: ``beta``, the averaging of the two statistics.
    """

    method = "adaptive-ef"

    def __init__(self, strength: float = DEFAULT_STRENGTHS["adaptive-ef"], decay: float = 0.95, extrapolate_weight_decay: bool = True) -> None:
        super().__init__(strength, extrapolate_weight_decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"AdaptiveErrorFeedback decay must be in [0, 1), got {decay}.")
        self.decay = float(decay)
        self.previous_update = ParameterBuffers()
        self.previous_difference = ParameterBuffers()
        self.covariance = ParameterBuffers(scalar=True)
        self.variance = ParameterBuffers(scalar=True)
        self.strengths = ParameterBuffers(scalar=True)

    def _correct_chunk(self, params, updates) -> None:
        beta = self.decay
        for p, u in zip(params, updates):
            known = p in self.previous_update
            d = u - self.previous_update.get(p)
            lam = self.strengths.get(p)
            if p in self.previous_difference:
                d_prev = self.previous_difference.get(p)
                c = self.covariance.get(p) * beta + (1 - beta) * torch.sum(d * d_prev, dtype=torch.float32)
                s = self.variance.get(p) * beta + (1 - beta) * torch.sum(d_prev * d_prev, dtype=torch.float32)
                self.covariance.update([(p, c)])
                self.variance.update([(p, s)])
                lam = torch.where(s > 0, c / s.clamp_min(torch.finfo(torch.float32).tiny), 0.0).clamp(0.0, self.strength)
                self.strengths.update([(p, lam)])
            p.sub_(d * lam.to(d.dtype))
            self.previous_update.update([(p, u)])
            if known:
                self.previous_difference.update([(p, d)])

    def statistics(self) -> dict[str, float]:
        """``strength``: the mean ``lam`` over tensors, weighted by size (0 before any is set)."""
        if not len(self.strengths):
            return {"strength": 0.0}
        total = sum(p.numel() for p in self.strengths.tensors)
        mean = sum(lam.item() * p.numel() for p, lam in self.strengths.tensors.items()) / total
        return {"strength": mean}

    def describe(self) -> dict:
        return {**super().describe(), "decay": self.decay}


class NesterovLookahead(UpdateCorrection):
    """A Nesterov-style look-ahead for the delay: keep the weights ``gamma v`` ahead of the plain trajectory,
    where ``v`` is the momentum (EMA) of the updates: ``v <- beta v + (1 - beta) u``,
    ``x <- x - u - gamma (v - v_prev)``.

    Nesterov's method evaluates the gradient at a point one momentum step ahead. Under a one-step delay the
    gradient is taken at weights one update behind; keeping the stored weights one smoothed update ahead makes
    the stale point sit about where the plain trajectory is when the gradient is used. With ``beta = 0`` the
    smoothed update is the last update and this is EF (``gamma = lam``); a ``beta`` near 1 extrapolates the
    trend instead of the last step's noise. Our reading in the spirit of Ajanthan et al. (ICML 2025, "AsyncPP"),
    who modify NAG's look-ahead inside their optimizer; this is an optimizer-agnostic, update-level variant,
    not their exact algorithm. One parameter-sized buffer (``v``).

    Args:
        strength: ``gamma``, the look-ahead in steps of the smoothed update (1 = the one-step delay).
        momentum: ``beta``.
    """

    method = "nesterov"

    def __init__(self, strength: float = DEFAULT_STRENGTHS["nesterov"], momentum: float = 0.9, extrapolate_weight_decay: bool = True) -> None:
        super().__init__(strength, extrapolate_weight_decay)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"NesterovLookahead momentum must be in [0, 1), got {momentum}.")
        self.momentum = float(momentum)
        self.velocity = ParameterBuffers()

    def _correct_chunk(self, params, updates) -> None:
        previous = [self.velocity.get(p) for p in params]
        velocity = torch._foreach_mul(previous, self.momentum)
        torch._foreach_add_(velocity, updates, alpha=1.0 - self.momentum)
        torch._foreach_sub_(params, torch._foreach_sub(velocity, previous), alpha=self.strength)
        self.velocity.update(zip(params, velocity))

    def describe(self) -> dict:
        return {**super().describe(), "momentum": self.momentum}
