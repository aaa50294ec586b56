"""Schedules as text (``lightning_async/pipeline/schedule_text.py``): torch's notation, the grid, golden files.

Golden files: ``tests/pipeline/golden/<schedule>-p<P>.txt`` is what ``python -m
lightning_async.pipeline.schedule_text <schedule> P 2P`` prints (one batch; two and the drain for a delayed
schedule), for every schedule and ``P = 2, 3, 4`` (``pipedream``: one micro-batch per batch, its natural setting,
and ``P + 1`` batches, so that its warm-up over several calls shows). A change to a schedule's
order shows up here as a diff of its grid. After an intended change, regenerate them and read the diff::

    LIGHTNING_ASYNC_REGEN_GOLDEN=1 python -m pytest -q tests/pipeline/test_schedule_text.py -k golden
    git diff tests/pipeline/golden

(the regenerating run writes the files and reports those tests as skipped, so it cannot pass by itself).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from lightning_async.pipeline.program import lower, messages
from lightning_async.pipeline.schedule_text import (
    action_text,
    grid_at,
    lists_grid,
    message_action,
    message_grid,
    rank_text,
    schedule_grid,
    schedule_lists,
    schedule_main,
)
from lightning_async.pipeline.schedules import SCHEDULES, Action, spec

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("LIGHTNING_ASYNC_REGEN_GOLDEN") == "1"
RANKS = (2, 3, 4)


def golden_path(schedule: str, p: int) -> Path:
    return GOLDEN / f"{schedule}-p{p}.txt"


def golden_grid(schedule: str, p: int) -> str:
    if schedule == "pipedream":
        return schedule_grid(schedule, p, 1, p + 1)
    return schedule_grid(schedule, p, 2 * p)


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_golden_grids(schedule, p):
    """Each schedule's grid at m = 2p equals its golden file (regenerate: module docstring)."""
    text = golden_grid(schedule, p) + "\n"
    path = golden_path(schedule, p)
    if REGENERATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
        pytest.skip(f"regenerated {path.name}")
    assert path.exists(), f"{path} is missing: regenerate the golden files (module docstring)"
    expected = path.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now"))
    assert text == expected, f"{schedule} p={p} prints another grid than its golden file:\n{diff}"


def test_golden_files_are_exactly_the_schedules():
    """No golden file of a removed or renamed schedule lingers, and none is missing."""
    expected = {golden_path(s, p).name for s in SCHEDULES for p in RANKS}
    assert {f.name for f in GOLDEN.glob("*.txt")} == expected


def test_golden_file_reads_as_expected():
    """One golden file spelled out: 1F1B's warm-up, steady state and cool-down, and the update row."""
    assert golden_path("1f1b", 2).read_text() == (
        "schedule 1f1b: p = 2 ranks, m = 4 micro-batches, 1 batch\n"
        "step  rank 0   rank 1\n"
        "   0  0F0      1F0\n"
        "   1  0F1      1B0\n"
        "   2  0B0      1F1\n"
        "   3  0F2      1B1\n"
        "   4  0B1      1F2\n"
        "   5  0F3      1B2\n"
        "   6  0B2      1F3\n"
        "   7  0B3      1B3\n"
        "   8  Ub0      Ub0\n"
    )


# ---- the notation is torch's ----------------------------------------------------------------------
def _all_actions():
    for schedule in SCHEDULES:
        for p in RANKS:
            for rank, actions in enumerate(schedule_lists(schedule, p, 2 * p)):
                for a in actions:
                    yield schedule, p, rank, a


def test_torch_parses_our_actions_as_the_same_piece_kind_and_microbatch():
    """torch's own parser reads every compute action we print as its piece, kind and micro-batch, and prints it
    back the same; an update, which torch has no action for, is refused rather than misread."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    seen = set()
    for schedule, p, rank, a in _all_actions():
        text = action_text(schedule, rank, p, a)
        if a.kind == "U":  # (wpipe's chunks update on their own: the update names its piece)
            own = spec(schedule).update_per_chunk
            assert text == (f"U{spec(schedule).piece(rank, a.chunk, p)}b{a.batch}" if own else f"Ub{a.batch}")
            with pytest.raises(RuntimeError):
                schedules._Action.from_str(text)
            continue
        parsed = schedules._Action.from_str(text)
        expected = (spec(schedule).piece(rank, a.chunk, p), a.kind, a.microbatch)
        assert (parsed.stage_index, parsed.computation_type.value, parsed.microbatch_index) == expected, text
        assert repr(parsed) == text
        built = schedules._Action(expected[0], schedules._ComputationType(a.kind), a.microbatch)
        assert repr(built) == text
        seen.add(a.kind)
    assert seen == {"F", "B", "I", "W"}


def _torch_rank_lines(cls, p: int, m: int) -> list[str]:
    """torch's own per-rank order of a multi-stage schedule, printed by torch (its ``_Action`` repr), computed
    without stages or processes: the fields its ``_calculate_single_rank_operations`` reads, set by hand."""
    order = object.__new__(cls)
    order.pp_group_size, order.n_local_stages, order._n_microbatches, order.num_stages = p, 2, m, 2 * p
    order.number_of_rounds = max(1, m // p)
    order.microbatches_per_round = m // order.number_of_rounds
    try:
        rows = [order._calculate_single_rank_operations(rank) for rank in range(p)]
    except (AttributeError, TypeError) as error:  # torch's private fields moved: say so rather than pass
        pytest.skip(f"torch's {cls.__name__} needs other fields to compute its order: {error!r}")
    return [" ".join(str(a) for a in row if a is not None) for row in rows]


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("schedule,torch_class", [("interleaved", "ScheduleInterleaved1F1B"),
                                                   ("zbv", "ScheduleZBVZeroBubble")])
def test_our_multi_piece_schedules_print_as_torchs_own(schedule, torch_class, p):
    """Where torch has the same schedule, its printed order and ours are the same text (m = 2p, 3p; our
    interleaved differs at m = p, where it runs every forward first as Megatron does)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for m in (2 * p, 3 * p):
        ours = [rank_text(schedule, r, p, actions[:-1]) for r, actions in enumerate(schedule_lists(schedule, p, m))]
        assert ours == _torch_rank_lines(getattr(schedules, torch_class), p, m)


# ---- the grid ------------------------------------------------------------------------------------
def _columns(grid: str) -> list[list[str]]:
    """The grid read back by column positions (a rank's column may end before the others)."""
    lines = grid.splitlines()
    header = lines[1]
    starts = [header.index(f"rank {r}") for r in range(header.count("rank "))]
    ends = [*starts[1:], None]
    columns = [[] for _ in starts]
    for row in lines[2:]:
        for r, (lo, hi) in enumerate(zip(starts, ends)):
            cell = row[lo:hi].strip()
            if cell:
                columns[r].append(cell)
    return columns


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grid_columns_are_the_ranks_lists(schedule):
    """Column r of the grid, top to bottom, is rank r's list; rows are numbered by action index."""
    for p in RANKS:
        m = 2 * p
        grid = schedule_grid(schedule, p, m)
        lists = schedule_lists(schedule, p, m)
        assert [" ".join(c) for c in _columns(grid)] == [rank_text(schedule, r, p, a) for r, a in enumerate(lists)]
        numbers = [line.split()[0] for line in grid.splitlines()[2:]]
        assert numbers == [str(k) for k in range(max(map(len, lists)))]


def test_lists_grid_renders_any_lists_as_schedule_grid_does():
    lists = schedule_lists("interleaved", 2, 4)
    assert lists_grid("interleaved", lists).splitlines()[1:] == schedule_grid("interleaved", 2, 4).splitlines()[1:]
    assert lists_grid("1f1b", [lists[0][:1], []], title="two ranks") == "two ranks\nstep  rank 0   rank 1\n   0  0F0"


def test_rank_text_and_pieces_of_the_v_placement():
    """ZB-V's chunk 1 of rank 0 is the last piece (2p - 1), written as that piece, not as the rank."""
    assert action_text("zbv", 0, 4, Action("F", 2, 0, chunk=1)) == "7F2"
    assert action_text("interleaved", 1, 4, Action("B", 5, 1, chunk=1)) == "5B5"
    assert action_text("2bw", 2, 3, Action("U", 11, 1)) == "Ub1"
    actions = [Action("F", 0, 0), Action("I", 0, 0), Action("W", 0, 0), Action("U", 0, 0)]
    assert rank_text("2bw-split", 2, 3, actions) == "2F0 2I0 2W0 Ub0"


def test_grid_at_marks_the_action_and_shows_the_rows_around_it():
    lists = schedule_lists("1f1b", 3, 6)
    text = grid_at("1f1b", lists, 1, 6, context=2)
    assert text == (
        "schedule 1f1b, p = 3 ranks, at rank 1's action 6, 1B2:\n"
        "step  rank 0   rank 1   rank 2\n"
        " ...\n"
        "   4  0F3      1B1      2F2\n"
        "   5  0B1      1F3      2B2\n"
        "   6  0F4     >1B2<     2F3   <-- rank 1, action 6\n"
        "   7  0B2      1F4      2B3\n"
        "   8  0F5      1B3      2F4\n"
        " ...\n"
    ).rstrip("\n")
    top = grid_at("1f1b", lists, 0, 0, context=1).splitlines()
    assert top[2].startswith("   0 >0F0<") and top[4] == " ..." and len(top) == 5
    with pytest.raises(ValueError, match="no action 99 on rank 1"):
        grid_at("1f1b", lists, 1, 99)


def test_grid_at_with_two_far_marks_elides_between_them():
    lists = schedule_lists("gpipe", 2, 8)
    lines = grid_at("gpipe", lists, 0, 1, context=1, also=[(1, 14)]).splitlines()
    shown = [line.split()[0] for line in lines[2:]]
    assert shown == ["0", "1", "2", "...", "13", "14", "15", "..."]
    assert lines[3].endswith("<-- rank 0, action 1") and lines[7].endswith("<-- rank 1, action 14")


def _traffic(schedule, lists):
    s_, p = spec(schedule), len(lists)
    return [messages(s_, lower(s_, r, p, lists[r]), r, p) for r in range(p)]


def test_message_grid_points_at_a_swapped_send():
    """Rank 0 of 1F1B sends micro-batch 1 before 0; rank 1 receives 0 first: the grid marks both actions."""
    lists = schedule_lists("1f1b", 2, 4)
    lists[0][0], lists[0][1] = lists[0][1], lists[0][0]
    traffic = _traffic("1f1b", lists)
    sent = [(kind, mb, piece) for peer, kind, mb, piece in traffic[0][0] if peer == 1]
    received = [(kind, mb, piece) for peer, kind, mb, piece in traffic[1][1] if peer == 0]
    assert sent[:2] == [("act", 1, 1), ("act", 0, 1)] and received[0] == ("act", 0, 1)
    text = message_grid("1f1b", lists, 0, 1, sent, received)
    assert "   0 >0F1<    >1F0<   <-- rank 0, action 0, rank 1, action 0" in text.splitlines()
    assert message_grid("1f1b", lists, 0, 1, received, received) == ""


@pytest.mark.parametrize("p", RANKS)
def test_message_grid_on_zbv_marks_the_sender_and_the_receiver_of_the_first_mismatch(p):
    """ZB-V's messages do not pair up in posting order (why NCCL refuses it): the marked actions are the ones
    that send and receive the first message out of order."""
    lists = schedule_lists("zbv", p, 2 * p)
    traffic = _traffic("zbv", lists)
    found = 0
    for a in range(p):
        for b in range(p):
            sent = [(k, mb, piece) for peer, k, mb, piece in traffic[a][0] if peer == b]
            received = [(k, mb, piece) for peer, k, mb, piece in traffic[b][1] if peer == a]
            if a == b or sent == received:
                continue
            found += 1
            first = next(i for i, (x, y) in enumerate(zip(sent, received)) if x != y)
            i_send = message_action("zbv", lists, a, sent[first], sent=True)
            i_recv = message_action("zbv", lists, b, received[first], sent=False)
            kind, mb, piece = sent[first]
            source_piece = piece - 1 if kind == "act" else piece + 1
            assert action_text("zbv", a, p, lists[a][i_send]) == f"{source_piece}{'F' if kind == 'act' else 'I'}{mb}"
            assert action_text("zbv", b, p, lists[b][i_recv])[-len(str(received[first][1])):] == str(received[first][1])
            text = message_grid("zbv", lists, a, b, sent, received)
            assert f">{action_text('zbv', a, p, lists[a][i_send])}<" in text
            assert f"rank {a}, action {i_send}" in text and f"rank {b}, action {i_recv}" in text
    assert found


# ---- the command ---------------------------------------------------------------------------------
def test_command_prints_the_golden_grid(capsys):
    assert schedule_main(["2bw", "3", "6"]) == 0
    assert capsys.readouterr().out == golden_path("2bw", 3).read_text()
    assert schedule_main(["zbv", "2", "4"]) == 0
    assert capsys.readouterr().out == golden_path("zbv", 2).read_text()


def test_command_lines_and_bad_input(capsys):
    assert schedule_main(["zbh1", "2", "2", "--lines"]) == 0
    assert capsys.readouterr().out == "rank 0: 0F0 0F1 0I0 0W0 0I1 0W1 Ub0\nrank 1: 1F0 1I0 1F1 1I1 1W0 1W1 Ub0\n"
    assert schedule_main(["interleaved", "2", "3"]) == 2
    assert "error: schedule 'interleaved' needs n_microbatches to be a multiple" in capsys.readouterr().err
    assert schedule_main(["interleaved", "2", "6", "--virtual-stages", "3"]) == 0
    assert "3 pieces per rank (loop placement)" in capsys.readouterr().out
    assert schedule_main(["1f1b", "0", "4"]) == 2
    assert schedule_main(["zbv", "2", "4", "--at", "1", "40"]) == 2
    assert "error: no action 40 on rank 1" in capsys.readouterr().err


def test_command_at_prints_grid_at(capsys):
    assert schedule_main(["2bw", "3", "6", "--at", "2", "12", "--context", "1"]) == 0
    lists = schedule_lists("2bw", 3, 6)
    assert capsys.readouterr().out == grid_at("2bw", lists, 2, 12, context=1) + "\n"
    assert lists[2][12] == Action("U", 5, 0)
