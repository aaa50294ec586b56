"""The update clock against the update rule: every schedule x p in 2..4, its lowered programs replayed.

Each rank's programs (calls and a drain, lowered as the runtime lowers them) are replayed with weight versions
tracked as "how many updates they contain". Updates land as late as the program allows (only at APPLY_UPDATE) or
as early as it allows (at every poll): either way every forward and backward must read exactly the version the
clock names, and that must be the version the one-device DelayedOptimizer (the oracle's rule) gives the same batch.
"""

from __future__ import annotations

import pytest
import torch

from lightning_async.optim.clock import PieceClock
from lightning_async.optim.delay import DelayedOptimizer
from lightning_async.pipeline.program import APPLY_UPDATE, BEGIN_UPDATE, COMPUTE, START_REDUCTIONS, lower
from lightning_async.pipeline.paci import reads_previous
from lightning_async.pipeline.schedules import SCHEDULES, UPDATE, spec

BATCHES = 5


def _microbatches(s, p: int) -> tuple[int, ...]:
    """``2 p`` (every schedule takes it; interleaved: a multiple of p), and 1 where the schedule takes it (fewer
    micro-batches than stages (pipedream's warm-up then spans several calls)."""
    return (2 * p, 1) if s.min_microbatches_per_stage == 0 and s.stash else (2 * p,)


def oracle_versions(delay: int, batches: int) -> list[int]:
    """Updates contained in the weights each batch's forward reads under DelayedOptimizer(pairing="2bw"): an SGD
    step of 1 on a gradient of 1 takes one from a counter weight per update."""
    w = torch.nn.Parameter(torch.zeros(()))
    opt = DelayedOptimizer(torch.optim.SGD([w], lr=1.0), delay=delay, pairing="2bw")
    seen = []
    for _ in range(batches):
        seen.append(-int(w.detach().item()))  # what this batch's forward reads
        w.grad = torch.ones(())
        opt.step()
    return seen


class _Group:
    """One update group's replayed state: updates each slot's version contains, applied, begun and held back."""

    def __init__(self, clock: PieceClock) -> None:
        self.clock, self.slots, self.applied, self.pending, self.held = clock, [0] * clock.versions, 0, [], set()

    def land(self, b: int, where: str) -> None:
        assert b == self.applied, f"{where}: update {b} applied out of order (next is {self.applied})"
        self.slots[self.clock.write_slot(b)] = b + 1
        self.applied = b + 1
        self.pending.remove(b)


def replay(schedule, p: int, eager: bool, m: int) -> dict:
    """Replay every rank's programs (each update group of a rank on its own); return what each rank read and
    applied, per call (``applied_after_call``: the fewest updates any group of the rank has applied)."""
    s = spec(schedule)
    clock = s.clock(p)
    out = {"applied_after_call": [[0] * BATCHES for _ in range(p)], "losses_by_call": [set() for _ in range(BATCHES)]}
    for r in range(p):
        chunk_groups = clock.update_groups(r)
        groups = [_Group(c) for _, c in chunk_groups]
        group_of = {chunk: k for k, (chunks, _) in enumerate(chunk_groups) for chunk in chunks}
        where = f"{schedule} p={p} rank {r}"
        calls = [s.call_actions(r, p, m, b, fresh=b == 0) for b in range(BATCHES)]
        for c in range(BATCHES + 1):
            held = tuple((b, k) for k, g in enumerate(groups) for b in sorted(g.held))
            if c < BATCHES:
                due = tuple((d, k) for k, g in enumerate(groups) if (d := g.clock.due_before(c)) is not None)
                program = lower(s, r, p, calls[c], start=held, apply_first=due)
            else:  # the drain (as the runtime's: every update pending or begun in it applied at its end)
                drain = s.drain_actions(r, p, m, BATCHES - 1)
                last = tuple((b, k) for k, g in enumerate(groups) for b in sorted(
                    {*g.pending, BATCHES - 1, *(a.batch for a in drain if a.kind == UPDATE and a.chunk == k)}))
                program = lower(s, r, p, drain, start=held, apply_last=last)
            for step in program:
                if step.poll and eager:
                    for g in groups:
                        while g.pending and g.pending[0] not in g.held:
                            g.land(g.pending[0], where)
                if step.kind in COMPUTE:
                    g = groups[group_of[step.chunk]]
                    got, want = g.slots[g.clock.read_slot(step.batch)], g.clock.updates_read(step.batch)
                    if step.kind == "F":  # (paci: a batch's first forwards may read the version before)
                        want = clock.forward_reads(r, step.batch, step.microbatch - step.batch * m, step.chunk)
                    assert got == want, (f"{where} call {c}: {step.kind}{step.microbatch}c{step.chunk} of batch "
                                         f"{step.batch} read a version with {got} updates, the clock says {want}")
                    if step.kind == "F" and step.target is None and c < BATCHES:
                        out["losses_by_call"][c].add((step.batch, step.microbatch))
                    continue
                g = groups[step.chunk]
                if step.kind == START_REDUCTIONS:
                    g.held.discard(step.batch)
                elif step.kind == BEGIN_UPDATE:
                    g.pending.append(step.batch)
                    if clock.defers_reductions(r):
                        g.held.add(step.batch)
                elif step.kind == APPLY_UPDATE:
                    if step.batch in g.pending:
                        g.held.discard(step.batch)
                        g.land(step.batch, where)
            if c < BATCHES:
                out["applied_after_call"][r][c] = min(g.applied for g in groups)
        assert all(not g.pending and g.applied == BATCHES for g in groups)  # the drain applied every update
    out["m"] = m
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_clock_answers_as_the_update_rule(schedule, p):
    s = spec(schedule)
    clock = s.clock(p)
    for r in range(p):  # (pipedream: each stage its own delay; wpipe: each chunk)
        for _, group in clock.update_groups(r):
            rule = oracle_versions(group.delay, BATCHES)
            assert [group.updates_read(b) for b in range(BATCHES)] == rule
    for eager, m in [(eager, m) for eager in (False, True) for m in _microbatches(s, p)]:
        seen = replay(schedule, p, eager, m)
        for calls_done in range(1, BATCHES + 1):  # the settled gradient norm's update has landed on every rank
            settled = min(g.settled_update(calls_done) for _, g in clock.update_groups(0))
            assert all(seen["applied_after_call"][r][calls_done - 1] >= settled + 1 for r in range(p))
        finished: set = set()
        for step in range(BATCHES):  # the reported loss's batch has every micro-batch's loss on the last stage
            finished |= seen["losses_by_call"][step]
            batch = clock.reported_loss(step)
            if batch is not None:
                assert {(batch, batch * seen["m"] + i) for i in range(seen["m"])} <= finished


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_reductions_are_held_back_where_a_rank_updates_a_call_early(schedule):
    """A rank defers its cross-stage reductions exactly when another rank begins the same update a call later (and
    never under per-stage delays, which allow no cross-stage reduction)."""
    s = spec(schedule)
    for p in (2, 3, 4):
        m = _microbatches(s, p)[0]
        begins = [next(c for c in range(4) if any(a.kind == UPDATE and a.batch == 2
                                                  for a in s.call_actions(r, p, m, c, fresh=c == 0)))
                  for r in range(p)]
        expected = [b < max(begins) for b in begins] if s.uniform_delay else [False] * p
        assert [s.clock(p).defers_reductions(r) for r in range(p)] == expected
    assert not spec(schedule).clock(1).defers_reductions(0)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_stale_forwards_are_pacis_rule(p):
    """Which forwards read the previous version under ``paci``: the clock (from the action lists) against the
    one-device rule's ``reads_previous``; every stashing schedule has none."""
    clock = spec("paci").clock(p)
    for stage in range(p):
        assert [clock.forward_reads(stage, 3, j) < 3 for j in range(2 * p)] == [reads_previous(stage, j, p) for j in range(2 * p)]
    assert all(spec(name).clock(p).stale_forwards(r) == 0 for name in SCHEDULES if name != "paci" for r in range(p))


def test_a_removed_delay_fails_the_rule():
    """Negative control: 2BW's programs replayed with a clock of no delay read versions the rule does not give."""
    s = spec("2bw")
    zero = PieceClock(0)
    assert [zero.updates_read(b) for b in range(BATCHES)] != oracle_versions(s.delay, BATCHES)


@pytest.mark.parametrize("delay", [0, 1, 2, 3])
def test_piece_clock_slots_follow_the_ring(delay):
    c = PieceClock(delay)
    assert c.versions == delay + 1 and c.applies_at_once == (delay == 0)
    for b in range(10):
        assert c.write_slot(b) == c.read_slot(c.first_reader(b))  # the update's result is what its first reader reads
        assert c.updates_read(c.first_reader(b)) == b + 1
        due = c.due_before(c.first_reader(b))
        assert due == b
    assert oracle_versions(delay, 8) == [c.updates_read(b) for b in range(8)]


def test_piece_clock_refuses_a_negative_delay():
    with pytest.raises(ValueError, match="non-negative integer"):
        PieceClock(-1)
