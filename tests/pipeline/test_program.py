"""Tests of the lowering of schedules to per-rank programs (no processes)."""

from __future__ import annotations

import pytest

from lightning_async.pipeline.program import APPLY_UPDATE, BEGIN_UPDATE, START_REDUCTIONS, lower
from lightning_async.pipeline.schedules import SCHEDULES, spec

LAYOUTS = [(2, 4, 2), (3, 6, 3), (4, 8, 2)]


def _valid_m(s, p, m):
    return m if not s.microbatch_multiple_of_stages else p * max(1, m // p)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_program_runs_the_schedules_actions_with_their_channels(schedule):
    s = spec(schedule)
    for p, m, nb in LAYOUTS:
        m = _valid_m(s, p, m)
        for r in range(p):
            actions = s.run_actions(r, p, m, nb)
            program = lower(s, r, p, actions)
            compute = [x for x in program if x.kind != APPLY_UPDATE]
            assert [x.action for x in compute] == actions
            for k, step in enumerate(program):
                if step.source is not None:  # the neighbour piece's holder decides receive vs hand-over
                    kind, piece = step.source
                    other = piece - 1 if kind == "act" else piece + 1
                    assert step.remote_input == (s.holder(other, p)[0] != r)
                later = [x.source for x in program[k + 1:] if x.remote_input]
                if step.kind not in (APPLY_UPDATE, START_REDUCTIONS):
                    assert step.prepost == (later[0] if later else None)
                nxt = program[k + 1] if k + 1 < len(program) else None
                assert step.next_receive == (nxt.source if nxt is not None and nxt.remote_input else None)
                if step.kind == BEGIN_UPDATE:  # a flush applies at once; 2BW later (poll or the next call), and so
                    # does a rank that holds its reductions back a call (paci's and pipedream's last stage)
                    applied_now = nxt is not None and nxt.kind == APPLY_UPDATE and nxt.batch == step.batch
                    clock = s.clock(p)
                    group = clock.update_groups(r)[step.chunk][1]  # (wpipe: each chunk its own)
                    assert applied_now == (group.applies_at_once and not clock.defers_reductions(r))
                at_once = all(c.applies_at_once for _, c in s.clock(p).update_groups(r))
                assert step.poll == (not at_once and step.kind not in (APPLY_UPDATE, START_REDUCTIONS))


def test_the_first_and_last_steps_of_a_call_start_held_reductions_and_apply_updates():
    s = spec("2bw")
    program = lower(s, 1, 2, s.call_actions(1, 2, 4, 3, fresh=False), start=((2, 0),), apply_first=((1, 0),),
                    apply_last=((3, 0),))
    assert [(x.kind, x.batch, x.barrier) for x in program[:2]] == [(START_REDUCTIONS, 2, False), (APPLY_UPDATE, 1, True)]
    assert (program[-1].kind, program[-1].batch, program[-1].barrier) == (APPLY_UPDATE, 3, True)


@pytest.mark.parametrize("schedule", ["2bw", "2bw-split"])
def test_the_rank_that_begins_last_applies_each_update_before_its_next_backward(schedule):
    """2BW's first stage: its reductions have every other participant in them by its next backward (each began the
    update before its own next backward, which this one's input comes from), so it applies there, not when a poll
    happens to see them done; the other ranks keep polling (their update waits for the first stage's)."""
    s = spec(schedule)
    for p, m, nb in LAYOUTS:
        for r in range(p):
            program = lower(s, r, p, s.run_actions(r, p, m, nb))
            settled = [(k, x.settle) for k, x in enumerate(program) if x.settle is not None]
            begun = [x.batch for x in program if x.kind == BEGIN_UPDATE]
            assert s.clock(p).begins_last(r) == (r == 0)
            assert [x for x in program if x.kind == APPLY_UPDATE] == []  # (no step between a send and its receive)
            if r > 0:
                assert settled == []
                continue
            assert [b for _, (b, _) in settled] == begun[:-1]  # (the last batch's: the next call's, or the drain's)
            for k, (b, group) in settled:
                assert group == 0 and program[k].kind in ("B", "I") and program[k].batch == b + 1
                assert all(x.batch <= b for x in program[:k] if x.kind in ("B", "I", "W"))  # (its first backward)


def test_an_unknown_action_kind_is_refused():
    from lightning_async.pipeline.schedules import Action

    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        lower(spec("1f1b"), 0, 2, [Action("X", 0, 0)])
