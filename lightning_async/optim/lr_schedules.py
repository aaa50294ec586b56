"""Learning-rate schedule: linear warmup, then cosine decay to a floor (the paper's setup)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total_steps: int, warmup_fraction: float = 0.1, min_lr_fraction: float = 0.1) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    warmup = int(round(warmup_fraction * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_fraction + (1.0 - min_lr_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))
