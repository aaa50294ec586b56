"""The gap table: final validation loss of sync, async and corrected async runs, side by side.

Rows are groups of runs that differ only in the mode and correction (and the seed): one row per
optimizer, per (optimizer, lr) when an optimizer was run at several learning rates, and per delay,
delay profile and correction strength when a study swept those. Every run of a row is read at the
same optimizer step, the row's ``step``: the last step at which all its runs logged ``val/loss``
(runs of different lengths are compared where they overlap, with a warning). Diverged runs are
marked, never averaged. For each row:

* ``sync``, ``async``, ``async+EF``, ``async+<correction>``: mean ``val/loss`` at ``step`` over seeds,
  with the spread (one column per correction present in the runs; ``async+EF`` always);
* ``gap = async - sync`` (and in % of sync);
* ``<correction> recovered = (async - async+<correction>) / (async - sync)`` (``EF recovered`` for
  ``ef``): 1 means the correction closes the whole gap, 0 means it does nothing, negative means it
  hurts. "n/a" when a mode is missing, the gap is ~0, or (with 2+ seeds) the gap is within seed noise:
  smaller than ``NOISE_SIGMAS`` standard errors of the per-seed gaps (a share of noise is no result).

Spread over seeds is the sample standard deviation (ddof=1) with the min-max range; for the gap
and a recovered share it is taken over the per-seed values of seeds present in the modes involved.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from lightning_async.compare.events import ASYNC, ASYNC_EF, SYNC, CompareError, Run
from lightning_async.compare.selection import describe_slot, lr_key
from lightning_async.identity import EF, NO_CORRECTION, correction_category, correction_order


#: |gap| below this (absolute, in loss units) counts as "no gap": the recovered share is n/a.
GAP_TOLERANCE = 1e-4

#: With 2+ seeds, a gap under this many standard errors of its per-seed values is seed noise: share n/a.
NOISE_SIGMAS = 2.0

#: SmolLM2-360M on FineWeb-Edu, final validation loss: (sync, async, async+EF); None = not given.
#: Source: the paper (arXiv 2606.30634) via a machine-written summary; see docs/compare.md.
PAPER_REFERENCE: dict[str, tuple[float, float, float | None]] = {
    "adamw": (2.612, 2.890, 2.640),
    "muon": (2.578, 2.590, 2.583),
    "soap": (2.581, 2.608, 2.590),
    "adan": (2.641, 2.651, None),
}


@dataclass
class Stat:
    """Summary of one quantity over seeds."""

    values: list[float]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if self.n > 1 else None

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)


def _usable(run: Run) -> bool:
    return not run.diverged and bool(run.val_steps)


def _stat(values: list[float]) -> Stat | None:
    return Stat(values) if values else None


@dataclass
class Row:
    """One line of the gap table.

    ``strengths`` holds the strength of each correction whose runs are in the row; ``corrections`` the
    table's correction columns (``ef`` first); ``varied`` the corrections whose strength the label shows.
    """

    optimizer: str
    lr: float | None = None
    delay: int | None = None
    delay_profile: str | None = None
    strengths: dict[str, float] = field(default_factory=dict)
    corrections: tuple[str, ...] = (EF,)
    show_lr: bool = False
    show_delay: bool = False
    show_profile: bool = False
    varied: tuple[str, ...] = ()
    runs: dict[str, list[Run]] = field(default_factory=dict)
    gap_tolerance: float = GAP_TOLERANCE

    def __post_init__(self) -> None:
        for category in self.categories:
            self.runs.setdefault(category, [])

    @property
    def categories(self) -> tuple[str, ...]:
        """``sync``, ``async``, then one ``async+<correction>`` per correction column."""
        return (SYNC, ASYNC) + tuple(correction_category(c) for c in self.corrections)

    @property
    def ef_strength(self) -> float | None:
        return self.strengths.get(EF)

    @property
    def show_ef(self) -> bool:
        return EF in self.varied

    # ---- which runs count, and at which step ------------------------------------------------
    def usable_runs(self, category: str) -> list[Run]:
        """Runs of ``category`` that give a result: logged ``val/loss`` and did not diverge."""
        return [r for r in self.runs.get(category, []) if _usable(r)]

    def diverged_runs(self, category: str) -> list[Run]:
        return [r for r in self.runs.get(category, []) if r.diverged]

    @cached_property
    def step(self) -> int | None:
        """The last step at which every usable run of the row logged ``val/loss`` (None: no common step)."""
        usable = [r for c in self.categories for r in self.usable_runs(c)]
        if not usable:
            return None
        common = set(usable[0].val_steps).intersection(*(r.val_steps for r in usable[1:]))
        return max(common) if common else None

    def last_steps(self) -> dict[str, list[int]]:
        """category -> the distinct last ``val/loss`` steps of its usable runs."""
        return {c: sorted({r.val_steps[-1] for r in self.usable_runs(c)}) for c in self.categories
                if self.usable_runs(c)}

    # ---- per-mode results -------------------------------------------------------------------
    def losses(self, category: str) -> dict[int | None, float]:
        """seed -> val loss at :attr:`step` (runs without a seed get distinct negative keys).

        Raises :class:`CompareError` when two runs give the same seed (``select_runs`` keeps one).
        """
        out: dict[int | None, float] = {}
        if self.step is None:
            return out
        seen: dict[int | None, Run] = {}
        for i, run in enumerate(self.runs.get(category, [])):
            if not _usable(run):
                continue
            key = run.identity.seed if run.identity.seed is not None else -(i + 1)
            if key in seen:
                raise CompareError(f"{describe_slot(run)}: two runs, {seen[key].path} and {run.path}; keep one")
            seen[key] = run
            out[key] = run.val_loss_at(self.step)
        return out

    def stat(self, category: str) -> Stat | None:
        return _stat(list(self.losses(category).values()))

    @property
    def sync(self) -> Stat | None:
        return self.stat(SYNC)

    @property
    def async_(self) -> Stat | None:
        return self.stat(ASYNC)

    @property
    def async_ef(self) -> Stat | None:
        return self.stat(ASYNC_EF)

    @property
    def seeds(self) -> int:
        """Number of seeds of the best-covered mode."""
        return max((len(self.losses(c)) for c in self.categories), default=0)

    # ---- derived ----------------------------------------------------------------------------
    def _paired(self, *categories: str) -> list[dict[str, float]]:
        tables = [self.losses(c) for c in categories]
        common = set(tables[0]).intersection(*tables[1:])
        return [{c: t[s] for c, t in zip(categories, tables)} for s in sorted(common, key=lambda s: (s is None, s))]

    @property
    def gap(self) -> float | None:
        """mean(async) - mean(sync), or None when a mode is missing."""
        if self.sync is None or self.async_ is None:
            return None
        return self.async_.mean - self.sync.mean

    @property
    def gap_pct(self) -> float | None:
        if self.gap is None or self.sync.mean == 0:
            return None
        return 100.0 * self.gap / self.sync.mean

    @property
    def gap_seeds(self) -> Stat | None:
        """Per-seed gaps (seeds present in both sync and async)."""
        return _stat([p[ASYNC] - p[SYNC] for p in self._paired(SYNC, ASYNC)])

    @property
    def gap_is_zero(self) -> bool:
        return self.gap is not None and abs(self.gap) < self.gap_tolerance

    @property
    def gap_within_noise(self) -> bool:
        """With 2+ paired seeds: |gap| < ``NOISE_SIGMAS`` standard errors of the per-seed gaps."""
        seeds = self.gap_seeds
        if self.gap is None or seeds is None or seeds.n < 2:
            return False
        return abs(self.gap) < NOISE_SIGMAS * seeds.std / math.sqrt(seeds.n)

    def recovered_by(self, correction: str) -> float | None:
        """(mean async - mean async+<correction>) / (mean async - mean sync); None when n/a (a mode missing,
        the gap ~0 or within seed noise)."""
        corrected = self.stat(correction_category(correction))
        if self.gap is None or corrected is None or self.gap_is_zero or self.gap_within_noise:
            return None
        return (self.async_.mean - corrected.mean) / self.gap

    def recovered_seeds_by(self, correction: str) -> Stat | None:
        """Per-seed recovered shares of ``correction`` (seeds present in sync, async and async+<correction>,
        whose own gap is positive: the share of a negative gap has the opposite meaning)."""
        category = correction_category(correction)
        shares = [
            (p[ASYNC] - p[category]) / (p[ASYNC] - p[SYNC])
            for p in self._paired(SYNC, ASYNC, category)
            if p[ASYNC] - p[SYNC] >= self.gap_tolerance
        ]
        return _stat(shares)

    @property
    def recovered(self) -> float | None:
        """The share of the gap EF recovers (:meth:`recovered_by` ``ef``)."""
        return self.recovered_by(EF)

    @property
    def recovered_seeds(self) -> Stat | None:
        """Per-seed shares EF recovers (:meth:`recovered_seeds_by` ``ef``)."""
        return self.recovered_seeds_by(EF)

    @property
    def seed_spread(self) -> float | None:
        """Largest seed std among the modes (None with fewer than two seeds everywhere)."""
        stds = [s.std for s in map(self.stat, self.categories) if s is not None and s.std is not None]
        return max(stds) if stds else None

    @property
    def label(self) -> str:
        parts = [self.optimizer]
        if self.show_lr:
            parts.append(f"lr={_g(self.lr)}")
        if self.show_delay:
            parts.append(f"delay={self.delay}")
        if self.show_profile:
            parts.append(f"profile={self.delay_profile}")
        for correction in self.varied:
            if correction in self.strengths:
                parts.append(f"{'EF' if correction == EF else correction}={_g(self.strengths[correction])}")
        return " ".join(parts)

    def present(self, category: str) -> bool:
        """Has runs with a result for ``category``: a val/loss, or a divergence (a result too)."""
        return bool(self.usable_runs(category) or self.diverged_runs(category))

    @property
    def comparable(self) -> bool:
        return self.present(SYNC) and any(self.present(c) for c in self.categories[1:])

    def missing(self) -> list[str]:
        return [c for c in self.categories if not self.present(c)]


def _g(x: float | None) -> str:
    return "default" if x is None else f"{x:g}"


def table_corrections(runs: list[Run]) -> tuple[str, ...]:
    """The correction columns of a table of ``runs``: ``ef`` always, then each correction some run applies."""
    return tuple(correction_order([EF] + [r.identity.correction for r in runs if r.identity.corrected]))


def _strength_choices(delayed: list[Run], corrections: tuple[str, ...]) -> dict[str, list[float]]:
    """correction -> the strengths its runs used (sorted); corrections without runs are left out."""
    found: dict[str, set[float]] = defaultdict(set)
    for run in delayed:
        if run.identity.corrected:
            found[run.identity.correction].add(run.identity.correction_strength)
    return {c: sorted(found[c]) for c in corrections if found.get(c)}


def _fits(run: Run, base: tuple, strengths: dict[str, float]) -> bool:
    """Whether the delayed ``run`` belongs to the row of ``base`` (delay, profile) and ``strengths``."""
    ident = run.identity
    if (ident.delay, ident.delay_profile) != base:
        return False
    return not ident.corrected or strengths.get(ident.correction) == ident.correction_strength


def build_rows(runs: list[Run], gap_tolerance: float = GAP_TOLERANCE) -> list[Row]:
    """Group runs into gap-table rows (see the module docstring).

    Within an (optimizer, lr) group there is a row per (delay, delay profile) and per combination of the
    correction strengths swept; sync runs are in every row of their group.
    """
    corrections = table_corrections(runs)
    by_opt: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_opt[run.identity.optimizer].append(run)
    rows: list[Row] = []
    for optimizer in sorted(by_opt):
        opt_runs = by_opt[optimizer]
        lrs = sorted({lr_key(r.identity.lr) for r in opt_runs}, key=lambda x: (x is None, x))
        for lr in lrs:
            group = [r for r in opt_runs if lr_key(r.identity.lr) == lr]
            delayed = [r for r in group if r.category != SYNC]
            bases = sorted({(r.identity.delay, r.identity.delay_profile) for r in delayed}) or [(None, None)]
            choices = _strength_choices(delayed, corrections)
            combos = [dict(zip(choices, picked)) for picked in itertools.product(*choices.values())]
            for base, strengths in itertools.product(bases, combos):
                row = Row(
                    optimizer=optimizer,
                    lr=lr,
                    delay=base[0],
                    delay_profile=base[1],
                    strengths=strengths,
                    corrections=corrections,
                    show_lr=len(lrs) > 1,
                    show_delay=len({d for d, _ in bases}) > 1,
                    show_profile=len({p for _, p in bases}) > 1,
                    varied=tuple(c for c, values in choices.items() if len(values) > 1),
                    gap_tolerance=gap_tolerance,
                )
                for run in group:
                    if run.category == SYNC or _fits(run, base, strengths):
                        row.runs[run.category].append(run)
                rows.append(row)
    return rows


def check_comparable(rows: list[Row]) -> list[str]:
    """Warnings for rows that cannot be compared or whose runs differ in length; raises
    :class:`CompareError` if no row can be compared."""
    warnings = []
    for row in rows:
        ends = row.last_steps()
        if ends and row.step is None:
            warnings.append(f"{row.label}: its runs share no step with a val/loss (last steps: {_ends(ends)}); "
                            "shown as n/a. Validate at the same steps (e.g. the same val_check_interval)")
        elif len({s for steps in ends.values() for s in steps}) > 1:
            warnings.append(f"{row.label}: runs end at different steps ({_ends(ends)}); compared at step "
                            f"{row.step}, the last step at which every run of the row logged val/loss")
        missing = row.missing()
        if missing:
            warnings.append(f"{row.label}: no finished runs with val/loss for {', '.join(missing)}; shown as n/a")
    if not any(row.comparable for row in rows):
        present = sorted({f"{r.label}: {', '.join(c for c in r.categories if r.present(c))}" for r in rows})
        raise CompareError(
            "cannot build a gap table: no optimizer has both a sync run and an async (or corrected async) run with a "
            "val/loss. Present: " + ("; ".join(present) or "nothing") + ". Add the missing modes "
            "(e.g. `lightning-async study` with modes [sync, delayed, delayed-ef])."
        )
    return warnings


def _ends(ends: dict[str, list[int]]) -> str:
    return ", ".join(f"{c} {'/'.join(map(str, steps))}" for c, steps in ends.items())


# ---- formatting -------------------------------------------------------------------------------
def fmt_stat(stat: Stat | None, digits: int = 3) -> str:
    if stat is None:
        return "n/a"
    text = f"{stat.mean:.{digits}f}"
    if stat.n > 1:
        text += f" ± {stat.std:.{digits}f} (n={stat.n})"
    return text


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
    if row.gap is None:
        return _diverged_note(row, SYNC, ASYNC)
    text = f"{row.gap:+.{digits}f}"
    if row.gap_pct is not None:
        text += f" ({row.gap_pct:+.1f}%)"
    seeds = row.gap_seeds
    if seeds is not None and seeds.n > 1:
        text += f" ± {seeds.std:.{digits}f}"
    return text


def fmt_recovered(row: Row, correction: str = EF) -> str:
    """The share of the gap ``correction`` recovers, with its spread over seeds (``± std [min..max] (n=N)``)."""
    share = row.recovered_by(correction)
    category = correction_category(correction)
    if share is None:
        if row.gap is not None and row.stat(category) is not None and row.gap_is_zero:
            return "n/a (gap ~0)"
        if row.gap is not None and row.stat(category) is not None and row.gap_within_noise:
            return "n/a (gap within seed noise)"
        return _diverged_note(row, SYNC, ASYNC, category)
    text = f"{100 * share:.0f}%"
    seeds = row.recovered_seeds_by(correction)
    if seeds is not None and seeds.n > 1:
        text += f" ± {100 * seeds.std:.0f}% [{100 * seeds.min:.0f}..{100 * seeds.max:.0f}%] (n={seeds.n})"
    return text


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


def _columns(rows: list[Row]) -> tuple[str, ...]:
    return tuple(correction_order([EF] + [c for r in rows for c in r.corrections]))


def table_cells(rows: list[Row], digits: int = 3, corrections: tuple[str, ...] | None = None) -> list[list[str]]:
    """One line of cells per row, in the order of :func:`table_headers` (``corrections``: the rows' columns)."""
    corrections = _columns(rows) if corrections is None else corrections
    return [
        [row.label, "n/a" if row.step is None else str(row.step)]
        + [fmt_cell(row, c, digits) for c in (SYNC, ASYNC) + tuple(map(correction_category, corrections))]
        + [fmt_gap(row, digits)]
        + [fmt_recovered(row, c) for c in corrections]
        for row in rows
    ]


def paper_cells(optimizers: list[str] | None = None, corrections: tuple[str, ...] = (EF,)) -> list[list[str]]:
    """The paper's numbers as table lines (it reports EF only: the other correction columns are n/a)."""
    names = [o for o in PAPER_REFERENCE if optimizers is None or o in optimizers] or list(PAPER_REFERENCE)
    cells = []
    for name in names:
        sync, asyn, ef = PAPER_REFERENCE[name]
        gap = asyn - sync
        known = ef is not None
        loss = {EF: f"{ef:.3f}" if known else "n/a"}
        share = {EF: f"{100 * (asyn - ef) / gap:.0f}%" if known and abs(gap) >= GAP_TOLERANCE else "n/a"}
        cells.append(
            [f"{name} (paper, 360M)", "end", f"{sync:.3f}", f"{asyn:.3f}"]
            + [loss.get(c, "n/a") for c in corrections]
            + [f"{gap:+.3f} ({100 * gap / sync:+.1f}%)"]
            + [share.get(c, "n/a") for c in corrections]
        )
    return cells


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
    corrections = _columns(rows)
    columns = table_headers(corrections)
    blocks = []
    for optimizer in dict.fromkeys(r.optimizer for r in rows):
        opt_rows = [r for r in rows if r.optimizer == optimizer]
        cells = table_cells(opt_rows, digits, corrections)
        if paper and optimizer in PAPER_REFERENCE:
            cells += paper_cells([optimizer], corrections)
        title = f"### {optimizer}" if markdown else f"== {optimizer} =="
        blocks.append(title + ("\n\n" if markdown else "\n") + render(columns, cells))
    if paper:
        title = ("### Paper reference (SmolLM2-360M, FineWeb-Edu)" if markdown
                 else "== paper reference (SmolLM2-360M) ==")
        blocks.append(title + ("\n\n" if markdown else "\n") + render(columns, paper_cells(None, corrections)))
    return "\n\n".join(blocks)


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
            run.name, ident.optimizer, ident.mode, run.category, _g(ident.lr), str(ident.delay), ident.delay_profile,
            _correction_cell(run), "-" if ident.seed is None else str(ident.seed),
            "-" if run.last_step is None else str(run.last_step),
            "no val/loss" if loss is None else f"{loss:.4f}", run.status, str(run.path),
        ])
    return cells


RUN_HEADERS = ("run", "optimizer", "mode", "class", "lr", "delay", "delay profile", "correction", "seed",
               "last step", "last val/loss", "status", "path")


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
) -> Path:
    """``report.md``: the tables, notes, plots, the run list and the commands that produced them."""
    corrected = [correction_category(c) for c in _columns(rows)]
    others = [c for c in _columns(rows) if c != EF]
    lines = [f"# Sync vs async vs {' vs '.join(corrected)}", ""]
    lines += [
        "Validation loss (`val/loss`) at the row's *step*: the last step at which every run of the row logged it "
        "(the runs' final step when they have the same length), mean ± sample std over seeds. Diverged runs "
        "(a `DIVERGED` marker or a non-finite loss) are marked DIVERGED and left out of every number. "
        "gap = async - sync (in % of sync). EF recovered = (async - async+EF) / (async - sync): "
        "100% means EF closes the whole gap, 0% means it does nothing, negative means it hurts"
        + (f"; {', '.join(recovered_header(c) for c in others)}: the same share for that correction "
           "(async+<correction> in place of async+EF)" if others else "")
        + f"; n/a when a mode is missing, |gap| < {GAP_TOLERANCE:g}, or the gap is within seed noise (under "
        f"{NOISE_SIGMAS:g} standard errors of the per-seed gaps). Spreads of gap and recovered shares are "
        "over the per-seed values of seeds present in the modes involved (n = those seeds; a share only for "
        "seeds whose own gap is positive).",
        "",
        render_tables(rows, paper=paper, markdown=True),
        "",
    ]
    if warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    if plots:
        lines += ["## Curves", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    if layout_dir is not None:
        lines += [
            "## TensorBoard",
            "",
            f"`tensorboard --logdir {layout_dir}` shows the same overlays under *Custom Scalars* "
            "(one section per optimizer).",
            "",
        ]
    lines += ["## Runs", "", markdown_table(RUN_HEADERS, run_list_cells(runs)), ""]
    if commands:
        lines += ["## Commands", "", "```bash"] + commands + ["```", ""]
    path.write_text("\n".join(lines))
    return path
