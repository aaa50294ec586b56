"""The paper's numbers (Zmushko et al. 2026, arXiv 2606.30634) as data, each with where it comes from.

Two sources, kept apart because they are not equally strong (``docs/compare.md``, "The paper's numbers"):

* ``paper-summary``: SmolLM2-360M on FineWeb-Edu, final validation losses (sync, async, async + EF) as given by a
  machine-written summary of the paper, i.e. the paper's own table values at second hand;
* ``news``: a news article on the paper (the project's founding document), not the paper's tables. It gives only
  statements ("under 0.03", "degrades like AdamW", "EF recovers 85-90%"), which every table marks as such.

``compare --paper`` renders these next to a study's rows; ``docs/results.md`` quotes them with the same marks.
"""

from __future__ import annotations

from dataclasses import dataclass

PAPER_SUMMARY = "paper-summary"
NEWS = "news"

#: source key -> how a table names it (the mark and its footnote)
SOURCES: dict[str, str] = {
    PAPER_SUMMARY: "the paper's SmolLM2-360M table values, as given by a machine-written summary of the paper",
    NEWS: "a news article on the paper, not the paper's tables (a statement, no loss values)",
}
#: the mark a table puts after a value of each source
MARKS: dict[str, str] = {PAPER_SUMMARY: "", NEWS: " (news summary, not the paper's tables)"}


@dataclass(frozen=True)
class PaperResult:
    """One optimizer's result in the paper: losses where the source gives them, else the source's statement."""

    optimizer: str
    source: str
    sync: float | None = None
    async_: float | None = None
    async_ef: float | None = None
    gap_statement: str | None = None  # what the source says of the gap when it gives no losses
    ef_statement: str | None = None  # what the source says of EF's share when it gives no async+EF loss

    @property
    def has_losses(self) -> bool:
        return self.sync is not None and self.async_ is not None

    @property
    def gap(self) -> float | None:
        return self.async_ - self.sync if self.has_losses else None

    @property
    def ef_recovered(self) -> float | None:
        """(async - async+EF) / (async - sync) from the losses (None when a loss is missing or the gap is 0)."""
        if not self.has_losses or self.async_ef is None or self.gap == 0:
            return None
        return (self.async_ - self.async_ef) / self.gap

    @property
    def mark(self) -> str:
        return MARKS[self.source]


#: every optimizer the paper reports on; losses in nats per token (SmolLM2-360M, ~20 tokens per parameter)
PAPER_RESULTS: tuple[PaperResult, ...] = (
    PaperResult("adamw", PAPER_SUMMARY, 2.612, 2.890, 2.640),
    PaperResult("muon", PAPER_SUMMARY, 2.578, 2.590, 2.583),
    PaperResult("soap", PAPER_SUMMARY, 2.581, 2.608, 2.590),
    PaperResult("adan", PAPER_SUMMARY, 2.641, 2.651, None),
    PaperResult("mars", NEWS, gap_statement="degrades like AdamW", ef_statement="85-90%"),
    PaperResult("normuon", NEWS, gap_statement="under 0.03", ef_statement="50-70%"),
    PaperResult("lion", NEWS, gap_statement="under 0.03", ef_statement="50-70%"),
)

PAPER_BY_OPTIMIZER: dict[str, PaperResult] = {r.optimizer: r for r in PAPER_RESULTS}

#: (sync, async, async+EF) of the optimizers whose losses the source gives (the older name for the numbers)
PAPER_REFERENCE: dict[str, tuple[float, float, float | None]] = {
    r.optimizer: (r.sync, r.async_, r.async_ef) for r in PAPER_RESULTS if r.has_losses
}
