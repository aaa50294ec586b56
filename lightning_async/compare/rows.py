"""The gap table's rows: which runs form a row, and the row's statistics over seeds.

Rows are groups of runs that differ only in the mode and correction (and the seed): one row per
optimizer, per (optimizer, lr) when an optimizer was run at several learning rates, and per delay,
delay profile and correction strength when a study swept those. Every run of a row is read at the
same optimizer step, the row's ``step``: the last step at which all its runs logged ``val/loss``
(runs of different lengths are compared where they overlap, with a warning). Diverged runs are
marked, never averaged. For each row:

* ``sync``, ``async``, ``async+EF``, ``async+<correction>``: ``val/loss`` at ``step`` per seed, summarised
  as mean and sample standard deviation (one column per correction some run applies; none without corrected runs);
* ``gap = async - sync``, paired by seed: the mean of the per-seed gaps with its Student t interval
  (:func:`~lightning_async.compare.statistics.mean_interval`, 95%);
* ``<correction> recovered = (async - async+<correction>) / (async - sync)`` on the means of the seeds that
  ran all three modes, with Fieller's interval for that ratio of paired means
  (:func:`~lightning_async.compare.statistics.ratio_interval`): 1 means the correction closes the whole gap,
  0 that it does nothing, negative that it hurts. "n/a" when a mode is missing, the gap is ~0, or (with 2+
  seeds) the gap's own interval includes 0: the share of a gap not told apart from zero has no bounded
  interval, so no number is shown for it.

How the rows are printed is :mod:`lightning_async.compare.render`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from lightning_async.compare.events import ASYNC, ASYNC_EF, SYNC, CompareError, Run, optimizer_step
from lightning_async.compare.selection import describe_slot, lr_key
from lightning_async.compare.statistics import (
    LEVEL,
    Interval,
    Stat,
    mean_interval,
    paired_differences,
    ratio_interval,
    stat,
)
from lightning_async.identity import EF, correction_category, correction_order


#: |gap| below this (absolute, in loss units) counts as "no gap": the recovered share is n/a.
GAP_TOLERANCE = 1e-4


def _usable(run: Run) -> bool:
    return not run.diverged and bool(run.val_steps)


@dataclass
class Row:
    """One line of the gap table.

    ``strengths`` holds the strength of each correction whose runs are in the row; ``corrections`` the
    table's correction columns (``ef`` first; empty when no run applies a correction); ``varied`` the corrections
    whose strength the label shows. ``step`` is the TensorBoard step the row is read at (Lightning's: the optimizer
    step minus one); ``optimizer_step`` the step a table shows.
    """

    optimizer: str
    lr: float | None = None
    delay: int | None = None
    delay_profile: str | None = None
    strengths: dict[str, float] = field(default_factory=dict)
    corrections: tuple[str, ...] = ()
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

    @property
    def optimizer_step(self) -> int | None:
        """:attr:`step` as the runs count it (TensorBoard step 299 is the validation after step 300)."""
        return optimizer_step(self.step)

    def last_steps(self) -> dict[str, list[int]]:
        """category -> the distinct last ``val/loss`` steps (TensorBoard's) of its usable runs."""
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
        return stat(list(self.losses(category).values()))

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

    # ---- derived: paired by seed ---------------------------------------------------------------
    def _paired(self, *categories: str) -> list[dict[str, float]]:
        tables = [self.losses(c) for c in categories]
        common = set(tables[0]).intersection(*tables[1:])
        return [{c: t[s] for c, t in zip(categories, tables)} for s in sorted(common, key=lambda s: (s is None, s))]

    @property
    def gap(self) -> float | None:
        """The mean of the per-seed gaps ``async - sync`` over the seeds that ran both (the difference of the two
        means when no seed ran both), or None when a mode is missing."""
        if self.sync is None or self.async_ is None:
            return None
        seeds = self.gap_seeds
        return seeds.mean if seeds is not None else self.async_.mean - self.sync.mean

    @property
    def gap_pct(self) -> float | None:
        if self.gap is None or self.sync.mean == 0:
            return None
        return 100.0 * self.gap / self.sync.mean

    @property
    def gap_seeds(self) -> Stat | None:
        """Per-seed gaps (seeds present in both sync and async)."""
        return stat(paired_differences(self.losses(ASYNC), self.losses(SYNC)))

    def gap_interval(self, level: float = LEVEL) -> Interval | None:
        """The t interval of the mean per-seed gap (None with fewer than two paired seeds)."""
        seeds = self.gap_seeds
        return None if seeds is None else mean_interval(seeds.values, level)

    @property
    def gap_is_zero(self) -> bool:
        return self.gap is not None and abs(self.gap) < self.gap_tolerance

    @property
    def gap_within_noise(self) -> bool:
        """With 2+ paired seeds: the gap's 95% t interval includes 0 (the delay's cost is not told apart from
        seed noise)."""
        interval = self.gap_interval()
        return self.gap is not None and interval is not None and not interval.excludes(0.0)

    def _share_terms(self, correction: str) -> tuple[list[float], list[float]]:
        """Per seed (seeds that ran sync, async and async+<correction>): ``async - corrected`` and ``async - sync``."""
        category = correction_category(correction)
        paired = self._paired(SYNC, ASYNC, category)
        return [p[ASYNC] - p[category] for p in paired], [p[ASYNC] - p[SYNC] for p in paired]

    def recovered_by(self, correction: str) -> float | None:
        """(mean async - mean async+<correction>) / (mean async - mean sync) over the seeds that ran the three
        modes; None when n/a (a mode missing, the gap ~0 or within seed noise)."""
        won, gaps = self._share_terms(correction)
        if not gaps or self.gap is None or self.gap_is_zero or self.gap_within_noise:
            return None
        gap = sum(gaps) / len(gaps)
        return None if abs(gap) < self.gap_tolerance else sum(won) / len(won) / gap

    def recovered_interval_by(self, correction: str, level: float = LEVEL) -> Interval | None:
        """Fieller's interval of :meth:`recovered_by` (None with fewer than two seeds or when the share is n/a)."""
        if self.recovered_by(correction) is None:
            return None
        won, gaps = self._share_terms(correction)
        return ratio_interval(won, gaps, level)

    def recovered_n(self, correction: str) -> int:
        """How many seeds ran sync, async and async+<correction> (the n of the recovered share)."""
        return len(self._share_terms(correction)[1])

    def recovered_seeds_by(self, correction: str) -> Stat | None:
        """Per-seed recovered shares of ``correction`` (seeds present in sync, async and async+<correction>,
        whose own gap is positive: the share of a negative gap has the opposite meaning)."""
        won, gaps = self._share_terms(correction)
        return stat([w / g for w, g in zip(won, gaps) if g >= self.gap_tolerance])

    def difference(self, category: str, baseline: str, level: float = LEVEL) -> tuple[Stat, Interval | None] | None:
        """Per-seed ``loss(category) - loss(baseline)`` (seeds in both) and its t interval; None without a
        common seed. Negative: ``category`` ends lower."""
        values = stat(paired_differences(self.losses(category), self.losses(baseline)))
        return None if values is None else (values, mean_interval(values.values, level))

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
            parts.append(f"lr={format_setting(self.lr)}")
        if self.show_delay:
            parts.append(f"delay={self.delay}")
        if self.show_profile:
            parts.append(f"profile={self.delay_profile}")
        for correction in self.varied:
            if correction in self.strengths:
                parts.append(f"{'EF' if correction == EF else correction}={format_setting(self.strengths[correction])}")
        return " ".join(parts)

    def present(self, category: str) -> bool:
        """Has runs with a result for ``category``: a val/loss, or a divergence (a result too)."""
        return bool(self.usable_runs(category) or self.diverged_runs(category))

    @property
    def comparable(self) -> bool:
        return self.present(SYNC) and any(self.present(c) for c in self.categories[1:])

    def missing(self) -> list[str]:
        return [c for c in self.categories if not self.present(c)]


def format_setting(x: float | None) -> str:
    """A setting as a table shows it (``default`` for None)."""
    return "default" if x is None else f"{x:g}"


def table_corrections(runs: list[Run]) -> tuple[str, ...]:
    """The correction columns of a table of ``runs``: each correction some run applies (``ef`` first); none when no
    run applies one (two runs, sync and async, make a table of sync, async and the gap)."""
    return tuple(correction_order([r.identity.correction for r in runs if r.identity.corrected]))


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
                            f"{row.optimizer_step}, the last step at which every run of the row logged val/loss")
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
    return ", ".join(f"{c} {'/'.join(str(optimizer_step(s)) for s in steps)}" for c, steps in ends.items())
