"""Per-rank and per-piece costs: a value given as a scalar, one per rank, one per hop or one per piece, spread over
a schedule's pieces (virtual stages). The one reading of such arguments, for the timing and the memory model."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_async.pipeline.schedules import ScheduleSpec

__all__ = ["per_hop", "per_piece", "per_rank"]


def per_rank(value: float | Sequence[float], p: int, name: str) -> list[float]:
    """``value`` for each of ``p`` entries: a scalar repeated, or exactly ``p`` values (``ValueError`` otherwise)."""
    if isinstance(value, (int, float)):
        return [float(value)] * p
    values = [float(v) for v in value]
    if len(values) != p:
        raise ValueError(f"{name} has {len(values)} entries, expected one per stage ({p}).")
    return values


def per_hop(value: float | Sequence[float], pieces: int) -> list[float]:
    """A latency for each boundary between consecutive pieces: a scalar repeated, or one value per boundary."""
    if isinstance(value, (int, float)):
        return [float(value)] * max(pieces - 1, 0)
    values = [float(v) for v in value]
    if len(values) != max(pieces - 1, 0):
        raise ValueError(f"comm has {len(values)} entries, expected one per hop ({pieces - 1}).")
    return values


def per_piece(value, s_: ScheduleSpec, p: int, name: str) -> list[float]:
    """Times per piece from a rank's share (a scalar, or one per rank: each of its ``v`` pieces takes 1/v of it)
    or from one value per piece."""
    pieces = s_.virtual_stages(p)
    if not isinstance(value, (int, float)) and len(value) == pieces and pieces != p:
        return [float(x) for x in value]
    share = per_rank(value, p, name)
    return [share[s_.holder(k, p)[0]] / s_.chunks for k in range(pieces)]
