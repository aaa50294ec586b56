"""Schedules as text: each rank's actions in torch.distributed.pipelining's notation, and as a grid.

**Notation** (torch's ``_Action``: ``{stage}{type}{micro-batch}``): an action is written as the model piece it runs
(the *virtual stage*, ``spec.piece(rank, chunk, p)``, not the rank), its kind and its micro-batch: ``1F0`` is the
forward of micro-batch 0 on piece 1, ``0B3`` the whole backward of micro-batch 3 on piece 0, ``2I1``/``2W1`` the
input and the weight gradient of a split backward. torch's own parser (``_Action.from_str``) reads every compute
action written here as the same piece, kind and micro-batch (``tests/pipeline/test_schedule_text.py``).

Two things torch's notation has no word for:

* micro-batch numbers are *global*, ``b * m + i`` as the schedules carry them, so a 2BW stream that crosses a
  batch boundary stays unambiguous (``0F5`` at ``m = 4`` is micro-batch 1 of batch 1); within batch 0 they are
  torch's numbers;
* the optimizer update of a rank (all its pieces at once) is ``Ub{batch}``: ``Ub0`` is the update after batch 0's
  last backward. It starts with a letter, so torch's parser refuses it rather than misreading it. Where each chunk
  updates on its own (``wpipe``), the update names its piece: ``U2b0``.

**The grid** has one row per action index and one column per rank (what a rank runs at its ``k``-th action, not
at a time: the timing model, :mod:`~lightning_async.pipeline.timeline`, draws that). :func:`grid_at` shows the rows
around one action with the action marked ``>...<``, for errors about a schedule; :func:`message_grid` does it for a
message that two ranks post in different orders. ``python -m lightning_async.pipeline.schedule_text SCHEDULE P M``
prints a schedule's grid (``tests/pipeline/golden/`` holds one per schedule for ``p = 2, 3, 4``). It is not a
``lightning-async`` subcommand: one more name does not fit the top-level help's 80-column usage line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_async.exit_codes import EXIT_BAD_INPUT
from lightning_async.pipeline.schedules import (
    FORWARD, GRADIENT_ACTIONS, SCHEDULES, UPDATE, Action, ScheduleSpec, spec,
)

MARK_LEFT, MARK_RIGHT = ">", "<"
ELIDED = "..."


def action_text(schedule: "str | ScheduleSpec", rank: int, p: int, action: Action) -> str:
    """``action`` of ``rank`` (of ``p`` ranks) in torch's notation: ``1F0``, ``3W5``; an update is ``Ub{batch}``."""
    if action.kind == UPDATE:
        s_ = spec(schedule)
        return f"U{s_.piece(rank, action.chunk, p)}b{action.batch}" if s_.update_per_chunk else f"Ub{action.batch}"
    return f"{spec(schedule).piece(rank, action.chunk, p)}{action.kind}{action.microbatch}"


def rank_text(schedule: "str | ScheduleSpec", rank: int, p: int, actions: Sequence[Action]) -> str:
    """A rank's actions as one line, in order, separated by spaces: ``0F0 0F1 1B0 ... Ub0``."""
    return " ".join(action_text(schedule, rank, p, a) for a in actions)


def default_batches(schedule: "str | ScheduleSpec") -> int:
    """Batches a printed schedule shows: 2 for a delayed one (its boundary and its drain are the point), else 1."""
    return 2 if spec(schedule).delayed else 1


def schedule_lists(schedule: "str | ScheduleSpec", p: int, m: int,
                   num_batches: int | None = None) -> list[list[Action]]:
    """Every rank's actions of ``num_batches`` training calls and the drain (:meth:`ScheduleSpec.run_actions`)."""
    s = spec(schedule)
    batches = default_batches(s) if num_batches is None else num_batches
    return [s.run_actions(r, p, m, batches) for r in range(p)]


def _title(s: ScheduleSpec, p: int, m: int, batches: int) -> str:
    what = f"{batches} batch{'es' if batches > 1 else ''}"
    if s.delayed:
        what += " and the drain"
    chunks = f", {s.chunks} pieces per rank ({s.placement} placement)" if s.chunks > 1 else ""
    return f"schedule {s.name}: p = {p} ranks, m = {m} micro-batches, {what}{chunks}"


def _render(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], title: str,
            marks: Sequence[tuple[int, int]] = (), context: int | None = None) -> str:
    """The grid of ``lists``: a title, a header, then one row per action index; ``marks`` ``(rank, index)`` are
    framed ``>...<`` and named at the end of their row; with ``context``, only the rows within ``context`` of a
    mark are shown, each gap as one ``...`` row."""
    p = len(lists)
    cells = [[action_text(schedule, r, p, a) for a in actions] for r, actions in enumerate(lists)]
    rows = max((len(c) for c in cells), default=0)
    headers = [f"rank {r}" for r in range(p)]
    widths = [max([len(headers[r]), *map(len, cells[r])]) for r in range(p)]
    label = max(len("step"), len(str(max(rows - 1, 0))))
    shown = range(rows)
    if context is not None:
        near = {k for _, i in marks for k in range(i - context, i + context + 1) if 0 <= k < rows}
        shown = sorted(near)

    def line(first: str, texts: Sequence[str], framed: Sequence[bool] = ()) -> str:
        parts = [f"{first:>{label}}"]
        for r, text in enumerate(texts):
            framed_here = r < len(framed) and framed[r]
            cell = f"{MARK_LEFT}{text}{MARK_RIGHT}" if framed_here else f" {text} "
            parts.append(f"{cell:<{widths[r] + 2}}")
        return " ".join(parts).rstrip()

    out = [title, line("step", headers)]
    previous = -1
    for k in shown:
        if k > previous + 1:
            out.append(line(ELIDED, []))
        here = [r for r, i in marks if i == k]
        texts = [c[k] if k < len(c) else "" for c in cells]
        row = line(str(k), texts, [r in here for r in range(p)])
        if here:
            row += "   <-- " + ", ".join(f"rank {r}, action {k}" for r in here)
        out.append(row)
        previous = k
    if previous < rows - 1:
        out.append(line(ELIDED, []))
    return "\n".join(out)


def lists_grid(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], title: str | None = None) -> str:
    """The grid of given action lists (one per rank): one column per rank, one row per action index."""
    if title is None:
        title = f"schedule {spec(schedule).name}: p = {len(lists)} ranks"
    return _render(schedule, lists, title)


def schedule_grid(schedule: "str | ScheduleSpec", p: int, m: int, num_batches: int | None = None,
                  virtual_stages: int | None = None) -> str:
    """The grid of ``schedule`` on ``p`` ranks with ``m`` micro-batches per batch: ``num_batches`` calls (default
    :func:`default_batches`) and the drain; ``virtual_stages``: pieces per rank where the schedule takes a number."""
    s = spec(schedule, virtual_stages)
    batches = default_batches(s) if num_batches is None else num_batches
    return _render(s, schedule_lists(s, p, m, batches), _title(s, p, m, batches))


def grid_at(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], rank: int, index: int,
            context: int = 3, also: Sequence[tuple[int, int]] = ()) -> str:
    """The rows of the grid of ``lists`` within ``context`` of action ``index`` of ``rank``, that action framed
    ``>...<`` (and each ``(rank, index)`` of ``also``): what an error about a schedule prints at the failing action."""
    s, p = spec(schedule), len(lists)
    if not 0 <= rank < p or not 0 <= index < len(lists[rank]):
        raise ValueError(f"no action {index} on rank {rank} ({p} ranks, {[len(a) for a in lists]} actions).")
    where = f"rank {rank}'s action {index}, {action_text(s, rank, p, lists[rank][index])}"
    return _render(s, lists, f"schedule {s.name}, p = {p} ranks, at {where}:", [(rank, index), *also], context)


def _position(s: ScheduleSpec, actions: Sequence[Action], rank: int, p: int, kinds: tuple[str, ...],
              microbatch: int, piece: int) -> int | None:
    for i, a in enumerate(actions):
        if a.kind in kinds and a.microbatch == microbatch and s.piece(rank, a.chunk, p) == piece:
            return i
    return None


def message_action(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], rank: int,
                   message: tuple[str, int, int], sent: bool) -> int | None:
    """The index of the action of ``rank`` that sends (``sent``) or receives ``message``, a ``(kind, micro-batch,
    receiving piece)`` as :func:`~lightning_async.pipeline.program.messages` lists it (kind ``"act"``: a forward's
    output, for the piece after; ``"grad"``: an input gradient, for the piece before); None if no action does."""
    s, p = spec(schedule), len(lists)
    kind, microbatch, piece = message
    kinds = (FORWARD,) if kind == "act" else GRADIENT_ACTIONS
    if sent:
        piece = piece - 1 if kind == "act" else piece + 1
    return _position(s, lists[rank], rank, p, kinds, microbatch, piece)


def message_grid(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], sender: int, receiver: int,
                 sent: Sequence[tuple[str, int, int]], received: Sequence[tuple[str, int, int]],
                 context: int = 3) -> str:
    """The grid at the first message ``sender`` sends ``receiver`` in another order than ``receiver`` posts it:
    the sending action of ``sent[k]`` and the receiving one of ``received[k]`` marked (``k`` the first position
    where the two lists differ). Empty when they agree."""
    k = next((i for i, (a, b) in enumerate(zip(sent, received)) if a != b), min(len(sent), len(received)))
    marks = []
    if k < len(sent):
        marks.append((sender, message_action(schedule, lists, sender, sent[k], sent=True)))
    if k < len(received):
        marks.append((receiver, message_action(schedule, lists, receiver, received[k], sent=False)))
    marks = [(r, i) for r, i in marks if i is not None]
    if not marks:
        return ""
    return grid_at(schedule, lists, *marks[0], context=context, also=marks[1:])


# ------------------------------------------------------------------------------------------- the command
def schedule_main(argv: list[str] | None = None) -> int:
    """``python -m lightning_async.pipeline.schedule_text SCHEDULE P M``: 0 printed, 2 bad input (one ``error:``
    line)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_async.pipeline.schedule_text",
        description="Print a pipeline schedule's actions in torch's notation (piece, kind, micro-batch: 1F0 is "
                    "the forward of micro-batch 0 on piece 1; Ub0 a rank's update after batch 0) as a grid: one "
                    "column per rank, one row per action index.",
    )
    parser.add_argument("schedule", choices=SCHEDULES)
    parser.add_argument("p", type=int, help="pipeline ranks")
    parser.add_argument("m", type=int, help="micro-batches per batch")
    parser.add_argument("--batches", type=int, default=None,
                        help="training calls shown (default: 2 for a delayed schedule, then its drain; else 1)")
    parser.add_argument("--virtual-stages", type=int, default=None, help="pieces per rank (interleaved only)")
    parser.add_argument("--lines", action="store_true", help="one line per rank instead of the grid")
    parser.add_argument("--at", type=int, nargs=2, metavar=("RANK", "INDEX"), default=None,
                        help="only the rows around action INDEX of RANK, that action framed >...<")
    parser.add_argument("--context", type=int, default=3, help="rows shown on each side with --at (default 3)")
    args = parser.parse_args(argv)
    try:
        s = spec(args.schedule, args.virtual_stages)
        if args.p < 1:
            raise ValueError(f"P must be >= 1, got {args.p}.")
        if args.lines:
            lists = schedule_lists(s, args.p, args.m, args.batches)
            print("\n".join(f"rank {r}: {rank_text(s, r, args.p, a)}" for r, a in enumerate(lists)))
        elif args.at is not None:
            print(grid_at(s, schedule_lists(s, args.p, args.m, args.batches), *args.at, context=args.context))
        else:
            print(schedule_grid(s, args.p, args.m, args.batches))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(schedule_main())
