"""Which correction recovers most of the async gap, per optimizer (for ``probe`` and reports)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_async.compare.report import Row


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
