"""The update clock: when each piece's update lands and which weight version each action reads, as data.

Every asynchronous schedule is a set of delays: piece ``k``'s update of batch ``b`` is computed from weights that
miss its last ``d_k`` updates. Everything that depends on the delay (how many weight versions a stage keeps,
which of them a micro-batch's forward and backward read, which one an update overwrites, when an update must have
landed, which batch's loss and gradient norm a step can report) is answered here, from the delays alone, and
nowhere else: the lowering (:mod:`~lightning_async.pipeline.program`), the runtime and its weight versions, the
strategy's reporting, the memory and timing models and the one-device :class:`~lightning_async.optim.delay.DelayedOptimizer`
all ask a clock.

With delay ``d`` a piece keeps ``d + 1`` versions in a ring of slots: slot ``b % (d + 1)`` holds ``V(b)``, the
weights batch ``b`` reads (forward and backward alike), which contain the updates of batches ``0 .. b - d - 1``
(``V(0) = ... = V(d) = W0``). The update of batch ``b`` is computed from ``V(b)``'s gradient, lands on the newest
weights and is written into the slot ``V(b)`` held (free once its gradient exists): that is ``V(b + d + 1)``, so
it must be applied before the call of batch ``b + d + 1`` starts. ``d = 0`` is a flushing schedule: one version,
the update applied in place as soon as the batch's backwards are done. This is exactly
``x(t + 1) = x(t) - u(g(x(t - d)))``, the rule the pipeline is tested against. One piece's clock is
:class:`~lightning_async.optim.clock.PieceClock` (the update rule's, framework-free); this module maps a schedule's
pieces and ranks onto them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lightning_async.optim.clock import PieceClock


@dataclass(frozen=True)
class UpdateClock:
    """A schedule's clock on ``num_stages`` ranks: one :class:`PieceClock` per piece, the loss lag, and the call in
    which each rank begins a batch's update.

    Build it with :meth:`of` (or ``ScheduleSpec.clock(num_stages)``).
    """

    schedule: object  # the ScheduleSpec (not typed here: schedules.py imports this module)
    num_stages: int
    pieces: tuple[PieceClock, ...]

    @classmethod
    def of(cls, schedule, num_stages: int) -> "UpdateClock":
        delays = schedule.piece_delays(num_stages)
        return cls(schedule, num_stages, tuple(PieceClock(d) for d in delays))

    def piece(self, piece: int) -> PieceClock:
        return self.pieces[piece]

    def update_groups(self, stage: int) -> tuple[tuple[tuple[int, ...], PieceClock], ...]:
        """The chunks of rank ``stage`` that update together, each group with its clock: one group of every chunk
        (:meth:`rank`), or one per chunk where the schedule updates chunks on their own (``wpipe``). A ``U`` action's
        ``chunk`` is its group's index."""
        if self.schedule.update_per_chunk:
            return tuple(((c,), self.chunk(stage, c)) for c in range(self.schedule.chunks))
        return ((tuple(range(self.schedule.chunks)), self.rank(stage)),)

    def chunk(self, stage: int, chunk: int) -> PieceClock:
        """The clock of chunk ``chunk`` of rank ``stage`` (its piece's)."""
        return self.pieces[self.schedule.piece(stage, chunk, self.num_stages)]

    def rank(self, stage: int) -> PieceClock:
        """The clock of rank ``stage`` whose chunks form one parameter list updated at once, so they share a delay
        (:meth:`update_groups` for a schedule whose chunks update on their own)."""
        chunks = range(self.schedule.chunks)
        delays = {self.pieces[self.schedule.piece(stage, c, self.num_stages)].delay for c in chunks}
        if len(delays) != 1:
            raise ValueError(
                f"schedule {self.schedule.name!r} gives the pieces of rank {stage} different delays {sorted(delays)}; "
                "a rank updates its pieces together, so they need one delay."
            )
        return PieceClock(delays.pop())

    @property
    def max_delay(self) -> int:
        return max(c.delay for c in self.pieces)

    @property
    def delayed(self) -> bool:
        """Some piece's updates are stale (staleness corrections apply)."""
        return self.max_delay > 0

    @property
    def loss_lag(self) -> int:
        """How many steps back a training step's reported loss is: the largest delay (at least one step for an
        asynchronous schedule: its last stage finishes a batch while the first runs the next).

        A piece of delay ``d`` runs the last backwards of batch ``b`` at the latest in call ``b + d`` (its update
        lands before call ``b + d + 1``), and a batch's loss exists before its first backward, so by the end of call
        ``b + d`` every rank can have it without waiting. Under 2BW the last stage finishes batch ``b`` while the
        first stage already runs ``b + 1``: step ``b`` reports batch ``b - 1``'s loss (waiting for batch ``b``
        would re-create the bubble); under ``pipedream`` with one micro-batch per batch, batch ``b - p + 1``'s."""
        return max(self.max_delay, 1 if self.schedule.delayed else 0)

    def stale_forwards(self, stage: int) -> int:
        """How many of a batch's first forwards on rank ``stage`` read the version before the previous batch's update
        (a schedule without a stash only, ``paci``: they run before that update lands in the same call, and their
        backwards recompute at the new weights); 0 where every forward of a batch reads one version."""
        return 0 if self.schedule.stash else self._stale_forwards[stage]

    def forward_reads(self, stage: int, batch: int, index: int, chunk: int = 0) -> int:
        """Updates contained in the weights the forward of the ``index``-th micro-batch of ``batch`` reads on chunk
        ``chunk`` of rank ``stage`` (its backward reads ``chunk(stage, chunk).updates_read(batch)``)."""
        read = self.chunk(stage, chunk).updates_read(batch)
        return read - 1 if index < self.stale_forwards(stage) and read > 0 else read

    @cached_property
    def _stale_forwards(self) -> tuple[int, ...]:
        m, batch, out = self._steady_microbatches, self.max_delay + 2, []
        for stage in range(self.num_stages):
            actions = self.schedule.call_actions(stage, self.num_stages, m, batch, fresh=False)
            update = next((k for k, a in enumerate(actions) if a.kind == "U" and a.batch == batch - 1), 0)
            out.append(sum(1 for a in actions[:update] if a.kind == "F" and a.batch == batch))
        return tuple(out)

    @property
    def _steady_microbatches(self) -> int:
        """A micro-batch count every schedule takes (a multiple of the stages, at least its minimum)."""
        m = self.schedule.min_microbatches_per_stage * self.num_stages or self.num_stages
        return -(-m // self.num_stages) * self.num_stages

    def reported_loss(self, step: int) -> int | None:
        """The batch whose loss the training step of batch ``step`` reports without waiting (``None``: none yet)."""
        batch = step - self.loss_lag
        return batch if batch >= 0 else None

    @cached_property
    def _begin_offsets(self) -> tuple[int, ...]:
        """Per rank: how many calls after its own the update of a batch begins (2BW: 0 on the last stage, whose
        backwards of batch ``b`` end inside call ``b``, 1 on the others)."""
        m, batch = self._steady_microbatches, self.max_delay + 2  # a steady-state batch
        offsets = []
        for stage in range(self.num_stages):
            for call in range(batch, batch + self.max_delay + 2):
                actions = self.schedule.call_actions(stage, self.num_stages, m, call, fresh=call == 0)
                if any(a.kind == "U" and a.batch == batch for a in actions):
                    offsets.append(call - batch)
                    break
            else:
                raise AssertionError(f"schedule {self.schedule.name!r}: rank {stage} never updates batch {batch}")
        return tuple(offsets)

    def begin_offset(self, stage: int) -> int:
        """How many calls after its own the update of a batch begins on rank ``stage`` (2BW: 0 on the last stage,
        1 on the others)."""
        return self._begin_offsets[stage]

    def defers_reductions(self, stage: int) -> bool:
        """Rank ``stage`` begins a batch's update in an earlier call than another rank that joins the update's
        cross-stage reductions (norm, tied weights): it holds them back until its next call (or a drain), so that an
        NCCL reduction never waits on this device across a step boundary (see the runtime)."""
        if not self.schedule.uniform_delay:
            return False  # (its stages update a batch in different calls: no cross-stage reduction is allowed)
        return self._begin_offsets[stage] < max(self._begin_offsets)

    def begins_last(self, stage: int) -> bool:
        """Rank ``stage`` is the one that begins a batch's update last (2BW: the first stage, whose chain of
        backwards ends after everyone's), so the cross-stage reductions it joins have every other participant in them
        by its next backward: it applies the update there, before that backward's gradients take the second buffer
        (the runtime's program, :func:`~lightning_async.pipeline.program.lower`)."""
        if not (self.schedule.uniform_delay and self.schedule.delayed and self.schedule.stash):
            return False
        offsets = self._begin_offsets
        return stage == max(range(self.num_stages), key=lambda r: (offsets[r], -r))
