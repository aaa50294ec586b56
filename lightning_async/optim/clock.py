"""The clock of a k-step delay: which weight version a batch reads, which one its update writes, when it lands.

With delay ``d`` the weights keep ``d + 1`` versions in a ring of slots: slot ``b % (d + 1)`` holds ``V(b)``, the
weights batch ``b`` reads (forward and backward alike), which contain the updates of batches ``0 .. b - d - 1``
(``V(0) = ... = V(d) = W0``). The update of batch ``b`` is computed from ``V(b)``'s gradient, lands on the newest
weights and is written into the slot ``V(b)`` held (free once its gradient exists): that is ``V(b + d + 1)``, so it
must be applied before batch ``b + d + 1`` starts. ``d = 0`` is plain training: one version, updated in place.
This is ``x(t + 1) = x(t) - u(g(x(t - d)))``. The one-device :class:`~lightning_async.optim.delay.DelayedOptimizer`
and the pipeline (through :class:`~lightning_async.pipeline.clock.UpdateClock`, one of these per piece) both ask it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PieceClock:
    """The clock of one piece (or of a rank whose pieces share a delay): ``delay`` steps of staleness."""

    delay: int

    def __post_init__(self) -> None:
        if not isinstance(self.delay, int) or isinstance(self.delay, bool) or self.delay < 0:
            raise ValueError(f"a piece's delay must be a non-negative integer number of steps, got {self.delay!r}.")

    @property
    def versions(self) -> int:
        """Weight versions the piece keeps (the newest and the ``delay`` older ones still read)."""
        return self.delay + 1

    @property
    def applies_at_once(self) -> bool:
        """An update is applied as soon as it begins (no version still reads the weights it replaces)."""
        return self.delay == 0

    def updates_read(self, batch: int) -> int:
        """How many updates the version batch ``batch`` reads contains (the same in its forward and backward)."""
        return max(batch - self.delay, 0)

    def read_slot(self, batch: int) -> int:
        """The slot holding ``V(batch)``, the version batch ``batch``'s forward and backward read."""
        return batch % self.versions

    def write_slot(self, update: int) -> int:
        """The slot the update of batch ``update`` writes (the one ``V(update)`` held; it then holds
        ``V(update + delay + 1)``), which is also the newest slot once that update has landed."""
        return self.read_slot(update)

    def first_reader(self, update: int) -> int:
        """The first batch whose weights contain the update of batch ``update``."""
        return update + self.delay + 1

    def due_before(self, call: int) -> int | None:
        """The update that must have landed before the call of batch ``call`` starts (``None``: none yet)."""
        due = call - self.delay - 1
        return due if due >= 0 else None

    def settled_update(self, calls_done: int) -> int:
        """The newest update applied on every rank after ``calls_done`` training calls, whatever the timing (an
        update lands as soon as its reductions finish, so the newest applied one varies; this one has landed)."""
        return calls_done - 1 - self.versions
