"""Every schedule's messages match in posting order (NCCL's rule, no tags) once the lowering orders the sends
(``program.order_sends``): the two ends of each rank pair post that pair's messages in the same order, and the ranks'
programs, run against each other with the transport's blocking, all finish. No processes: the lowered programs only.
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_async.pipeline import program
from lightning_async.pipeline.program import (
    HOLD, CallPrograms, lower, lower_all, message_order_mismatches, messages, order_sends, stuck,
)
from lightning_async.pipeline.run_checks import check_message_order
from lightning_async.pipeline.schedules import SPECS, spec

SCHEDULES = ("gpipe", "1f1b", "zbh1", "interleaved", "zbv", "2bw", "2bw-split", "pipedream", "paci", "wpipe")
MICROBATCHES = (1, 2, 3, 4, 6, 8, 12)


def _settings(refused: bool = False):
    """Every valid ``(schedule, p, m)``; ``refused``: only those NCCL cannot match (WPipe on 2 stages), else the rest."""
    for name in SCHEDULES:
        for p in (2, 3, 4):
            for m in MICROBATCHES:
                try:
                    spec(name).validate(p, m)
                except ValueError:
                    continue
                if (name == "wpipe" and p == 2) == refused:
                    yield name, p, m


def _lists(name: str, p: int, m: int, batches: int | None = None):
    s = spec(name)
    nb = batches or (3 if s.delayed else 2)
    return [s.run_actions(r, p, m, nb) for r in range(p)]


@pytest.mark.parametrize("name, p, m", list(_settings()))
def test_every_schedule_matches_in_posting_order_after_the_pass(name, p, m):
    """The table: every schedule at 2, 3 and 4 stages and every valid micro-batch count of ``MICROBATCHES`` (two
    calls, three for the delayed schedules, then a drain): all of a pair's messages in one order at both ends, every
    rank finishes, and the check that runs before launch accepts it under NCCL's rules and on NCCL."""
    lists = _lists(name, p, m)
    assert message_order_mismatches(name, lists, per_channel=False) == []
    assert stuck(name, lower_all(name, lists)) is None
    check_message_order(spec(name), p, m, "nccl-rules")
    check_message_order(spec(name), p, m, backend="nccl", device_type="cuda")


@pytest.mark.parametrize("name, p, m", list(_settings(refused=True)))
def test_wpipe_on_two_stages_is_refused_on_nccl_before_any_group(name, p, m):
    """One rank pair carries both chunks' activations and gradients; the stream computes a gradient before an
    activation its neighbour consumes first, across calls (what per-call send ordering cannot hold). Missing: a
    cross-call send order; gloo's tags match it (the oracle runs it)."""
    assert message_order_mismatches(name, _lists(name, p, m), per_channel=False) != []
    with pytest.raises(ValueError, match="'wpipe' on 2 stages"):
        check_message_order(spec(name), p, m, "nccl-rules")
    with pytest.raises(ValueError, match="or run it on CPUs"):
        check_message_order(spec(name), p, m, backend="nccl", device_type="cuda")


@pytest.mark.parametrize("p, m", [(2, 3), (2, 4), (2, 8), (3, 4), (3, 8), (4, 5), (4, 8), (4, 12)])
def test_without_the_pass_zbv_disagrees_and_the_pass_holds_sends_back(p, m):
    """The negative control: ZB-V's sends in compute order disagree with the receivers' order wherever the pass has
    to hold one back, and agree after it."""
    lists = _lists("zbv", p, m, 1)
    assert message_order_mismatches("zbv", lists, per_channel=False, reorder=False) != []
    assert message_order_mismatches("zbv", lists, per_channel=False) == []
    holds = [s for prog in lower_all("zbv", lists) for s in prog if s.send_order and s.send_order[0] == HOLD]
    assert holds


@pytest.mark.parametrize("p, m", [(2, 1), (2, 2), (3, 3), (4, 4)])
def test_zbv_with_as_many_microbatches_as_stages_needs_no_hold(p, m):
    lists = _lists("zbv", p, m, 1)
    assert message_order_mismatches("zbv", lists, per_channel=False, reorder=False) == []
    assert all(s.send_order is None for prog in lower_all("zbv", lists) for s in prog)


@pytest.mark.parametrize("name, p, m", [(n, p, m) for n, p, m in _settings() if n in ("zbv", "interleaved")])
def test_the_pass_moves_sends_only(name, p, m):
    """Compute order, receives and what is sent stay as they are: only ``send_order`` is set, every message is sent
    once, and nothing stays held at the end of a call (the sends of a flushing schedule's call all leave in it)."""
    lists = _lists(name, p, m, 1)
    before, after = lower_all(name, lists, reorder=False), lower_all(name, lists)
    s = spec(name)
    for r in range(p):
        assert [dataclasses.replace(x, send_order=None) for x in after[r]] == list(before[r])
        sent_before, received_before = messages(s, before[r], r, p)
        sent_after, received_after = messages(s, after[r], r, p)
        assert received_after == received_before and sorted(sent_after) == sorted(sent_before)
        held = 0
        for x in after[r]:
            if x.send_order is not None:
                held += 1 if x.send_order[0] == HOLD else -x.send_order[1]
            assert held >= 0
        assert held == 0


@pytest.mark.parametrize("p, m", [(2, 4), (3, 4), (4, 8)])
def test_a_held_send_leaves_as_soon_as_the_receiver_could_use_it(p, m):
    """Each message leaves at the first step by which it and every message its receiver consumes before it have been
    computed: never earlier (the receiver's order), and never later than needed (the bound of ``order_sends``)."""
    s = spec("zbv")
    lists = _lists("zbv", p, m, 1)
    programs = lower_all(s, lists)
    made, left = {}, {}
    for r, prog in enumerate(programs):
        queues: dict[int, list] = {}
        for k, x in enumerate(prog):
            if not x.remote_output:
                continue
            msg = (r, s.holder(x.target[1], p)[0], x.target[0], x.microbatch, x.target[1])
            made[msg] = k
            queue = queues.setdefault(msg[1], [])
            if x.send_order is not None and x.send_order[0] == HOLD:
                queue.insert(x.send_order[1], msg)
                continue
            n = x.send_order[1] if x.send_order is not None else 0
            for each in [msg, *queue[:n]]:
                left[each] = k
            del queue[:n]
    for b, prog in enumerate(programs):
        order = [(s.holder(x.source[1] - 1 if x.source[0] == "act" else x.source[1] + 1, p)[0], b, x.source[0],
                  x.microbatch, x.source[1]) for x in prog if x.remote_input]
        for a in range(p):
            latest = -1
            for msg in [o for o in order if o[0] == a]:
                latest = max(latest, made[msg])
                assert left[msg] == latest


def test_the_runtimes_call_programs_are_the_passs():
    """``CallPrograms`` (the runtime's, one rank's view) lowers ZB-V's call with the peers' calls and orders its sends
    as the pass over every rank does; once per call shape."""
    s, p, m = spec("zbv"), 3, 6
    for rank in range(p):
        calls = CallPrograms(s, rank, p, m)
        for b in range(3):
            actions = s.call_actions(rank, p, m, b)
            got = calls.get(actions, b)
            relative = [dataclasses.replace(a, microbatch=a.microbatch - b * m, batch=a.batch - b) for a in actions]
            peers = [relative if q == rank else s.call_actions(q, p, m, 0) for q in range(p)]
            assert got == lower_all(s, peers)[rank]
        assert calls.lowered == 1


def test_only_multi_chunk_flushing_schedules_are_reordered():
    assert {n for n, s in SPECS.items() if program.reorders(s)} == {"interleaved", "zbv"}
    lists = _lists("1f1b", 2, 4)
    programs = [lower(spec("1f1b"), r, 2, lists[r]) for r in range(2)]
    assert order_sends(spec("1f1b"), 2, programs) == programs


def test_stuck_finds_ranks_that_wait_on_each_other():
    """The progress check: rank 0 of 1F1B running its first backward before its first forward waits for a gradient
    that needs that forward's activation; a message one end never posts is reported by the order check instead."""
    lists = _lists("1f1b", 2, 4, 1)
    first = [a for a in lists[0] if a.kind == "B" and a.microbatch == 0]
    swapped = [first + [a for a in lists[0] if a not in first], lists[1]]
    assert message_order_mismatches("1f1b", swapped, per_channel=False) == []
    assert "no rank can go on" in stuck("1f1b", lower_all("1f1b", swapped))
    dropped = [lists[0], [a for a in lists[1] if not (a.kind == "F" and a.microbatch == 3)]]
    assert message_order_mismatches("1f1b", dropped, per_channel=False)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbh1", "2bw", "2bw-split"])
def test_one_chunk_schedules_finish_even_with_sends_that_wait_for_their_receive(name):
    """A stricter model (``rendezvous``: a send holds its rank until the peer posts the receive, as an NCCL stream holds
    what is queued behind a send beyond NCCL's eager buffers): the fused send/receive pairs suffice for one chunk per
    rank. (Not for two: interleaved and ZB-V post a send whose receiver first waits on this rank; docs/pipeline.md.)"""
    for p in (2, 3, 4):
        for m in (p, 2 * p):
            lists = _lists(name, p, m)
            assert stuck(name, lower_all(name, lists), rendezvous=True) is None
