"""The ASCII timeline of a simulated run: one row per rank, each action drawn where the timing model
(:mod:`~lightning_async.pipeline.timing`) placed it."""

from __future__ import annotations

from lightning_async.pipeline.schedules import UPDATE

__all__ = ["render_timeline"]


def render_timeline(result, chars_per_unit: int = 3, unit: float | None = None) -> str:
    """ASCII timeline, one row per rank, of ``result`` (a :class:`~lightning_async.pipeline.timing.ScheduleTiming`: its
    ``trace`` and ``total_time``; not imported: ``timing`` is the model, this module only draws it): ``F5``/``B5`` =
    forward/backward of micro-batch 5 (``I5``/``W5``: a split backward's input and weight gradients; ``F5c1``: on
    the rank's chunk 1), ``.`` = idle, ``|`` = the update (``U``) of a batch finishes there (when updates take no
    time), ``U`` = a timed update.

    ``unit`` is the time per ``chars_per_unit`` characters (default: the shortest action duration).
    """
    durations = [e - s for t in result.trace for _, s, e in t if e > s]
    if unit is None:
        unit = min(durations) if durations else 1.0
    width = int(round(result.total_time / unit * chars_per_unit)) + 1
    rows = []
    for s, t in enumerate(result.trace):
        row = ["."] * width
        marks = []
        for a, start, end in t:
            i, j = int(round(start / unit * chars_per_unit)), int(round(end / unit * chars_per_unit))
            if j == i:
                if a.kind == UPDATE:
                    marks.append(i)
                continue
            label = " " + (repr(a) if a.kind != UPDATE else "U")
            cell = (label + " " * (j - i))[: j - i]
            row[i:j] = list(cell)
        for i in marks:
            if i < width:
                row[i] = "|"
        rows.append(f"s{s} " + "".join(row).rstrip("."))
    return "\n".join(rows)
