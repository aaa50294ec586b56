"""One delayed optimizer step: the update rule shared by the single-device wrappers and the pipeline.

The rule (PipeDream-2BW, BRIEF §1-§2): the newest weights ``x_t`` receive the update ``u`` that the
optimizer computes from a gradient taken at older weights, ``x_{t+1} = x_t - u``, optionally
corrected by a staleness correction (Error Feedback and its family, DC-ASGD). The gradient's own weights are no longer needed once it exists, so
``x_{t+1}`` is written into *their* storage: the newest version ``x_t`` stays intact for whoever
still reads it (the next batch's forward on one device, in-flight micro-batches in the pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from itertools import repeat

import torch
from torch.optim import Optimizer

from lightning_async.optim.corrections import GRADIENT, UPDATE, Correction


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


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _shard(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP-sharded ``DTensor`` (``t`` itself otherwise): what the copies read and write.
    (A plain tensor is recognised by its exact type first: this runs twice per tensor and update.)"""
    if type(t) in _PLAIN:
        return t
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def delayed_step(
    optimizer: Optimizer,
    params: Sequence[torch.nn.Parameter],
    grads: Sequence[torch.Tensor | None],
    newest: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    correction: Correction | None = None,
    hyperparameters: Sequence[dict] | None = None,
    updated: Sequence[bool] | None = None,
) -> None:
    """Write ``newest - u(grads)`` (corrected if asked) into ``out`` and point ``params`` at it.

    Args:
        optimizer: optimizer over ``params``; its state advances by one step.
        params: the optimizer's parameter objects; after the call ``p.data`` is ``out[i]``.
        grads: gradients to feed the optimizer (taken at older weights); ``None`` skips a parameter.
        newest: the newest weights ``x_t``; left unchanged (``out`` may alias it for an undelayed step).
        out: storage receiving ``x_{t+1}``. Where it is distinct from ``newest`` it holds, on entry, the weights
            the gradient was taken at (what a gradient-level correction reads); its old content is overwritten.
        correction: a staleness correction (:mod:`lightning_async.optim.corrections`); gradient-level ones run
            before the step, update-level ones after it (they need ``newest`` distinct from ``out`` to read ``u``).
        hyperparameters: per-group values (e.g. ``{"lr": ...}``) applied for this step only.
        updated: which parameters this process updates (``None``: all). The others are left out of the step and
            the correction, and their ``out`` is not written: the sharded optimizer
            (:mod:`lightning_async.pipeline.sharding`) fills it with the new weights another replica computed.
    """
    active = correction is not None and correction.enabled
    if updated is not None:
        grads = [g if own else None for g, own in zip(grads, updated)]
    mine = repeat(True) if updated is None else updated
    delayed, copy_to, copy_from = [], [], []  # (parameter, newest, out) where out is other storage; their shards
    for p, src, dst, own in zip(params, newest, out, mine):
        if own and dst is not src:
            dst_shard, src_shard = _shard(dst), _shard(src)
            if dst_shard.data_ptr() != src_shard.data_ptr():
                delayed.append((p, src, dst))
                copy_to.append(dst_shard)
                copy_from.append(src_shard)
    if active and correction.level == GRADIENT:
        correction.compensate_(
            optimizer, {p: g for p, g in zip(params, grads) if g is not None},
            newest={p: src for p, src, _ in delayed}, stale={p: dst for p, _, dst in delayed},
        )
    if delayed:
        torch._foreach_copy_(copy_to, copy_from)
    for p, g, dst in zip(params, grads, out):
        if dst is not p:  # (an FSDP-sharded parameter is its own storage)
            p.data = dst
        p.grad = g
    with group_values(optimizer, hyperparameters):
        optimizer.step()
        if active and correction.level == UPDATE:
            correction.correct_(optimizer, {p: src for p, src, _ in delayed})
    for p in params:
        p.grad = None
