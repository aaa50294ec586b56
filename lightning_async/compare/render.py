"""Printing the gap table: cells, text and Markdown tables, the paper's rows, and ``report.md``.

Every number that summarises seeds says how many there were and, from two seeds on, its 95% interval
(:mod:`lightning_async.compare.statistics`): a gap as ``+0.235 (+14.2%) (95% CI +0.128 to +0.342, n=3)``, a
recovered share as ``51% (95% CI -12% to 160%, n=3)``, one seed as ``(n=1, no interval)``. The statistics
themselves live in :mod:`lightning_async.compare.rows`.
"""

from __future__ import annotations

from pathlib import Path

from lightning_async.compare.events import ASYNC, SYNC, Run, optimizer_step
from lightning_async.compare.ranking import recommend
from lightning_async.compare.paper import NEWS, PAPER_BY_OPTIMIZER, PAPER_RESULTS, PAPER_SUMMARY, SOURCES, PaperResult
from lightning_async.compare.rows import GAP_TOLERANCE, Row, format_setting
from lightning_async.compare.statistics import LEVEL, Interval, Stat
from lightning_async.identity import EF, NO_CORRECTION, correction_category, correction_order


# ---- cells --------------------------------------------------------------------------------------------
def fmt_stat(values: Stat | None, digits: int = 3) -> str:
    """A mode's losses: ``mean ± sample std (n=N)``."""
    if values is None:
        return "n/a"
    text = f"{values.mean:.{digits}f}"
    if values.n > 1:
        text += f" ± {values.std:.{digits}f} (n={values.n})"
    return text


def fmt_interval(interval: Interval | None, n: int, fmt: str = "{:+.3f}", unit: str = "") -> str:
    """``(95% CI low to high, n=N)``, or ``(n=1, no interval)`` with one seed."""
    if interval is None:
        return f"(n={n}, no interval)"
    return f"({interval.describe(fmt, unit)})"


def fmt_cell(row: Row, category: str, digits: int = 3) -> str:
    """A mode's cell: the loss statistic, with diverged runs marked (they are never in the mean)."""
    text = fmt_stat(row.stat(category), digits)
    diverged = row.diverged_runs(category)
    if not diverged:
        return text
    if row.stat(category) is not None:
        return f"{text}, {len(diverged)} DIVERGED"
    if len(diverged) == 1:
        step = diverged[0].divergence.step
        return "DIVERGED" + ("" if step is None else f" at step {step}")
    return f"DIVERGED (n={len(diverged)})"


def _diverged_note(row: Row, *categories: str) -> str:
    gone = [c for c in categories if row.stat(c) is None and row.diverged_runs(c)]
    return f"n/a ({' and '.join(gone)} diverged)" if gone else "n/a"


def fmt_gap(row: Row, digits: int = 3) -> str:
    """``+0.235 (+14.2%) (95% CI +0.128 to +0.342, n=3)``: the mean gap, in % of sync, and the t interval of the
    per-seed gaps."""
    if row.gap is None:
        return _diverged_note(row, SYNC, ASYNC)
    text = f"{row.gap:+.{digits}f}"
    if row.gap_pct is not None:
        text += f" ({row.gap_pct:+.1f}%)"
    seeds = row.gap_seeds
    if seeds is not None:
        text += " " + fmt_interval(row.gap_interval(), seeds.n, f"{{:+.{digits}f}}")
    return text


def fmt_recovered(row: Row, correction: str = EF) -> str:
    """The share of the gap ``correction`` recovers with its Fieller interval: ``51% (95% CI -12% to 160%, n=3)``."""
    share = row.recovered_by(correction)
    category = correction_category(correction)
    if share is None:
        if row.gap is not None and row.stat(category) is not None and row.gap_is_zero:
            return "n/a (gap ~0)"
        if row.gap is not None and row.stat(category) is not None and row.gap_within_noise:
            interval = row.gap_interval()
            return f"n/a (gap within seed noise: {interval.describe()})"
        return _diverged_note(row, SYNC, ASYNC, category)
    interval = row.recovered_interval_by(correction)
    scaled = interval.scaled(100) if interval else None
    return f"{100 * share:.0f}% " + fmt_interval(scaled, row.recovered_n(correction), "{:.0f}", "%")


def recovered_header(correction: str) -> str:
    """``EF recovered`` for ``ef``, ``<correction> recovered`` for the others."""
    return f"{'EF' if correction == EF else correction} recovered"


def table_headers(corrections: tuple[str, ...] = (EF,)) -> tuple[str, ...]:
    """The gap table's columns for the given correction columns."""
    return (
        ("run group", "step", "sync", "async")
        + tuple(correction_category(c) for c in corrections)
        + ("gap (async-sync)",)
        + tuple(recovered_header(c) for c in corrections)
    )


HEADERS = table_headers()  # the columns of a table with EF only


def _columns(rows: list[Row], paper: bool = False) -> tuple[str, ...]:
    """The correction columns of ``rows`` (none when no run applies a correction); ``paper`` adds EF, the paper's."""
    return tuple(correction_order([EF] * paper + [c for r in rows for c in r.corrections]))


def table_cells(rows: list[Row], digits: int = 3, corrections: tuple[str, ...] | None = None) -> list[list[str]]:
    """One line of cells per row, in the order of :func:`table_headers` (``corrections``: the rows' columns)."""
    corrections = _columns(rows) if corrections is None else corrections
    return [
        [row.label, "n/a" if row.step is None else str(row.optimizer_step)]
        + [fmt_cell(row, c, digits) for c in (SYNC, ASYNC) + tuple(map(correction_category, corrections))]
        + [fmt_gap(row, digits)]
        + [fmt_recovered(row, c) for c in corrections]
        for row in rows
    ]


# ---- the paper's rows -----------------------------------------------------------------------------------
def _paper_line(result: PaperResult, corrections: tuple[str, ...]) -> list[str]:
    mark = result.mark
    if result.has_losses:
        sync, asyn = f"{result.sync:.3f}", f"{result.async_:.3f}"
        gap = f"{result.gap:+.3f} ({100 * result.gap / result.sync:+.1f}%)"
    else:
        sync = asyn = "n/a"
        gap = f"{result.gap_statement}{mark}"
    ef_loss = f"{result.async_ef:.3f}" if result.async_ef is not None else "n/a"
    share = result.ef_recovered
    if share is not None and abs(result.gap) >= GAP_TOLERANCE:
        ef_share = f"{100 * share:.0f}%"
    else:
        ef_share = f"{result.ef_statement}{mark}" if result.ef_statement else "n/a"
    label = f"{result.optimizer} (paper, 360M{'; news summary' if mark else ''})"
    return (
        [label, "end", sync, asyn]
        + [ef_loss if c == EF else "n/a" for c in corrections]
        + [gap]
        + [ef_share if c == EF else "n/a" for c in corrections]
    )


def paper_cells(optimizers: list[str] | None = None, corrections: tuple[str, ...] = (EF,)) -> list[list[str]]:
    """The paper's results as table lines (it reports EF only: the other correction columns are n/a); a value
    that comes from the news summary rather than the paper's tables carries that mark."""
    results = [r for r in PAPER_RESULTS if optimizers is None or r.optimizer in optimizers] or list(PAPER_RESULTS)
    return [_paper_line(r, corrections) for r in results]


def paper_sources_note() -> str:
    """The footnote that says where the paper's numbers come from."""
    return (f"Paper rows: unmarked numbers are {SOURCES[PAPER_SUMMARY]}; values marked 'news summary' come from "
            f"{SOURCES[NEWS]}.")


# ---- tables ---------------------------------------------------------------------------------------------
def text_table(headers, cells) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *cells)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def markdown_table(headers, cells) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    return "\n".join(out)


def render_tables(rows: list[Row], *, paper: bool = False, markdown: bool = False, digits: int = 3) -> str:
    """The gap table per optimizer (one block per optimizer, the same columns in each), plus the paper's
    numbers if asked."""
    render = markdown_table if markdown else text_table
    corrections = _columns(rows, paper)
    columns = table_headers(corrections)
    blocks = []
    for optimizer in dict.fromkeys(r.optimizer for r in rows):
        opt_rows = [r for r in rows if r.optimizer == optimizer]
        cells = table_cells(opt_rows, digits, corrections)
        if paper and optimizer in PAPER_BY_OPTIMIZER:
            cells += paper_cells([optimizer], corrections)
        title = f"### {optimizer}" if markdown else f"== {optimizer} =="
        blocks.append(title + ("\n\n" if markdown else "\n") + render(columns, cells))
    if paper:
        title = ("### Paper reference (SmolLM2-360M, FineWeb-Edu)" if markdown
                 else "== paper reference (SmolLM2-360M) ==")
        blocks.append(title + ("\n\n" if markdown else "\n") + render(columns, paper_cells(None, corrections))
                      + "\n\n" + paper_sources_note())
    return "\n\n".join(blocks)


# ---- which correction ----------------------------------------------------------------------------------
def correction_verdicts(rows: list[Row]) -> list[str]:
    """Per optimizer with corrected runs: the best correction against no correction and the runner-up, paired by
    seed (:func:`~lightning_async.compare.ranking.recommend`); "Recommendation" only when both differences are
    below zero at 95%."""
    return [f"{optimizer}: {rec.describe()}" for optimizer, rec in recommend(rows).items()]


# ---- the run list and report.md -------------------------------------------------------------------------
def _correction_cell(run: Run) -> str:
    ident = run.identity
    if ident.correction == NO_CORRECTION:
        return NO_CORRECTION
    return f"{ident.correction} {ident.correction_strength:g}"


def run_list_cells(runs: list[Run]) -> list[list[str]]:
    cells = []
    for run in sorted(runs, key=lambda r: (r.identity.optimizer, r.category, r.identity.seed or 0, str(r.path))):
        ident = run.identity
        loss = run.final_val_loss
        cells.append([
            run.name, ident.optimizer, ident.schedule_name, run.category, format_setting(ident.lr), str(ident.delay),
            ident.delay_profile, _correction_cell(run), "-" if ident.seed is None else str(ident.seed),
            "-" if run.last_step is None else str(optimizer_step(run.last_step)),
            "no val/loss" if loss is None else f"{loss:.4f}", run.status, str(run.path),
        ])
    return cells


#: the run list: ``schedule`` (the pipeline's, or ``one device``) and ``mode`` (``sync``, ``async``, ``async+EF``, ...) as
#: the run's folder name and the logs say them, not the recorded ``mode`` value (``sync_pipe``, ``delayed``, ...)
RUN_HEADERS = ("run", "optimizer", "schedule", "mode", "lr", "delay", "delay profile", "correction", "seed",
               "last step", "last val/loss", "status", "path")


def explanation(rows: list[Row], paper: bool = False) -> str:
    """The paragraph above the tables: what each column means, and how its interval is made only when some mode
    has several seeds to make one from (two runs, sync and async, get the plain difference)."""
    corrections = _columns(rows, paper)
    seeded = any(row.seeds > 1 for row in rows)
    level = f"{100 * LEVEL:g}%"
    text = (
        "Validation loss (`val/loss`) at the row's *step*: the last optimizer step at which every run of the row "
        "logged it (the runs' final step when they have the same length)"
        + (", mean ± sample std over seeds (n = seeds)" if seeded else "")
        + ". Diverged runs (a `DIVERGED` marker or a non-finite loss) are marked DIVERGED and left out of every "
        "number. gap = async - sync (in % of sync)"
        + (f", paired by seed, with the {level} Student t interval of the per-seed gaps" if seeded else "") + "."
    )
    if corrections:
        first, others = corrections[0], corrections[1:]
        name = "EF" if first == EF else first
        text += (
            f" {recovered_header(first)} = (async - {correction_category(first)}) / (async - sync)"
            + (f" on the seeds that ran all three modes, with Fieller's {level} interval for that ratio of paired means"
               if seeded else "")
            + f": 100% means {name} closes the whole gap, 0% that it does nothing, negative that it hurts"
            + (f"; {', '.join(recovered_header(c) for c in others)}: the same share for that correction "
               f"(async+<correction> in place of {correction_category(first)})" if others else "")
            + f"; n/a when a mode is missing, |gap| < {GAP_TOLERANCE:g}"
            + (f", or the gap's own {level} interval includes 0 (a share of a gap not told apart from zero has no "
               "bounded interval)" if seeded else "") + "."
        )
    if seeded:
        return text + " With one seed there is no interval: a single seed's share can move by tens of points between seeds."
    return text + (" One run per mode: no intervals (a single seed's gap can move between seeds; runs of several seeds "
                   "get means, standard deviations and 95% intervals).")


def write_markdown(
    path: Path,
    rows: list[Row],
    runs: list[Run],
    *,
    paper: bool = False,
    commands: list[str] | None = None,
    plots: list[Path] | None = None,
    layout_dir: Path | None = None,
    warnings: list[str] | None = None,
    plots_note: str | None = None,
) -> Path:
    """``report.md``: the tables, notes, plots (or ``plots_note``, why there are none), the run list and the commands
    that produced them."""
    title = " vs ".join(["Sync", "async", *(correction_category(c) for c in _columns(rows, paper))])
    lines = [f"# {title}", "", explanation(rows, paper), "",
             render_tables(rows, paper=paper, markdown=True), ""]
    verdicts = correction_verdicts(rows)
    if verdicts:
        lines += ["## Which correction (paired by seed)", ""] + [f"- {v}" for v in verdicts] + [""]
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    if plots or plots_note:
        lines += ["## Curves", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots or []] + ([plots_note] if plots_note else []) + [""]
    if layout_dir is not None:
        shown = dict.fromkeys(c for r in rows for c in r.categories if r.runs.get(c))
        lines += [
            "## TensorBoard",
            "",
            f"`tensorboard --logdir {layout_dir}` shows the same curves: its runs are the compared series "
            f"({', '.join(shown)}), with `<group>/val_loss` and `<group>/train_loss` under *Scalars*; its *Custom "
            "Scalars* tab has one section per optimizer, each chart overlaying the series.",
            "",
        ]
    lines += ["## Runs", "", markdown_table(RUN_HEADERS, run_list_cells(runs)), ""]
    if commands:
        lines += ["## Commands", "", "```bash"] + commands + ["```", ""]
    path.write_text("\n".join(lines))
    return path
