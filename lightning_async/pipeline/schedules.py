"""Pipeline schedules as data: each stage's ordered actions, with no processes involved.

An :class:`Action` is ``F`` (forward of one micro-batch), ``B`` (its backward) or ``U`` (the optimizer
update after the last backward of a batch). Micro-batches carry *global* indices
``batch * n_microbatches + i``, so a schedule can span batch boundaries.

* ``gpipe``: per batch, all forwards then all backwards, then the update (flush every batch).
* ``1f1b``: per batch, warmup forwards, one-forward-one-backward, cooldown, update (flush every batch).
* ``2bw``: PipeDream-2BW. One endless 1F1B stream over global micro-batches; stage ``s`` updates right
  after the last backward of batch ``b``, while micro-batches of batch ``b + 1`` are in flight.
  There is no flush between batches; :func:`drain_actions` empties the pipeline when needed
  (before validation, a checkpoint, or the end of fit).

The runtime executes one *call* per training batch. :func:`call_actions` gives the actions of the
call for batch ``b``: for the flushing schedules the whole batch, for ``2bw`` everything in the
stream before the first forward of batch ``b + 1`` (a stage cannot run that forward before the
next batch is handed over).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "2bw")
FORWARD, BACKWARD, UPDATE = "F", "B", "U"


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule means for everything outside the action lists (the one place that says it).

    Attributes:
        name: ``gpipe``, ``1f1b`` or ``2bw``.
        delayed: updates apply gradients one step stale (no flush between batches): staleness corrections apply.
        weight_versions: weight versions a stage keeps (2BW: two, ``slot[b % 2]`` holds ``V(b)``).
        flushes: the pipeline is empty at every batch boundary.
        loss_lag: a training step can report the loss of the batch this many steps back without waiting
            (2BW: the last stage finishes batch ``b`` while the first stage already runs ``b + 1``).
        one_forward_one_backward: forwards and backwards interleave (1F1B order), which needs at least as many
            micro-batches per batch as stages.
    """

    name: str
    delayed: bool
    weight_versions: int
    flushes: bool
    loss_lag: int
    one_forward_one_backward: bool

    def require_delay(self, what: str) -> None:
        """Refuse ``what`` (a correction, EF) on a schedule without a delay, naming the fix."""
        if not self.delayed:
            raise ValueError(
                f"{what} corrects the one-step delay of schedule '2bw', but schedule {self.name!r} is synchronous "
                "(no delay). Use strategy='async_pipe' (schedule='2bw') or remove the correction."
            )


SPECS = {
    "gpipe": ScheduleSpec("gpipe", delayed=False, weight_versions=1, flushes=True, loss_lag=0, one_forward_one_backward=False),
    "1f1b": ScheduleSpec("1f1b", delayed=False, weight_versions=1, flushes=True, loss_lag=0, one_forward_one_backward=True),
    "2bw": ScheduleSpec("2bw", delayed=True, weight_versions=2, flushes=False, loss_lag=1, one_forward_one_backward=True),
}


def spec(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``schedule`` (a clear error for an unknown name)."""
    if schedule not in SPECS:
        raise ValueError(
            f"Unknown pipeline schedule {schedule!r}. Choose one of: {', '.join(SCHEDULES)} "
            "(or strategy='async_pipe', 'sync_pipe', 'gpipe_pipe')."
        )
    return SPECS[schedule]


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "U"
    microbatch: int  # global micro-batch index; for "U" the last micro-batch of the batch
    batch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" if self.kind != UPDATE else f"U(b{self.batch})"


def validate(schedule: str, num_stages: int, n_microbatches: int) -> None:
    """Raise ``ValueError`` (with the fix) for settings no schedule can run."""
    kind = spec(schedule)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}.")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}.")
    if kind.one_forward_one_backward and n_microbatches < num_stages:
        raise ValueError(
            f"schedule {schedule!r} needs at least as many micro-batches per batch as pipeline stages "
            f"(n_microbatches={n_microbatches} < {num_stages} stages). Raise n_microbatches to >= {num_stages} "
            f"or use fewer stages."
        )


def warmup_forwards(stage: int, num_stages: int) -> int:
    """Forwards a stage runs before its first backward in 1F1B order."""
    return num_stages - stage - 1


def _flushed_batch(schedule: str, stage: int, p: int, m: int, batch: int) -> list[Action]:
    first = batch * m
    fwd = [Action(FORWARD, first + i, batch) for i in range(m)]
    bwd = [Action(BACKWARD, first + i, batch) for i in range(m)]
    if schedule == "gpipe":
        actions = fwd + bwd
    else:
        w = min(warmup_forwards(stage, p), m)
        actions = fwd[:w]
        for i in range(m - w):
            actions += [fwd[w + i], bwd[i]]
        actions += bwd[m - w :]
    return actions + [Action(UPDATE, first + m - 1, batch)]


def stream_2bw(stage: int, num_stages: int, n_microbatches: int, first_batch: int = 0) -> Iterator[Action]:
    """The endless 2BW action stream of ``stage``, starting with an empty pipeline at ``first_batch``."""
    m, w = n_microbatches, warmup_forwards(stage, num_stages)
    start = first_batch * m
    for i in range(w):
        yield Action(FORWARD, start + i, (start + i) // m)
    j = start
    while True:
        yield Action(FORWARD, j + w, (j + w) // m)
        yield Action(BACKWARD, j, j // m)
        if (j + 1) % m == 0:
            yield Action(UPDATE, j, j // m)
        j += 1


def _pairs(stage: int, num_stages: int, m: int, start: int, stop: int) -> list[Action]:
    """Steady 1F1B pairs ``F(j + w), B(j)`` for ``j`` in ``[start, stop)``, with updates after batch ends."""
    w = warmup_forwards(stage, num_stages)
    out = []
    for j in range(start, stop):
        out += [Action(FORWARD, j + w, (j + w) // m), Action(BACKWARD, j, j // m)]
        if (j + 1) % m == 0:
            out.append(Action(UPDATE, j, j // m))
    return out


def call_actions(
    schedule: str, stage: int, num_stages: int, n_microbatches: int, batch: int, fresh: bool = True
) -> list[Action]:
    """Actions of the training call for ``batch``.

    ``fresh`` (``2bw`` only): the pipeline is empty before this call (first batch, or after a drain).
    The result equals the slice of :func:`stream_2bw` between the first forwards of ``batch`` and
    ``batch + 1``.
    """
    validate(schedule, num_stages, n_microbatches)
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}.")
    if schedule == "2bw" and batch == 0 and not fresh:
        raise ValueError("batch 0 always starts with an empty pipeline: use fresh=True.")
    if schedule != "2bw":
        return _flushed_batch(schedule, stage, num_stages, n_microbatches, batch)
    m, w = n_microbatches, warmup_forwards(stage, num_stages)
    begin, end = batch * m, (batch + 1) * m
    if fresh:
        warmup = [Action(FORWARD, begin + i, batch) for i in range(w)]
        return warmup + _pairs(stage, num_stages, m, begin, end - w)
    return _pairs(stage, num_stages, m, begin - w, end - w)


def drain_actions(schedule: str, stage: int, num_stages: int, n_microbatches: int, batch: int) -> list[Action]:
    """Actions that empty the pipeline after the call for ``batch`` (empty for flushing schedules)."""
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch} (nothing to drain before the first batch).")
    if schedule != "2bw":
        return []
    m, w = n_microbatches, warmup_forwards(stage, num_stages)
    end = (batch + 1) * m
    if w == 0:
        return []  # the last stage finishes each batch inside its call
    return [Action(BACKWARD, j, batch) for j in range(end - w, end)] + [Action(UPDATE, end - 1, batch)]


def run_actions(schedule: str, stage: int, num_stages: int, n_microbatches: int, num_batches: int) -> list[Action]:
    """All actions of ``num_batches`` training calls followed by a drain (for tests and the simulator)."""
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}.")
    actions: list[Action] = []
    for b in range(num_batches):
        actions += call_actions(schedule, stage, num_stages, n_microbatches, b, fresh=b == 0)
    return actions + drain_actions(schedule, stage, num_stages, n_microbatches, num_batches - 1)
