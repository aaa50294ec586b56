"""The ``closure`` argument of ``Optimizer.step``, as torch's optimizers evaluate it."""

from __future__ import annotations

import torch


def evaluate_closure(closure):
    """``closure()`` with gradients enabled (``step`` itself runs under ``no_grad``), or ``None`` without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
