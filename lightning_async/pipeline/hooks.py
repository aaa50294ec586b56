"""What the runtime calls around a rank's backwards and updates, so a framework's step hooks run where they mean
something. The runtime knows no Lightning: the strategy passes a subclass that calls Lightning's hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


class StepHooks:
    """No-op hooks (the default). ``active``: the runtime shows gradients on the parameters for them."""

    active = False

    def before_backward(self, batch: int, loss: torch.Tensor) -> None:
        """Before this rank's first backward of ``batch`` (``loss``: the micro-batch's, on the last piece)."""

    def after_backward(self, batch: int) -> None:
        """After this rank's last backward of ``batch``, its gradients on the parameters' ``.grad``."""

    def before_optimizer_step(self, batch: int) -> None:
        """Before the update of ``batch`` (its reduced, unclipped gradients on the parameters' ``.grad``)."""

    def before_zero_grad(self, batch: int) -> None:
        """After the update of ``batch``, before its gradients are dropped."""

    @contextlib.contextmanager
    def gradients_shown(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> Iterator[None]:
        """``grads`` on ``params``' ``.grad`` for the duration (what the hooks read); nothing when inactive."""
        if not self.active:
            yield
            return
        before = [p.grad for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        try:
            yield
        finally:
            for p, g in zip(params, before):
                p.grad = g
