"""Which correction recovers most of the async gap, per optimizer, and whether it is significantly the best
(for ``probe`` and reports).

:func:`best_corrections` ranks by the recovered share alone; :func:`recommend` adds the paired tests that a
recommendation needs: the best correction must end lower than both the plain delayed run and the runner-up, each
difference's 95% t interval (seeds paired) lying below zero.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_async.compare.events import ASYNC
from lightning_async.compare.rows import Row
from lightning_async.compare.statistics import LEVEL, Interval
from lightning_async.identity import correction_category


@dataclass(frozen=True)
class BestCorrection:
    """The correction of an optimizer that recovers the largest share of the gap, as its table column shows it.

    ``mean`` is the column's value, the share on the seed means, ``(mean async - mean async+<c>) / (mean async -
    mean sync)``; ``std`` and ``n`` are over the per-seed shares (``std`` None with fewer than two seeds, ``n`` 0
    when no seed ran all three modes).
    """

    optimizer: str
    correction: str
    row: str  # the label of the row it was measured in
    mean: float
    std: float | None
    n: int


def best_corrections(rows: list[Row]) -> dict[str, BestCorrection]:
    """optimizer -> its best correction: the highest recovered share over all its rows and correction columns.

    Optimizers where no correction has a share (a mode missing, a gap of ~0) are left out; of equal shares
    the first in the table's order (rows, then columns with ``ef`` first) wins.
    """
    best: dict[str, BestCorrection] = {}
    for row in rows:
        for correction in row.corrections:
            share = row.recovered_by(correction)
            if share is None:
                continue
            current = best.get(row.optimizer)
            if current is None or share > current.mean:
                seeds = row.recovered_seeds_by(correction)
                best[row.optimizer] = BestCorrection(
                    row.optimizer, correction, row.label, share, seeds.std if seeds else None, seeds.n if seeds else 0,
                )
    return best


@dataclass(frozen=True)
class Comparison:
    """Per-seed ``loss(a) - loss(b)`` summarised: its mean, its t interval (None with one seed) and n.
    Negative: ``a`` ends lower."""

    mean: float
    interval: Interval | None
    n: int

    @property
    def significant(self) -> bool:
        """``a`` ends lower than ``b`` at the interval's level: the whole interval lies below 0."""
        return self.interval is not None and self.interval.below(0.0)

    def describe(self) -> str:
        """``-0.0123 (95% CI -0.0200 to -0.0046, n=3)``."""
        if self.interval is None:
            return f"{self.mean:+.4f} (n={self.n}, no interval)"
        return f"{self.mean:+.4f} ({self.interval.describe('{:+.4f}')})"


@dataclass(frozen=True)
class Recommendation:
    """The verdict on the corrections of one optimizer: the best one (lowest mean loss relative to the plain delayed
    run, paired by seed), the runner-up, and the paired comparisons that decide whether to recommend the best.

    ``significant``: the best correction ends lower than both "no correction" (the delayed run) and the runner-up
    at the intervals' level (95%). Only then is it recommended; otherwise the verdict is "no significant difference".
    """

    optimizer: str
    row: str
    best: str
    runner_up: str | None
    vs_none: Comparison
    vs_runner_up: Comparison | None
    share: float | None
    share_interval: Interval | None
    share_n: int

    @property
    def significant(self) -> bool:
        return self.vs_none.significant and (self.vs_runner_up is None or self.vs_runner_up.significant)

    def share_text(self) -> str:
        """``it recovers 88% (95% CI 66% to 106%, n=3) of the gap`` (or why the share is n/a)."""
        if self.share is None:
            return "its share of the gap is n/a (no gap told apart from seed noise)"
        interval = self.share_interval
        bounds = f" ({interval.scaled(100).describe('{:.0f}', '%')})" if interval else f" (n={self.share_n}, no interval)"
        return f"it recovers {100 * self.share:.0f}%{bounds} of the gap"

    def describe(self, how: str | None = None) -> str:
        """The verdict in one paragraph: "Recommendation: <c>" only when :attr:`significant` (``how``: how to turn it
        on, appended in brackets), else "No significant difference" (or "no correction" when the best one does not
        lower the loss), always with the paired differences and their intervals."""
        versus = f"{self.vs_none.describe()} against no correction"
        if self.vs_runner_up is not None:
            versus += f" and {self.vs_runner_up.describe()} against the runner-up, {self.runner_up}"
        if self.significant:
            return (f"Recommendation: {self.best}: its final loss differs by {versus}, both below zero at 95%; "
                    f"{self.share_text()}" + (f" ({how})." if how else "."))
        if self.vs_none.mean >= 0:
            head = f"Recommendation: no correction: the best one tried, {self.best}, does not lower the final loss"
        else:
            head = (f"No significant difference: the best correction tried, {self.best}, does not end lower than both "
                    "no correction and the runner-up at 95%")
        if self.vs_none.interval is None:
            need = "one seed gives no interval; rerun with --seeds 3 (or more) to tell the corrections apart"
        else:
            need = "a recommendation needs both intervals below zero; more seeds narrow them"
        return f"{head} (final loss {versus}; {self.share_text()}); {need}."


def _comparison(row: Row, category: str, baseline: str, level: float) -> Comparison | None:
    found = row.difference(category, baseline, level)
    return None if found is None else Comparison(found[0].mean, found[1], found[0].n)


def recommend_in_row(row: Row, level: float = LEVEL) -> Recommendation | None:
    """:class:`Recommendation` for one row (None when no correction has a run paired with a delayed run)."""
    measured = [(c, _comparison(row, correction_category(c), ASYNC, level)) for c in row.corrections]
    ranked = sorted(((c, cmp) for c, cmp in measured if cmp is not None), key=lambda item: item[1].mean)
    if not ranked:
        return None
    (best, vs_none), runner_up = ranked[0], (ranked[1][0] if len(ranked) > 1 else None)
    vs_runner_up = None
    if runner_up is not None:
        vs_runner_up = _comparison(row, correction_category(best), correction_category(runner_up), level)
    return Recommendation(
        optimizer=row.optimizer, row=row.label, best=best, runner_up=runner_up, vs_none=vs_none,
        vs_runner_up=vs_runner_up, share=row.recovered_by(best), share_interval=row.recovered_interval_by(best, level),
        share_n=row.recovered_n(best),
    )


def recommend(rows: list[Row], level: float = LEVEL) -> dict[str, Recommendation]:
    """optimizer -> :class:`Recommendation` from the row where its best correction ends lowest relative to the
    delayed run (rows of one optimizer differ in lr, delay or strengths)."""
    out: dict[str, Recommendation] = {}
    for row in rows:
        found = recommend_in_row(row, level)
        if found is not None and (row.optimizer not in out or found.vs_none.mean < out[row.optimizer].vs_none.mean):
            out[row.optimizer] = found
    return out
