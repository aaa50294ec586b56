"""Which asynchronous schedule, optimizer and correction the family study supports: the smallest measured gap to
sync, and which others the paired intervals cannot tell from it.

The measurements are the family study's runs (docs/results.md, C7: ``nano`` at 21 tokens per parameter, every
delayed run paired by seed with the sync run of its optimizer and seed), summarised with the depth study's code
(:mod:`lightning_async.tools.depth_study`) and shipped as ``family_findings.json`` beside this module::

    python -m lightning_async.tools.family_advice studies --rows lightning_async/tools/family_findings.json \\
        --json lightning_async/tools/family_findings.json

It reads the study folders ``family-2bw`` (sync, 2BW), ``family-wpipe-2``, ``family-pipedream-4`` and
``family-paci-4``. A configuration is ``(optimizer, schedule, correction)``; the gaps of two configurations are
compared per seed (the same seed fixes the initialisation and the data order for every optimizer), and one is
"behind" the best only where the 95% t interval of the difference lies above zero; otherwise the two are "not told
apart". ``probe`` and ``plan --compare`` print :func:`family_advice`.

``--vocabulary bpe`` reads the same study on the BPE-1024 ``nano`` instead (``recipes/study/family/bpe-*.yaml``:
the folders ``family-bpe-2bw``, ``family-bpe-wpipe-2``, ...), shipped as ``family_findings_bpe.json``; the advice
adds each optimizer's ranking there, so a team sees whether it holds with a subword vocabulary.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_async.compare.statistics import Interval, mean_interval, paired_differences
from lightning_async.tools import depth_study
from lightning_async.tools.depth_study import SeedRow

FINDINGS = Path(__file__).with_name("family_findings.json")
BPE_FINDINGS = Path(__file__).with_name("family_findings_bpe.json")
_PROFILE = r"(?P<profile>2bw|(?:wpipe|pipedream|paci)-\d+)"
#: the family study's folders by the vocabulary of its model: byte-level ``nano`` (C7) or the BPE-1024 ``nano``
FAMILY_FOLDERS = {"byte": re.compile(rf"^family-{_PROFILE}$"), "bpe": re.compile(rf"^family-bpe-{_PROFILE}$")}
FAMILY_FOLDER = FAMILY_FOLDERS["byte"]
SOURCE = "docs/results.md C7: nano, 21 tokens per parameter, seeds paired"
BPE_SOURCE = "C7b, 20 tokens per parameter"
CORRECTION_NAMES = {"none": "no correction", "ef": "EF"}


@dataclass(frozen=True)
class Measured:
    """One configuration's per-seed gaps to the sync run of its seed."""

    optimizer: str
    schedule: str
    correction: str
    gaps: dict[int, float]

    @property
    def gap(self) -> float:
        return statistics.fmean(self.gaps.values())

    @property
    def label(self) -> str:
        return f"{self.optimizer} + {self.schedule} + {CORRECTION_NAMES.get(self.correction, self.correction)}"

    def describe(self) -> str:
        interval = mean_interval(list(self.gaps.values()))
        ci = interval.describe() if interval is not None else "one seed"
        return f"{self.label}: {self.gap:+.3f} ({ci})"


def load_rows(path: Path = FINDINGS) -> list[SeedRow]:
    """The shipped per-seed rows of the family study (``BPE_FINDINGS``: on the BPE-1024 ``nano``; an empty list when
    there are none)."""
    return depth_study.read_rows(path) if path.is_file() else []


def configurations(rows: Iterable[SeedRow]) -> list[Measured]:
    """Every ``(optimizer, schedule, correction)`` of ``rows`` with its per-seed gaps, smallest mean gap first."""
    found: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in rows:
        found.setdefault((r.optimizer, r.profile, r.correction), {})[r.seed] = r.gap
    return sorted((Measured(*key, gaps) for key, gaps in found.items()), key=lambda m: m.gap)


def difference(first: Measured, second: Measured) -> tuple[float, Interval | None]:
    """``first``'s gap minus ``second``'s over their common seeds, with its 95% paired t interval (None: < 2 seeds)."""
    differences = paired_differences(first.gaps, second.gaps)
    return statistics.fmean(differences) if differences else float("nan"), mean_interval(differences)


def ranking(candidates: Sequence[Measured]) -> tuple[Measured, list[Measured], list[tuple[Measured, Interval]]]:
    """The best of ``candidates`` (smallest mean gap), those not told apart from it (no paired interval, or one that
    includes 0), and those behind it with the interval of their excess gap (above 0)."""
    best, *others = sorted(candidates, key=lambda m: m.gap)
    tied, behind = [], []
    for other in others:
        mean, interval = difference(other, best)
        if interval is not None and interval.excludes(0.0) and mean > 0:
            behind.append((other, interval))
        else:
            tied.append(other)
    return best, tied, behind


def _ranked_text(candidates: Sequence[Measured], listed_behind: int | None = None) -> str:
    """The best of ``candidates``, those not told apart from it, and those behind it (the nearest ``listed_behind``
    of them by name and the rest as a count; all when None)."""
    best, tied, behind = ranking(candidates)
    text = f"smallest gap {best.describe()}"
    if tied:
        text += "; not told apart from it: " + ", ".join(f"{m.label} ({m.gap:+.3f})" for m in tied)
    if behind:
        named = behind if listed_behind is None else behind[:listed_behind]
        text += "; behind it (paired interval above 0): " + ", ".join(
            f"{m.label} (+{m.gap - best.gap:.3f}, {i.describe()})" for m, i in named)
        if len(named) < len(behind):
            text += f" and {len(behind) - len(named)} more"
    return text


def family_advice(optimizers: Iterable[str] | None = None, rows: Sequence[SeedRow] | None = None,
                  bpe_rows: Sequence[SeedRow] | None = None) -> str:
    """Lines of advice: across every measured schedule x optimizer x correction, the smallest gap to sync (each
    optimizer's own) and what the paired intervals tell apart from it; then the same for each of ``optimizers``
    alone (default: every measured one), or that it is not measured; then, for each of them measured on the BPE-1024
    ``nano`` (``bpe_rows``), its ranking there. Without ``rows``, both come from the shipped findings."""
    if rows is None:
        rows, bpe_rows = load_rows(), load_rows(BPE_FINDINGS) if bpe_rows is None else bpe_rows
    found = configurations(rows)
    if not found:
        return "the asynchronous family's quality is not measured (no findings file)."
    measured = list(dict.fromkeys(m.optimizer for m in sorted(found, key=lambda m: m.optimizer)))
    lines = [f"schedule x optimizer x correction ({SOURCE}; gaps to each optimizer's own sync run): "
             f"{_ranked_text(found, listed_behind=1)}."]
    asked = measured if optimizers is None else list(optimizers)
    for optimizer in asked:
        mine = [m for m in found if m.optimizer == optimizer]
        if mine:
            lines.append(f"{optimizer} alone: {_ranked_text(mine)}.")
        else:
            lines.append(f"{optimizer}: not measured in the family study (measured: {', '.join(measured)}).")
    on_bpe = configurations(bpe_rows or [])
    for optimizer in asked:
        mine = [m for m in on_bpe if m.optimizer == optimizer]
        if mine:
            lines.append(f"{optimizer} alone on the BPE-1024 nano ({BPE_SOURCE}): {_ranked_text(mine)}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the family study's findings (the depth study's tables over the ``family-*`` folders, or with
    ``--vocabulary bpe`` the ``family-bpe-*`` ones)."""
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--vocabulary", choices=sorted(FAMILY_FOLDERS), default="byte")
    chosen, rest = chooser.parse_known_args(argv)
    folders = "family-*" if chosen.vocabulary == "byte" else f"family-{chosen.vocabulary}-*"
    return depth_study.main(rest, pattern=FAMILY_FOLDERS[chosen.vocabulary], folders=folders,
                            prog="python -m lightning_async.tools.family_advice [--vocabulary {byte,bpe}]",
                            description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
