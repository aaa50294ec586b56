"""Deprecated module name (kept for one release): the learning-rate schedules live in
:mod:`lightning_async.optim.lr_schedules` (``pipeline.schedules`` is the pipeline's)."""

from lightning_async.optim.lr_schedules import warmup_cosine

__all__ = ["warmup_cosine"]
