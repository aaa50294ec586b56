"""Checks shared by the checkpoint tests of the asynchronous schedules (fits run by ``test_strategy.fit`` in one spawn,
each rank returning ``(state, metrics, start weights, start optimizer state)`` per fit, ``None`` where it sat out)."""

from __future__ import annotations

import torch


def merged_fits(per_rank: list, key: str, part: int = 0) -> dict:
    """Part ``part`` of fit ``key`` merged over the ranks that ran it."""
    merged: dict = {}
    for rank in per_rank:
        if rank[key] is not None:
            merged.update(rank[key][part])
    return merged


def assert_resume_equals(per_rank: list, whole: str, resumed: str, tolerance: float = 2e-6) -> None:
    """Fit ``resumed`` (from a mid-run checkpoint of ``whole``) ends on ``whole``'s weights and logged loss."""
    a, b = merged_fits(per_rank, whole), merged_fits(per_rank, resumed)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < tolerance, f"max |resumed - uninterrupted| = {worst}"
    assert abs(per_rank[0][resumed][1]["train/loss"] - per_rank[0][whole][1]["train/loss"]) < 1e-6


def assert_starts_from(path: str, per_rank: list, key: str) -> None:
    """Fit ``key`` (resumed from ``path``, on another layout) started from the saved weights and optimizer state."""
    from test_distributed_checkpoint import _saved_optimizer

    from lightning_async.pipeline.checkpoint import consolidate

    weights, optimizer = consolidate(path), _saved_optimizer(path)
    seen = merged_fits(per_rank, key, 2)
    assert set(seen) == set(weights) and all(torch.equal(seen[k], weights[k]) for k in weights)
    state = merged_fits(per_rank, key, 3)
    assert state and all(torch.equal(state[k], optimizer[k]) for k in state)
