"""The Error-Feedback correction, on the optimizer's update (Zmushko et al., 2026).

A delayed step applies ``x <- x - u`` where ``u`` is the wrapped optimizer's full update. With
strength ``lam`` the corrected step applies ``x <- x - u - lam * (u - u_prev)``; ``lam = 1`` is the
paper's ``x(t+1) = x(t) - 2u(t-1) + u(t-2)``. ``u_prev`` starts at zero, so the corrected steps sum
to the plain steps plus the boundary term ``lam * u_last``.

This module is the only place the correction is computed: the single-device wrappers, the
callbacks and the pipeline runtime all call :meth:`ErrorFeedbackCorrection.correct_`.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer


#: parameters are corrected in groups of at most this many elements: ``torch._foreach_*`` launches one kernel
#: per group and dtype, and the two temporaries (``u`` and ``u - u_prev``) stay bounded (2 x 64 MiB in fp32)
CHUNK_ELEMENTS = 1 << 24


def _chunks(tensors: list[torch.Tensor], max_elements: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` holding at most ``max_elements`` elements (a larger tensor stands alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if out and size + t.numel() <= max_elements:
            out[-1].append(t)
            size += t.numel()
        else:
            out.append([t])
            size = t.numel()
    return out


class ErrorFeedbackCorrection:
    """Holds one ``u_prev`` buffer per parameter (the only persistent memory EF costs).

    Args:
        strength: ``lam``; 0 disables the correction, 1 is the paper's rule.
        extrapolate_weight_decay: if True (default, the paper's form) the decoupled weight decay is
            part of the extrapolated update. If False, the decay displacement ``lr * wd * x`` is
            removed from ``u`` before extrapolating, so only the gradient-driven part is corrected.
    """

    def __init__(self, strength: float = 1.0, extrapolate_weight_decay: bool = True) -> None:
        if strength < 0:
            raise ValueError(f"Error-Feedback strength must be >= 0, got {strength}.")
        self.strength = float(strength)
        self.extrapolate_weight_decay = extrapolate_weight_decay
        self.previous_update: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def enabled(self) -> bool:
        return self.strength != 0.0

    @torch.no_grad()
    def correct_(self, optimizer: Optimizer, before: dict[torch.Tensor, torch.Tensor]) -> None:
        """Correct every parameter of ``optimizer`` in place, after its ``step()``.

        ``before[p]`` holds the weights ``p`` had before the step; ``p`` now holds ``before - u``.
        """
        if not self.enabled:
            return
        lam = self.strength
        for group in optimizer.param_groups:
            decay = 0.0 if self.extrapolate_weight_decay else group.get("lr", 0.0) * group.get("weight_decay", 0.0)
            params = [p for p in group["params"] if p in before]
            for chunk in _chunks(params, CHUNK_ELEMENTS):
                old = [before[p] for p in chunk]
                updates = torch._foreach_sub(old, chunk)  # u = before - after
                if decay:
                    torch._foreach_sub_(updates, old, alpha=decay)
                previous = [self._buffer(p) for p in chunk]
                torch._foreach_sub_(chunk, torch._foreach_sub(updates, previous), alpha=lam)  # x - lam (u - u_prev)
                self.previous_update.update(zip(chunk, updates))  # new buffers: earlier state_dicts stay valid

    def _buffer(self, p: torch.Tensor) -> torch.Tensor:
        previous = self.previous_update.get(p)
        return torch.zeros_like(p) if previous is None else previous

    def state_dict(self, params: list[torch.Tensor]) -> dict:
        """Buffers listed in the order of ``params`` (the optimizer's parameter order)."""
        return {
            "strength": self.strength,
            "extrapolate_weight_decay": self.extrapolate_weight_decay,
            "previous_update": [self.previous_update.get(p) for p in params],
        }

    def load_state_dict(self, state: dict, params: list[torch.Tensor]) -> None:
        buffers = state["previous_update"]
        if len(buffers) != len(params):
            raise ValueError(f"Error-Feedback state has {len(buffers)} buffers for {len(params)} parameters.")
        self.previous_update = {p: b.to(p.device, p.dtype).clone() for p, b in zip(params, buffers) if b is not None}
