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


def replay(schedule, p: int, eager: bool, m: int) -> dict:
    """Replay every rank's programs; return what each rank read and applied, per call."""
    s = spec(schedule)
    clock = s.clock(p)
    out = {"applied_after_call": [[0] * BATCHES for _ in range(p)], "losses_by_call": [set() for _ in range(BATCHES)]}
    for r in range(p):
        rc = clock.rank(r)
        slots = [0] * rc.versions  # updates each slot's version contains
        applied, pending, held = 0, [], set()

        def land(b: int) -> None:
            nonlocal applied
            assert b == applied, f"{schedule} p={p} rank {r}: update {b} applied out of order (next is {applied})"
            slots[rc.write_slot(b)] = b + 1
            applied = b + 1
            pending.remove(b)

        calls = [s.call_actions(r, p, m, b, fresh=b == 0) for b in range(BATCHES)]
        for c in range(BATCHES + 1):
            if c < BATCHES:
                due = rc.due_before(c)
                program = lower(s, r, p, calls[c], start=tuple(sorted(held)), apply_first=() if due is None else (due,))
            else:  # the drain (as the runtime's: every update pending or begun in it applied at its end)
                drain = s.drain_actions(r, p, m, BATCHES - 1)
                begun = {a.batch for a in drain if a.kind == UPDATE}
                program = lower(s, r, p, drain, start=tuple(sorted(held)), apply_last=tuple(sorted({*pending, BATCHES - 1, *begun})))
            for step in program:
                if step.poll and eager:
                    while pending and pending[0] not in held:
                        land(pending[0])
                if step.kind == START_REDUCTIONS:
                    held.discard(step.batch)
                elif step.kind == BEGIN_UPDATE:
                    pending.append(step.batch)
                    if clock.defers_reductions(r):
                        held.add(step.batch)
                elif step.kind == APPLY_UPDATE:
                    if step.batch in pending:
                        held.discard(step.batch)
                        land(step.batch)
                elif step.kind in COMPUTE:
                    got, want = slots[rc.read_slot(step.batch)], rc.updates_read(step.batch)
                    if step.kind == "F":  # (paci: a batch's first forwards may read the version before)
                        want = clock.forward_reads(r, step.batch, step.microbatch - step.batch * m)
                    assert got == want, (f"{schedule} p={p} rank {r} call {c}: {step.kind}{step.microbatch} of batch "
                                         f"{step.batch} read a version with {got} updates, the clock says {want}")
                    if step.kind == "F" and step.target is None and c < BATCHES:
                        out["losses_by_call"][c].add((step.batch, step.microbatch))
            if c < BATCHES:
                out["applied_after_call"][r][c] = applied
        assert not pending and applied == BATCHES  # the drain applied every update
    out["m"] = m
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_clock_answers_as_the_update_rule(schedule, p):
    s = spec(schedule)
    clock = s.clock(p)
    for r in range(p):  # (pipedream: each stage its own delay)
        rule = oracle_versions(clock.rank(r).delay, BATCHES)
        assert [clock.rank(r).updates_read(b) for b in range(BATCHES)] == rule
    for eager, m in [(eager, m) for eager in (False, True) for m in _microbatches(s, p)]:
        seen = replay(schedule, p, eager, m)
        for calls_done in range(1, BATCHES + 1):  # the settled gradient norm's update has landed on every rank
            settled = clock.rank(0).settled_update(calls_done)
            assert all(seen["applied_after_call"][r][calls_done - 1] >= settled + 1 for r in range(p))
        finished: set = set()
        for step in range(BATCHES):  # the reported loss's batch has every micro-batch's loss on the last stage
            finished |= seen["losses_by_call"][step]
            batch = clock.reported_loss(step)
            if batch is not None:
                assert {(batch, batch * seen["m"] + i) for i in range(seen["m"])} <= finished


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_reductions_are_held_back_where_a_rank_updates_a_call_early(schedule):
    """A rank defers its cross-stage reductions exactly when another rank begins the same update a call later."""
    s = spec(schedule)
    for p in (2, 3, 4):
        m = _microbatches(s, p)[0]
        begins = [next(c for c in range(4) if any(a.kind == UPDATE and a.batch == 2
                                                  for a in s.call_actions(r, p, m, c, fresh=c == 0)))
                  for r in range(p)]
        assert [s.clock(p).defers_reductions(r) for r in range(p)] == [b < max(begins) for b in begins]
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
