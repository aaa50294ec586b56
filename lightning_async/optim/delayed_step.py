"""One delayed optimizer step: the update rule shared by the single-device wrappers and the pipeline.

The rule (PipeDream-2BW, BRIEF §1-§2): the newest weights ``x_t`` receive the update ``u`` that the
optimizer computes from a gradient taken at older weights, ``x_{t+1} = x_t - u``, optionally
corrected by Error Feedback. The gradient's own weights are no longer needed once it exists, so
``x_{t+1}`` is written into *their* storage: the newest version ``x_t`` stays intact for whoever
still reads it (the next batch's forward on one device, in-flight micro-batches in the pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch.optim import Optimizer

from lightning_async.optim.error_feedback import ErrorFeedbackCorrection


#: Per-group hyperparameters that schedulers change during training (LambdaLR/cosine: ``lr``; OneCycleLR and
#: CyclicLR: ``momentum`` or ``betas``; weight-decay schedules). A delayed update must use the values of the
#: batch its gradient came from. Keys an optimizer itself advances inside ``step()`` (e.g. a ``step`` counter
#: kept in the group) must never be listed: the values are restored after the step.
SCHEDULED_KEYS = ("lr", "momentum", "betas", "weight_decay")


def scheduled_values(optimizer: Optimizer) -> list[dict]:
    """The current :data:`SCHEDULED_KEYS` of every parameter group (to replay them with :func:`group_values`)."""
    return [{k: g[k] for k in SCHEDULED_KEYS if k in g} for g in optimizer.param_groups]


@contextmanager
def group_values(optimizer: Optimizer, values: Sequence[dict] | None):
    """Temporarily set per-group hyperparameters (e.g. the learning rate recorded for a batch)."""
    if not values:
        yield
        return
    saved = [{k: g[k] for k in v} for g, v in zip(optimizer.param_groups, values)]
    for g, v in zip(optimizer.param_groups, values):
        g.update(v)
    try:
        yield
    finally:
        for g, v in zip(optimizer.param_groups, saved):
            g.update(v)


@torch.no_grad()
def delayed_step(
    optimizer: Optimizer,
    params: Sequence[torch.nn.Parameter],
    grads: Sequence[torch.Tensor | None],
    newest: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    correction: ErrorFeedbackCorrection | None = None,
    hyperparameters: Sequence[dict] | None = None,
) -> None:
    """Write ``newest - u(grads)`` (EF-corrected if asked) into ``out`` and point ``params`` at it.

    Args:
        optimizer: optimizer over ``params``; its state advances by one step.
        params: the optimizer's parameter objects; after the call ``p.data`` is ``out[i]``.
        grads: gradients to feed the optimizer (taken at older weights); ``None`` skips a parameter.
        newest: the newest weights ``x_t``; left unchanged (``out`` may alias it for an undelayed step).
        out: storage receiving ``x_{t+1}``; its old content is overwritten.
        correction: Error Feedback; needs ``newest`` distinct from ``out`` to read ``u``.
        hyperparameters: per-group values (e.g. ``{"lr": ...}``) applied for this step only.
    """
    copies = [(dst, src) for src, dst in zip(newest, out) if dst.data_ptr() != src.data_ptr()]
    if copies:
        torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies])
    for p, g, dst in zip(params, grads, out):
        p.data = dst
        p.grad = g
    with group_values(optimizer, hyperparameters):
        optimizer.step()
        if correction is not None and correction.enabled:
            correction.correct_(optimizer, {p: src for p, src in zip(params, newest) if p.data_ptr() != src.data_ptr()})
    for p in params:
        p.grad = None
