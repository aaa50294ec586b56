"""DC-ASGD delay compensation (Zheng et al., ICML 2017), a gradient-level correction.

A gradient ``g`` taken at stale weights ``x_stale`` is moved to the newest weights ``x_new`` by a first-order
Taylor step whose Hessian is approximated by the diagonal outer product ``lam g * g``::

    g <- g + lam * g * g * (x_new - x_stale)

With ``adaptive=True`` (their DC-ASGD-a) ``lam`` is divided elementwise by the root of a running mean square of
the gradient, ``ms <- m ms + (1 - m) g * g``, ``lam_t = lam / sqrt(ms + eps)``, which makes the strength
independent of the gradient's scale (one parameter-sized buffer). The compensated gradient then goes through
the optimizer as usual (after gradient clipping, which the trainer or the pipeline applies first).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from lightning_async.identity import DEFAULT_STRENGTHS
from lightning_async.optim.corrections.base import GRADIENT, Correction, ParameterBuffers


class DelayCompensation(Correction):
    """``g <- g + lam g * g * (x_new - x_stale)``, optionally with ``lam / sqrt(mean square of g)``.

    Args:
        strength: ``lam`` (``lam_0`` of DC-ASGD-a when ``adaptive``).
        adaptive: divide by the running RMS of the gradient (DC-ASGD-a).
        mean_square_decay: ``m`` of that running mean.
        eps: added to the mean square before the root.
    """

    method = "dc-asgd"
    level = GRADIENT
    needs_stale_weights = True

    def __init__(self, strength: float = DEFAULT_STRENGTHS["dc-asgd"], adaptive: bool = True, mean_square_decay: float = 0.95,
                 eps: float = 1e-7) -> None:
        super().__init__(strength)
        if not 0.0 <= mean_square_decay < 1.0:
            raise ValueError(f"DelayCompensation mean_square_decay must be in [0, 1), got {mean_square_decay}.")
        self.adaptive = bool(adaptive)
        self.mean_square_decay = float(mean_square_decay)
        self.eps = float(eps)
        self.mean_square = ParameterBuffers()

    @torch.no_grad()
    def compensate_(self, optimizer: Optimizer, grads: dict, newest: dict, stale: dict) -> None:
        if not self.enabled:
            return
        for p, g in grads.items():
            if g is None or p not in stale:
                continue
            square = g * g
            if self.adaptive:
                ms = self.mean_square.get(p).mul(self.mean_square_decay).add_(square, alpha=1.0 - self.mean_square_decay)
                self.mean_square.update([(p, ms)])
                square = square / (ms + self.eps).sqrt()
            g.add_(square * (newest[p] - stale[p]), alpha=self.strength)

    def describe(self) -> dict:
        return {**super().describe(), "adaptive": self.adaptive, "mean_square_decay": self.mean_square_decay}
