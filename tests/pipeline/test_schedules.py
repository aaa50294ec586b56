"""Property tests of the schedules-as-data module (no processes, no torch).

The checker below replays one stage's action list and asserts the invariants a runtime relies on; it is tested
itself against deliberately broken lists, so a weakened checker cannot pass silently.
"""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_async.pipeline.schedules import (
    SCHEDULES,
    Action,
    call_actions,
    drain_actions,
    run_actions,
    spec,
    stream_2bw,
    validate,
    warmup_forwards,
)
from lightning_async.pipeline.program import message_order_mismatches
from lightning_async.pipeline.timing import DeadlockError, time_action_lists


def _configs(seed: int, count: int) -> list[tuple[int, int, int]]:
    """Random (p, m, num_batches): p in 1..8, m in p..3p, batches in 1..5, plus the corners."""
    rng = random.Random(seed)
    out = [(1, 1, 1), (8, 8, 5), (8, 24, 1), (2, 2, 3), (7, 7, 2)]
    for _ in range(count):
        p = rng.randint(1, 8)
        out.append((p, rng.randint(p, 3 * p), rng.randint(1, 5)))
    return out


CONFIGS = _configs(seed=1234, count=100)


def version_used(schedule: str, batch: int, delay: int | None = None) -> int:
    """Updates contained in the weights batch ``batch`` runs on: 2BW ``V(b) = W0 - u(0..b-2)``; sync ``W_b``; a
    group of delay ``delay``: ``max(b - delay, 0)``."""
    if delay is None:
        delay = 1 if spec(schedule).delayed else 0
    return max(batch - delay, 0)


def group_delays(schedule: str, p: int) -> list[int]:
    """The delay of each update group of a rank, as the action order must allow it: WPipe's chunks their own (1, 0);
    any other delayed schedule 1 (its order is 2BW's: PipeDream and PACI differ in what a version holds, not in
    when updates run), a flushing one 0."""
    s = spec(schedule)
    if s.update_per_chunk:
        return [c.delay for _, c in s.clock(p).update_groups(0)]
    return [1 if s.delayed else 0]


def check_stage(schedule: str, actions: list[Action], p: int, m: int, batches: list[int]) -> None:
    """Assert every invariant of one rank's list that covers exactly ``batches`` (pipeline empty at the end), per
    update group (the rank's chunks together, or each chunk on its own under per-chunk updates)."""
    s = spec(schedule)
    delays = group_delays(schedule, p)
    group = (lambda c: c) if s.update_per_chunk else (lambda c: 0)
    chunks_of = [[c for c in range(s.chunks) if group(c) == k] for k in range(len(delays))]
    kinds = ("F", "I", "W", "U") if s.split_backward else ("F", "B", "U")
    done_kind = "W" if s.split_backward else "B"  # the action that finishes a micro-batch's backward
    forwards: dict[tuple[int, int], int] = {}  # (chunk, micro-batch) -> position
    backwards: dict[tuple[int, int], int] = {}
    inputs_done: set[tuple[int, int]] = set()
    updates: list[dict[int, int]] = [{} for _ in delays]  # per group: batch -> position
    in_flight: list[dict[int, set]] = [{} for _ in delays]  # per group: batch -> (chunk, micro-batch) not finished
    done = [batches[0]] * len(delays)  # updates applied so far (U(0..b-1) before a segment starting at b)
    for pos, a in enumerate(actions):
        assert a.kind in kinds, a
        key = (a.chunk, a.microbatch)
        k = group(a.chunk)
        d = delays[k]
        if a.kind != "U":
            assert 0 <= a.chunk < s.chunks, f"{a!r} on a chunk the rank does not have"
            assert a.batch == a.microbatch // m, f"{a!r} labelled with batch {a.batch}"
            assert a.batch in batches, f"{a!r} belongs to no batch of this run"
            # The weights this micro-batch needs must be live: the newest (``done`` updates) or one of the ``d``
            # before it (2BW: one). Sync: exactly the newest.
            need = version_used(schedule, a.batch, d)
            assert done[k] - d <= need <= done[k], f"{a!r} needs version {need}, its group has applied {done[k]} updates"
        if a.kind == "F":
            assert key not in forwards, f"{a!r} twice"
            forwards[key] = pos
            in_flight[k].setdefault(a.batch, set()).add(key)
            assert len(in_flight[k]) <= d + 1, f"batches {sorted(in_flight[k])} in flight at {a!r}"
            live = {done[k]} | {version_used(schedule, b, d) for b in in_flight[k]}
            assert len(live) <= d + 1, f"weight versions {sorted(live)} live at {a!r}"
        elif a.kind == "I":
            assert key in forwards and key not in inputs_done, f"{a!r} before its forward, or twice"
            inputs_done.add(key)
        elif a.kind == done_kind:
            assert key not in backwards, f"{a!r} twice"
            assert key in forwards, f"{a!r} before its forward"
            assert a.kind != "W" or key in inputs_done, f"{a!r} before its input gradient"
            backwards[key] = pos
            in_flight[k][a.batch].discard(key)
            if not in_flight[k][a.batch]:
                del in_flight[k][a.batch]
        else:
            b = a.batch
            assert b not in updates[k], f"two updates of batch {b}"
            assert a.microbatch == (b + 1) * m - 1
            assert b == done[k], f"U(b{b}) out of order (expected U(b{done[k]}))"
            mbs = [(c, j) for c in chunks_of[k] for j in range(b * m, (b + 1) * m)]
            assert all(x in backwards for x in mbs), f"U(b{b}) before all backwards of batch {b}"
            # Staleness of the gradient this update applies: the group's delay (less for the first batches).
            delay = done[k] - version_used(schedule, b, d)
            assert delay == min(b, d), f"U(b{b}) applies a gradient {delay} old"
            updates[k][b] = pos
            done[k] += 1
    expected = sorted((c, j) for c in range(s.chunks) for b in batches for j in range(b * m, (b + 1) * m))
    assert sorted(forwards) == expected, "not every micro-batch forwarded exactly once on every chunk"
    assert sorted(backwards) == expected, "not every micro-batch backwarded exactly once on every chunk"
    assert all(sorted(u) == batches for u in updates), "not exactly one update per batch and group"
    assert not any(in_flight)
    for k, d in enumerate(delays):
        for b in batches:
            # U(b) precedes the group's first forward of batch b + d + 1: the slot it overwrites is free.
            ahead = d + 1
            later = [forwards[c, j] for c in chunks_of[k] for j in range((b + ahead) * m, (b + ahead + 1) * m)
                     if (c, j) in forwards]
            assert all(updates[k][b] < f for f in later), f"a forward of batch {b + ahead} runs before U(b{b})"


def valid_m(schedule: str, p: int, m: int) -> int:
    """``m`` made acceptable to ``schedule`` (the interleaved schedule needs a multiple of the stages)."""
    return -(-m // p) * p if spec(schedule).microbatch_multiple_of_stages else m


def simulate_ok(lists: list[list[Action]], schedule: str = "1f1b") -> None:
    trace = time_action_lists(lists, forward=1.0, backward=2.0, comm=0.5, schedule=schedule)
    assert [len(t) for t in trace] == [len(a) for a in lists]


# ------------------------------------------------------------------------------------------------- properties


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_run_actions_invariants(schedule):
    s = spec(schedule)
    per_microbatch = 3 if s.split_backward else 2
    for p, m, nb in CONFIGS:
        m = valid_m(schedule, p, m)
        lists = [run_actions(schedule, r, p, m, nb) for r in range(p)]
        for actions in lists:
            check_stage(schedule, actions, p, m, list(range(nb)))
            assert len(actions) == nb * (per_microbatch * m * s.chunks + len(group_delays(schedule, p)))
        simulate_ok(lists, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_messages_pair_up_in_order(schedule):
    """What one rank sends another, the other receives in the same order (NCCL matches messages in order)."""
    for p, m, nb in CONFIGS[:40]:
        m = valid_m(schedule, p, m)
        lists = [run_actions(schedule, r, p, m, nb) for r in range(p)]
        assert message_order_mismatches(schedule, lists) == []


def test_gpipe_allows_fewer_microbatches_than_stages():
    for p, m, nb in [(4, 1, 2), (8, 3, 3), (5, 2, 1)]:
        lists = [run_actions("gpipe", s, p, m, nb) for s in range(p)]
        for actions in lists:
            check_stage("gpipe", actions, p, m, list(range(nb)))
        simulate_ok(lists)


def test_2bw_calls_concatenate_to_the_stream():
    for p, m, nb in CONFIGS:
        for s in range(p):
            calls = [call_actions("2bw", s, p, m, b, fresh=b == 0) for b in range(nb)]
            flat = [a for c in calls for a in c]
            assert flat == list(itertools.islice(stream_2bw(s, p, m), len(flat)))
            for b, call in enumerate(calls):
                # A call runs exactly the forwards of its own batch: the next batch is not handed over yet.
                assert sorted(a.microbatch for a in call if a.kind == "F") == list(range(b * m, (b + 1) * m))
                # Everything left in flight after the call is drained by drain_actions.
                drained = drain_actions("2bw", s, p, m, b)
                pending = {a.microbatch for a in flat[: sum(map(len, calls[: b + 1]))] if a.kind == "F"} - {
                    a.microbatch for a in flat[: sum(map(len, calls[: b + 1]))] if a.kind == "B"
                }
                assert {a.microbatch for a in drained if a.kind == "B"} == pending
                assert len(pending) == warmup_forwards(s, p)


def test_2bw_stream_from_a_later_batch():
    p, m = 4, 6
    for s in range(p):
        shifted = list(itertools.islice(stream_2bw(s, p, m, first_batch=3), 200))
        assert shifted[0] == Action("F", 3 * m, 3)
        calls = [call_actions("2bw", s, p, m, b, fresh=b == 3) for b in range(3, 8)]
        flat = [a for c in calls for a in c]
        assert flat == shifted[: len(flat)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_drain_and_fresh_restart(schedule):
    rng = random.Random(99)
    for p, m, nb in CONFIGS:
        m = valid_m(schedule, p, m)
        if nb < 2:
            nb = 2
        cut = rng.randint(1, nb - 1)  # drain after batch cut-1, restart fresh at batch cut
        lists = []
        for s in range(p):
            actions: list[Action] = []
            for b in range(nb):
                actions += call_actions(schedule, s, p, m, b, fresh=b in (0, cut))
                if b in (cut - 1, nb - 1):
                    actions += drain_actions(schedule, s, p, m, b)
            # Each segment between drains is a complete run on its own, and so is the whole list.
            check_stage(schedule, [a for a in actions if a.batch < cut], p, m, list(range(cut)))
            check_stage(schedule, [a for a in actions if a.batch >= cut], p, m, list(range(cut, nb)))
            check_stage(schedule, actions, p, m, list(range(nb)))
            lists.append(actions)
        simulate_ok(lists, schedule)


def test_drain_empties_the_pipeline_at_every_stage():
    p, m = 5, 7
    for s in range(p):
        actions = call_actions("2bw", s, p, m, 0) + drain_actions("2bw", s, p, m, 0)
        assert actions == run_actions("2bw", s, p, m, 1)
        fwd = {a.microbatch for a in actions if a.kind == "F"}
        bwd = {a.microbatch for a in actions if a.kind == "B"}
        assert fwd == bwd == set(range(m))
        assert actions[-1] == Action("U", m - 1, 0)
    for schedule in ("gpipe", "1f1b"):
        assert drain_actions(schedule, 0, p, m, 3) == []


def test_1f1b_and_2bw_warmup_depth():
    p, m = 6, 9
    for s in range(p):
        w = warmup_forwards(s, p)
        for schedule in ("1f1b", "2bw"):
            actions = run_actions(schedule, s, p, m, 2)
            first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
            assert [a.kind for a in actions[:first_b]] == ["F"] * (w + 1)
        gp = run_actions("gpipe", s, p, m, 1)
        assert [a.kind for a in gp] == ["F"] * m + ["B"] * m + ["U"]


def test_2bw_has_no_flush_between_batches():
    """On every stage but the last, a forward of batch b+1 runs before U(b): the batches overlap."""
    p, m = 4, 4
    for s in range(p - 1):
        actions = run_actions("2bw", s, p, m, 3)
        u0 = actions.index(Action("U", m - 1, 0))
        assert any(a.kind == "F" and a.batch == 1 for a in actions[:u0])
        sync = run_actions("1f1b", s, p, m, 3)
        u0 = sync.index(Action("U", m - 1, 0))
        assert not any(a.kind == "F" and a.batch == 1 for a in sync[:u0])


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_fewer_microbatches_than_stages_raises_with_fix(schedule):
    with pytest.raises(ValueError) as err:
        call_actions(schedule, 0, 4, 3, 0)
    msg = str(err.value)
    assert "n_microbatches" in msg and ">= 4" in msg and "fewer stages" in msg
    with pytest.raises(ValueError, match="n_microbatches"):
        run_actions(schedule, 1, 8, 7, 2)
    with pytest.raises(ValueError, match="n_microbatches"):
        validate(schedule, 2, 1)


def test_validate_rejects_bad_settings():
    with pytest.raises(ValueError, match="Unknown pipeline schedule"):
        validate("zb1p", 2, 2)
    with pytest.raises(ValueError, match="num_stages"):
        validate("gpipe", 0, 2)
    with pytest.raises(ValueError, match="n_microbatches"):
        validate("gpipe", 2, 0)


# -------------------------------------------------------------------------------------- the checker can fail


def _move(actions: list[Action], item: Action, new_index: int) -> list[Action]:
    out = [a for a in actions if a != item]
    out.insert(new_index, item)
    return out


def test_checker_rejects_broken_lists():
    p, m, nb = 3, 3, 3
    good = run_actions("2bw", 0, p, m, nb)
    check_stage("2bw", good, p, m, list(range(nb)))
    u0 = Action("U", m - 1, 0)
    # Update delayed past a forward of batch 2: three versions would be needed.
    first_f2 = next(i for i, a in enumerate(good) if a.kind == "F" and a.batch == 2)
    with pytest.raises(AssertionError):
        check_stage("2bw", _move(good, u0, first_f2 + 1), p, m, list(range(nb)))
    # Update before the last backward of its batch.
    with pytest.raises(AssertionError):
        check_stage("2bw", _move(good, u0, good.index(Action("B", m - 1, 0)) - 1), p, m, list(range(nb)))
    # A backward before its forward.
    with pytest.raises(AssertionError):
        check_stage("2bw", _move(good, Action("B", 0, 0), 0), p, m, list(range(nb)))
    # A missing micro-batch.
    with pytest.raises(AssertionError):
        check_stage("2bw", [a for a in good if a != Action("F", 4, 1) and a != Action("B", 4, 1)], p, m, [0, 1, 2])
    # The 2BW list judged by the sync rules: its forwards overlap batches.
    with pytest.raises(AssertionError):
        check_stage("1f1b", good, p, m, list(range(nb)))
    # A sync list whose next batch starts before the update.
    sync = run_actions("1f1b", 0, p, m, nb)
    with pytest.raises(AssertionError):
        check_stage("1f1b", _move(sync, u0, len(sync) - 1), p, m, list(range(nb)))


def test_simulator_detects_deadlock():
    # Stage 0 insists on B0 before F1, stage 1 (last) on F1 before B0: each waits for the other.
    lists = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
        [Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)],
    ]
    with pytest.raises(DeadlockError, match="stage 0 waits at B0"):
        time_action_lists(lists, 1.0, 2.0)
    # A backward on the last stage with no forward anywhere in its list also never runs.
    with pytest.raises(DeadlockError):
        time_action_lists([[Action("B", 0, 0)]], 1.0, 1.0)
