"""The causal-LM objective, shared by the LightningModule, the pipeline and the tests (no Lightning import)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_next_token(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch is ``[B, T+1]`` token ids: inputs are the first T, targets the last T."""
    return batch[:, :-1], batch[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all target tokens (in fp32 whatever the logits' dtype)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
