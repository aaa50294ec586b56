"""``lightning-async compare``: gap tables, curves and a TensorBoard layout from training runs.

Python use::

    from lightning_async.compare import compare
    result = compare(["studies/quickstart/runs"], output="studies/quickstart/compare")
    for row in result.rows:
        print(row.label, row.gap, row.recovered, row.recovered_by("nesterov"))
    best = best_corrections(result.rows)  # optimizer -> the correction recovering most of its gap

Command line: ``lightning-async compare RUN_DIR [RUN_DIR ...] [--output DIR] [--paper]`` or
``python -m lightning_async.compare ...``. See ``docs/compare.md``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lightning_async.compare.divergence import DIVERGED_FILE, Divergence, find_divergence
from lightning_async.compare.events import (
    ASYNC,
    ASYNC_EF,
    OUTPUT_MARKER,
    SYNC,
    TRAIN_LOSS,
    VAL_LOSS,
    CompareError,
    Run,
    RunIdentity,
    classify,
    find_run_dirs,
    load_run,
    load_runs,
    read_scalars,
    run_divergence,
)
from lightning_async.compare.paper import PAPER_REFERENCE, PAPER_RESULTS, PaperResult
from lightning_async.compare.ranking import BestCorrection, Recommendation, best_corrections, recommend
from lightning_async.compare.render import correction_verdicts, render_tables, write_markdown
from lightning_async.compare.rows import GAP_TOLERANCE, Row, build_rows, check_comparable
from lightning_async.compare.selection import select_runs
from lightning_async.compare.statistics import Interval, Stat

__all__ = [
    "ASYNC",
    "ASYNC_EF",
    "BestCorrection",
    "GAP_TOLERANCE",
    "Interval",
    "PAPER_REFERENCE",
    "PAPER_RESULTS",
    "PaperResult",
    "Recommendation",
    "SYNC",
    "CompareError",
    "CompareResult",
    "DIVERGED_FILE",
    "Divergence",
    "Row",
    "Run",
    "RunIdentity",
    "Stat",
    "best_corrections",
    "build_rows",
    "classify",
    "compare",
    "compare_main",
    "find_divergence",
    "find_run_dirs",
    "load_run",
    "load_runs",
    "read_scalars",
    "recommend",
    "run_divergence",
    "select_runs",
]


#: said instead of the PNG curves when matplotlib (the ``plots`` extra) is not installed
NO_PLOTS = 'no PNG curves: matplotlib is not installed (pip install -e ".[plots]" adds them)'


def plots_available() -> bool:
    """Whether matplotlib, which draws the PNG curves, can be imported (it is the ``plots`` extra, not a dependency:
    the table, report.md and the TensorBoard folder need none of it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class CompareResult:
    """What :func:`compare` found and wrote."""

    runs: list[Run]
    rows: list[Row]
    warnings: list[str] = field(default_factory=list)
    report: Path | None = None
    plots: list[Path] = field(default_factory=list)
    layout_dir: Path | None = None
    plots_note: str | None = None  # why there are no PNGs (matplotlib missing), with the command that adds them

    def table(self, paper: bool = False, markdown: bool = False) -> str:
        return render_tables(self.rows, paper=paper, markdown=markdown)


def compare(
    paths: list[str | Path],
    output: str | Path | None = None,
    *,
    paper: bool = False,
    plots: bool = True,
    skip_invalid: bool = False,
    gap_tolerance: float = GAP_TOLERANCE,
    commands: list[str] | None = None,
    warn=None,
) -> CompareResult:
    """Load runs under ``paths``, build the gap table and (with ``output``) write the report.

    Each row is compared at the last step all its runs logged ``val/loss``; diverged runs are marked
    and left out of the numbers; of several runs for one slot (same optimizer, class, lr, delay,
    delay profile, correction strength and seed) the only finished one is used. Raises
    :class:`CompareError` for fatal input problems (nothing found, a run without identity unless
    ``skip_invalid``, several finished runs for one slot, no optimizer with both a sync and an async
    run).
    """
    warnings: list[str] = []

    def _warn(message: str) -> None:
        warnings.append(message)
        if warn is not None:
            warn(message)

    runs = select_runs(load_runs(paths, skip_invalid=skip_invalid, warn=_warn), warn=_warn)
    for run in runs:
        if run.diverged:
            _warn(f"{run.path}: {run.divergence.describe()}; marked DIVERGED in the table, not used in any number")
        elif run.final_val_loss is None:
            _warn(f"{run.path}: no val/loss scalar logged; the run is listed but not in the table")
        elif not run.done:
            _warn(f"{run.path}: no DONE file (unfinished or interrupted run); compared up to its last val/loss")
    rows = build_rows(runs, gap_tolerance=gap_tolerance)
    for message in check_comparable(rows):
        _warn(message)
    result = CompareResult(runs=runs, rows=rows, warnings=warnings)
    if output is None:
        return result
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    (out / OUTPUT_MARKER).write_text("written by lightning-async compare; not a run directory\n")
    if plots and not plots_available():
        result.plots_note = NO_PLOTS
    elif plots:
        from lightning_async.compare.plots import write_plots

        result.plots = [*write_plots(rows, out, VAL_LOSS), *write_plots(rows, out, TRAIN_LOSS)]
    from lightning_async.compare.layout import write_layout

    result.layout_dir = write_layout(rows, out / "tensorboard")
    result.report = write_markdown(
        out / "report.md", rows, runs, paper=paper, commands=commands, plots=result.plots,
        layout_dir=result.layout_dir, warnings=warnings, plots_note=result.plots_note,
    )
    return result


def build_parser(prog: str = "lightning-async compare") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Compare sync, async (one-step delayed) and corrected async runs (async+EF, async+nesterov, "
        "...): final validation loss, gap and the share of the gap each correction recovers, per optimizer. "
        "Writes report.md, PNG curves and a TensorBoard custom-scalars layout when --output is given.",
    )
    parser.add_argument("paths", nargs="+", metavar="RUN_DIR", help="run directories or parents of many runs")
    parser.add_argument("--output", "-o", default=None, help="directory for report.md, PNGs and the TensorBoard layout")
    parser.add_argument("--paper", action="store_true", help="add the paper's SmolLM2-360M numbers side by side")
    parser.add_argument("--no-plots", action="store_true",
                        help="skip the PNG curves (without matplotlib, the plots extra, they are skipped anyway)")
    parser.add_argument("--skip-invalid", action="store_true", help="leave out runs without identity instead of failing")
    parser.add_argument("--gap-tolerance", type=float, default=GAP_TOLERANCE,
                        help=f"|gap| below this counts as no gap (default {GAP_TOLERANCE:g})")
    return parser


def compare_main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-async compare``; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    command = "lightning-async compare " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        result = compare(
            args.paths, args.output, paper=args.paper, plots=not args.no_plots, skip_invalid=args.skip_invalid,
            gap_tolerance=args.gap_tolerance, commands=[command],
            warn=lambda m: print(f"warning: {m}", file=sys.stderr),
        )
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(result.runs)} runs\n")
    print(result.table(paper=args.paper))
    verdicts = correction_verdicts(result.rows)
    if verdicts:
        print("\n== which correction (paired by seed) ==\n" + "\n".join(verdicts))
    if result.report is not None:
        print(f"\nreport: {result.report}")
        for path in result.plots:
            print(f"plot:   {path}")
        if result.plots_note:
            print(f"plots:  {result.plots_note}")
        print(f"tensorboard --logdir {result.layout_dir}  (its runs are the compared series; the Custom Scalars tab "
              "overlays them, one chart per group)")
    return 0
