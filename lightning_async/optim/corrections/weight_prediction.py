"""Weight prediction: the forward reads weights extrapolated along the last update, not the stale version.

Under a delay of ``k`` steps the forward of step ``t`` reads ``x(t-k)``. Weight prediction (PipeDream's weight
prediction; SpecTrain and PipeMare's extrapolation; the linear prediction of Kosson et al.) evaluates it at::

    x_hat = x(t-k) + strength * k * (x(t-k) - x(t-k-1))

an estimate of where the weights will be when the gradient is applied, using only versions that exist when the
forward starts. The gradient is taken at ``x_hat`` and applied to the newest weights as usual. Costs one extra
weight version (the predicted weights), so the single-device simulation supports it and the 2BW pipeline, which
keeps two versions per stage, does not (the strategy refuses it with a message).
"""

from __future__ import annotations

import torch

from lightning_async.identity import DEFAULT_STRENGTHS
from lightning_async.optim.corrections.base import FORWARD, Correction, ParameterBuffers


class WeightPrediction(Correction):
    """Evaluate each batch at ``x(t-k) + strength * k * (x(t-k) - x(t-k-1))``; one extra weight version."""

    method = "weight-prediction"
    level = FORWARD

    def __init__(self, strength: float = DEFAULT_STRENGTHS["weight-prediction"]) -> None:
        super().__init__(strength)
        self.predicted = ParameterBuffers()

    @torch.no_grad()
    def predict_(self, p: torch.Tensor, forward: torch.Tensor, previous: torch.Tensor, delay: int) -> torch.Tensor:
        if not self.enabled or delay == 0:
            return forward
        out = self.predicted.tensors.get(p)
        if out is None:
            out = torch.empty_like(forward)
            self.predicted.update([(p, out)])
        torch.sub(forward, previous, out=out)
        out.mul_(self.strength * delay).add_(forward)
        return out
