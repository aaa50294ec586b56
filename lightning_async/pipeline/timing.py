"""The timing model of the pipeline schedules (pure Python, no torch).

The timing model executes each rank's action list (:meth:`~lightning_async.pipeline.schedules.ScheduleSpec.run_actions`)
under the runtime's dependency rules, on the model's pieces (virtual stages; one per rank except for the
interleaved and V schedules):

* a rank runs its own list strictly in order, one action at a time;
* ``F(j)`` of piece ``k > 0`` needs ``F(j)`` of piece ``k - 1`` finished, plus one hop of communication when the
  two pieces live on different ranks;
* ``B(j)`` / ``I(j)`` of piece ``k`` below the last needs ``B(j)`` / ``I(j)`` of piece ``k + 1`` (plus a hop); on
  the last piece it needs its own ``F(j)``;
* ``W(j)`` (the weight gradient of a split backward) needs nothing but the actions before it on its rank;
* ``U`` likewise, and takes ``update_s`` (default 0).

Every action starts as soon as its rank is free and its dependency has arrived. Because the order on each rank
is fixed, the start times are the longest paths through this dependency graph; :func:`time_action_lists` computes
them with a work list that wakes a rank when the action it waits for finishes (an event-driven run in dependency
order rather than in time order, with identical results). A rank whose next action can never become ready is
reported as a deadlock.

Model assumptions: communication is a fixed latency per hop that overlaps with compute (sends are asynchronous,
links have no contention and no bandwidth limit); compute times do not depend on the micro-batch or on what the
neighbours do; a split backward takes as long as the whole one (``I + W = B``); the first piece's inputs and the
last piece's targets are always available.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_async.pipeline.memory import inflight_and_versions
from lightning_async.pipeline.program import APPLY_UPDATE, Step, lower
from lightning_async.pipeline.schedules import (
    BACKWARD, FORWARD, GRADIENT_ACTIONS, INPUT_GRAD, UPDATE, Action, ScheduleSpec, spec,
)
from lightning_async.pipeline.shares import per_hop, per_piece, per_rank

__all__ = [
    "DeadlockError",
    "ScheduleTiming",
    "predict",
    "time_action_lists",
    "time_schedule",
]


class DeadlockError(RuntimeError):
    """The action lists cannot complete under the dependency rules."""


@dataclass
class ScheduleTiming:
    """Outcome of one simulation. Times are in the unit of the inputs (seconds in :func:`predict`)."""

    schedule: str
    num_stages: int
    n_microbatches: int
    num_batches: int
    total_time: float
    #: per stage: list of (action, start, end)
    trace: list[list[tuple[Action, float, float]]]
    #: batch -> time at which the last stage to apply ``U(batch)`` finished it
    batch_end: list[float]
    steady_window: tuple[float, float, int]  # (start, end, number of batches inside)
    per_batch_time: float
    ideal_per_batch_time: float
    throughput_rel: float
    bubble: float
    bubble_per_stage: list[float]
    bubble_total: float
    bubble_total_per_stage: list[float]
    peak_inflight: list[int]
    weight_versions: list[int]
    busy_per_batch: list[float] = field(default_factory=list)
    chunks: int = 1  # pieces per rank

    def summary(self) -> dict:
        """JSON-friendly digest (no trace)."""
        return {
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "n_microbatches": self.n_microbatches,
            "num_batches": self.num_batches,
            "total_time": self.total_time,
            "per_batch_time": self.per_batch_time,
            "ideal_per_batch_time": self.ideal_per_batch_time,
            "throughput_rel": self.throughput_rel,
            "bubble": self.bubble,
            "bubble_per_stage": self.bubble_per_stage,
            "bubble_total": self.bubble_total,
            "bubble_total_per_stage": self.bubble_total_per_stage,
            "peak_inflight": self.peak_inflight,
            "weight_versions": self.weight_versions,
            "steady_window": list(self.steady_window),
        }


def _durations(kind: str, tf: float, tb: float, tw: float) -> float:
    if kind == FORWARD:
        return tf
    if kind == BACKWARD:
        return tb
    if kind == INPUT_GRAD:
        return tb - tw
    return tw  # WEIGHT_GRAD


def time_action_lists(
    actions: Sequence[Sequence[Action]],
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    comm: float | Sequence[float] = 0.0,
    update: float | Sequence[float] = 0.0,
    weight: float | Sequence[float] | None = None,
    schedule: "str | ScheduleSpec" = "1f1b",
    overhead: float | Sequence[float] = 0.0,
) -> list[list[tuple[Action, float, float]]]:
    """Run arbitrary per-rank action lists; return the trace ``[(action, start, end), ...]`` per rank.

    ``forward``/``backward``/``weight`` (the ``W`` part of a split backward, default half of it) are per *piece*
    (virtual stage: a scalar, or one value per piece in model order), ``comm`` per boundary between consecutive
    pieces (a scalar or one per boundary; boundaries inside a rank cost nothing), ``update`` per rank.
    ``schedule`` says which rank and chunk hold each piece. ``overhead`` (per rank, or a scalar) is added to every
    ``F``/``B``/``I``/``W``: a runtime's own cost per action (bookkeeping, launching sends). Raises
    :class:`DeadlockError` naming each stuck rank's next action when the lists cannot complete.
    """
    s_ = spec(schedule)
    p = len(actions)
    pieces = s_.virtual_stages(p)
    tf, tb = per_rank(forward, pieces, "forward"), per_rank(backward, pieces, "backward")
    tw = [b / 2 for b in tb] if weight is None else per_rank(weight, pieces, "weight")
    tu, hop = per_rank(update, p, "update"), per_hop(comm, pieces)
    extra = per_rank(overhead, p, "overhead")
    recomputed = _recomputed_backwards(s_, actions)
    holder = [s_.holder(k, p) for k in range(pieces)]
    done: list[dict[tuple[str, int, int], float]] = [{} for _ in range(p)]
    ptr, free = [0] * p, [0.0] * p
    trace: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    pending, queued = deque(range(p)), [True] * p

    def wake(rank: int) -> None:
        if not queued[rank]:
            queued[rank] = True
            pending.append(rank)

    def arrival(step: Step) -> float | None:
        """When the input of ``step`` (lowered: it names its channel and whether it crosses ranks) is there."""
        kind, piece = step.source
        other, kinds = (piece - 1, (FORWARD,)) if kind == "act" else (piece + 1, GRADIENT_ACTIONS)
        r, c = holder[other]
        finished = next((done[r][k, step.microbatch, c] for k in kinds if (k, step.microbatch, c) in done[r]), None)
        if finished is None:
            return None
        return finished + (hop[min(piece, other)] if step.remote_input else 0.0)

    # the programs the runtime runs, less the steps that take no time of their own (applying an update)
    todos = [[(step.action, step) for step in lower(s_, r, p, actions[r]) if step.kind != APPLY_UPDATE] for r in range(p)]
    while pending:
        r = pending.popleft()
        queued[r] = False
        todo = todos[r]
        while ptr[r] < len(todo):
            a, step = todo[ptr[r]]
            ready = 0.0
            if a.kind == UPDATE:
                duration = tu[r]
            else:
                piece = step.piece
                duration = _durations(a.kind, tf[piece], tb[piece], tw[piece]) + extra[r]
                if a.kind in GRADIENT_ACTIONS and recomputed(r, a):
                    duration += tf[piece]  # (paci: the backward of a stale forward recomputes the chunk first)
                if step.source is not None:
                    ready = arrival(step)
                elif a.kind in GRADIENT_ACTIONS:
                    ready = done[r].get((FORWARD, a.microbatch, a.chunk))
                if ready is None:
                    break  # woken again when the dependency finishes
            start = max(free[r], ready)
            end = start + duration
            key = (a.kind, a.microbatch if a.kind != UPDATE else a.batch, a.chunk)
            if key in done[r]:
                raise ValueError(f"rank {r} runs {a!r} twice")
            done[r][key] = end
            free[r] = end
            trace[r].append((a, start, end))
            ptr[r] += 1
            if a.kind == FORWARD and piece < pieces - 1:
                wake(holder[piece + 1][0])
            elif a.kind in GRADIENT_ACTIONS and piece > 0:
                wake(holder[piece - 1][0])
    stuck = [f"stage {r} waits at {actions[r][ptr[r]]!r} (#{ptr[r]})" for r in range(p) if ptr[r] < len(actions[r])]
    if stuck:
        raise DeadlockError("pipeline deadlock: " + "; ".join(stuck))
    return trace


def _recomputed_backwards(s_: ScheduleSpec, actions: Sequence[Sequence[Action]]):
    """``(rank, action) -> bool``: whether the runtime recomputes the chunk before this backward (``paci``: the first
    forwards of a batch, which the clock's ``stale_forwards`` counts, run without a graph)."""
    clock = s_.clock(len(actions))
    stale = [clock.stale_forwards(r) for r in range(len(actions))]
    if not any(stale):
        return lambda r, a: False
    per_batch: dict[int, int] = {}
    for a in actions[-1]:  # (the last rank runs every forward of a batch)
        if a.kind == FORWARD:
            per_batch[a.batch] = per_batch.get(a.batch, 0) + 1
    m = max(per_batch.values())
    return lambda r, a: a.microbatch % m < stale[r]


def _busy_in(intervals: list[tuple[Action, float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for _, s, e in intervals)


def time_schedule(
    schedule: "str | ScheduleSpec",
    num_stages: int,
    n_microbatches: int,
    num_batches: int = 5,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    comm: float | Sequence[float] = 0.0,
    update: float | Sequence[float] = 0.0,
    warmup_batches: int | None = None,
    weight: float | Sequence[float] | None = None,
) -> ScheduleTiming:
    """Simulate ``num_batches`` training calls plus the final drain of ``schedule``.

    ``forward``/``backward``/``weight`` (the weight-gradient part of the backward, default half of it): a rank's
    share of the model per micro-batch, a scalar or one value per rank (a schedule with ``v`` chunks per rank runs
    each chunk in ``1/v`` of it), or one value per piece. ``update``: per batch and rank. ``comm``: latency per hop
    between ranks, a scalar or one value per boundary between consecutive pieces.

    The steady state is measured between the end of batch ``warmup_batches`` (default 1, or 0 with fewer than
    4 batches) and the end of batch ``num_batches - 2`` (the last batch ends inside the drain, which is faster);
    the end of a batch is when the last rank to apply its update finishes it.
    """
    s_ = spec(schedule)
    s_.validate(num_stages, n_microbatches)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}.")
    p, m = num_stages, n_microbatches
    lists = [s_.run_actions(r, p, m, num_batches) for r in range(p)]
    tf, tb = per_piece(forward, s_, p, "forward"), per_piece(backward, s_, p, "backward")
    tw = None if weight is None else per_piece(weight, s_, p, "weight")
    trace = time_action_lists(lists, tf, tb, comm, update, tw, s_)
    tu = per_rank(update, p, "update")

    total = max((t[-1][2] for t in trace if t), default=0.0)
    batch_end = [0.0] * num_batches
    for t in trace:
        for a, _, e in t:
            if a.kind == UPDATE:
                batch_end[a.batch] = max(batch_end[a.batch], e)

    # Steady window.
    if warmup_batches is None:
        warmup_batches = 1 if num_batches >= 4 else 0
    last = num_batches - 2 if num_batches >= 3 else num_batches - 1
    if last > warmup_batches:
        lo, hi, n = batch_end[warmup_batches], batch_end[last], last - warmup_batches
    else:  # too few batches for a window: whole run
        lo, hi, n = 0.0, total, num_batches
    per_batch = (hi - lo) / n

    share = [sum(tf[k] + tb[k] for k in range(s_.virtual_stages(p)) if s_.holder(k, p)[0] == r) for r in range(p)]
    busy_per_batch = [m * share[r] + tu[r] for r in range(p)]
    ideal = max(busy_per_batch)
    width = hi - lo
    steady_busy = [_busy_in(trace[r], lo, hi) for r in range(p)]
    bubble_stage = [1.0 - b / width if width > 0 else 0.0 for b in steady_busy]
    bubble = 1.0 - sum(steady_busy) / (p * width) if width > 0 else 0.0
    all_busy = [sum(e - s0 for _, s0, e in t) for t in trace]
    bubble_total_stage = [1.0 - b / total if total > 0 else 0.0 for b in all_busy]
    bubble_total = 1.0 - sum(all_busy) / (p * total) if total > 0 else 0.0
    peak_inflight, versions = inflight_and_versions(s_, [[a for a, _, _ in t] for t in trace])

    return ScheduleTiming(
        schedule=s_.name,
        num_stages=p,
        n_microbatches=m,
        num_batches=num_batches,
        total_time=total,
        trace=trace,
        batch_end=batch_end,
        steady_window=(lo, hi, n),
        per_batch_time=per_batch,
        ideal_per_batch_time=ideal,
        throughput_rel=ideal / per_batch if per_batch > 0 else 1.0,
        bubble=bubble,
        bubble_per_stage=bubble_stage,
        bubble_total=bubble_total,
        bubble_total_per_stage=bubble_total_stage,
        peak_inflight=peak_inflight,
        weight_versions=versions,
        busy_per_batch=busy_per_batch,
        chunks=s_.chunks,
    )


def predict(
    schedule: "str | ScheduleSpec",
    p: int,
    m: int,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    comm_s: float | Sequence[float] = 0.0,
    num_batches: int = 6,
    update_s: float | Sequence[float] = 0.0,
    weight_s: float | Sequence[float] | None = None,
) -> dict:
    """Predicted timing of ``num_batches`` training batches, for putting next to a measured run.

    Returns a dict with ``per_batch_s`` (steady state), ``total_s`` (all batches plus the final drain, from an
    empty pipeline), ``bubble`` (steady, all stages), ``bubble_total`` (whole run), ``bubble_per_stage``,
    ``throughput_rel`` (bubble-free limit / per-batch time), ``ideal_per_batch_s``, ``microbatches_per_s``,
    ``peak_inflight`` and ``weight_versions`` per stage, and ``batch_end_s`` (when each batch's last update
    finished).
    """
    r = time_schedule(schedule, p, m, num_batches, forward_s, backward_s, comm_s, update_s, weight=weight_s)
    return {
        "schedule": r.schedule,
        "p": p,
        "m": m,
        "num_batches": num_batches,
        "per_batch_s": r.per_batch_time,
        "total_s": r.total_time,
        "ideal_per_batch_s": r.ideal_per_batch_time,
        "throughput_rel": r.throughput_rel,
        "microbatches_per_s": m / r.per_batch_time if r.per_batch_time > 0 else float("inf"),
        "bubble": r.bubble,
        "bubble_total": r.bubble_total,
        "bubble_per_stage": r.bubble_per_stage,
        "peak_inflight": r.peak_inflight,
        "weight_versions": r.weight_versions,
        "batch_end_s": r.batch_end,
    }
