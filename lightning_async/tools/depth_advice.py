"""What the depth study supports for a pipeline of ``p`` stages: the delay profile (2BW's constant one step,
or PipeDream's ``p - 1 - s``) and the correction, said only for what was measured.

The measurements are the paired summaries of :mod:`lightning_async.tools.depth_study` (every seed's gap to the sync
run of its seed, the mean with its 95% paired t interval, and the paired differences between configurations),
shipped as ``depth_findings.json`` beside this module (docs/results.md, Part D, has the command that produced it).
``probe --stages P`` and ``plan --compare`` print :func:`depth_advice` for their stage counts. A recommendation is
"established" only where the paired interval of the best configuration against the runner-up (and against the
best of the other delay profile) excludes zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning_async.tools.depth_study import (
    Comparison,
    DepthRow,
    SeedRow,
    find_comparison,
    load_summaries,
    optimizers_compared,
    read_rows,
)

FINDINGS = Path(__file__).with_name("depth_findings.json")
#: AdamW and SOAP rerun at their sync-tuned lrs on the study's model (docs/results.md, Part D, Table 4); the main
#: findings use the lrs tuned on a smaller model, below those optima
TUNED_FINDINGS = Path(__file__).with_name("depth_findings_tuned.json")
SOURCE = "docs/results.md, Depth, at the lrs tuned on nano"
TUNED_SOURCE = "at each optimizer's sync-tuned lr on the study's model, docs/results.md, Depth, Table 4"


def load_findings(path: Path = FINDINGS) -> list[DepthRow]:
    """The shipped depth-study summaries (an empty list when there are none)."""
    return load_summaries(path)[0] if path.is_file() else []


def load_comparisons(path: Path = FINDINGS) -> list[Comparison]:
    """The shipped paired differences between configurations (an empty list when there are none)."""
    return load_summaries(path)[1] if path.is_file() else []


def load_seed_rows(path: Path = FINDINGS) -> list[SeedRow]:
    """The shipped per-seed rows (an empty list when there are none)."""
    return read_rows(path) if path.is_file() else []


def optimizer_advice(stages: int, rows: Sequence[SeedRow] | None = None,
                     tuned_rows: Sequence[SeedRow] | None = None) -> str | None:
    """Across optimizers, under PipeDream's profile at ``stages`` without a correction: the optimizer with the
    smallest mean gap to its own sync run, and against each other one measured there whether the paired difference
    (by seed) is established; then the same for the rows measured at each optimizer's sync-tuned lr
    (``tuned_rows``, default the shipped :data:`TUNED_FINDINGS`) where they cover that profile. ``None`` when
    neither has two optimizers measured at that profile."""
    profile = f"pipedream-{stages}"
    texts = [optimizers_compared(load_seed_rows() if rows is None else rows, profile, SOURCE),
             optimizers_compared(load_seed_rows(TUNED_FINDINGS) if tuned_rows is None else tuned_rows, profile,
                                 TUNED_SOURCE)]
    found = [t for t in texts if t is not None]
    return f"p={stages}, " + " Then ".join(found) if found else None


def _label(row: DepthRow) -> str:
    correction = {"none": "no correction", "ef": "Error Feedback (k-step form)", "ef-one-step": "one-step EF"}
    return f"{row.profile} + {correction.get(row.correction, row.correction)}"


def _describe(row: DepthRow) -> str:
    interval = row.gap_interval
    ci = f", 95% CI {interval.low:+.3f} to {interval.high:+.3f}" if interval else ", one seed: no interval"
    return f"{_label(row)}: gap to sync {row.gap:+.3f}{ci}, n={row.seeds}"


def _verdict(best: DepthRow, other: DepthRow, compared: Sequence[Comparison], name: str) -> str:
    """``established: ...`` when the paired interval of ``best - other`` lies below zero; otherwise ``not
    established: ...`` and why."""
    found = find_comparison(list(compared), best.optimizer, (best.profile, best.correction),
                            (other.profile, other.correction))
    if found is None:
        return f"not established: fewer than two seeds in common with {name}, no paired interval; more seeds would settle it."
    mean, interval = found
    said = f"best minus {name} {mean:+.3f} ({interval.describe()}, paired by seed)"
    if interval.below(0.0):
        return f"established: {said}."
    return f"not established: {said} includes 0; more seeds would settle it."


def depth_advice(stages: int, findings: Sequence[DepthRow] | None = None, optimizer: str = "adamw",
                 comparisons: Sequence[Comparison] | None = None) -> str:
    """One paragraph for ``stages`` pipeline stages: the measured profile and correction with the smallest mean gap
    to sync, with the runner-up and whether the paired difference of the two is established (and, when the
    runner-up has the same profile, the same against the best of the other profile), or what is not measured. Without ``findings`` the shipped summaries and comparisons are read; ``comparisons`` default to the
    shipped ones then, and to none when ``findings`` are given."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive number of pipeline stages, got {stages!r}")
    if stages == 1:
        return "p=1: one stage, no pipeline staleness (nothing to correct)."
    if findings is None:
        findings, comparisons = load_findings(), load_comparisons() if comparisons is None else comparisons
    rows = [r for r in findings if r.optimizer == optimizer]
    measured = sorted({int(r.profile.split("-")[1]) for r in rows if r.profile.startswith("pipedream-")})
    candidates = [r for r in rows if r.profile in ("2bw", f"pipedream-{stages}")]
    if not candidates:
        return f"p={stages}: the depth study has no {optimizer} measurement ({SOURCE})."
    best, *others = sorted(candidates, key=lambda r: r.gap)
    lead = "lowest measured gap" if others else "the only measurement"
    text = f"p={stages} ({optimizer}, {SOURCE}): {lead}: {_describe(best)}"
    if others:
        text += f"; runner-up {_describe(others[0])}"
    if f"pipedream-{stages}" not in {r.profile for r in rows}:
        text += f". PipeDream's profile at p={stages} is not measured (measured p: {', '.join(map(str, measured)) or 'none'})"
    if not others:
        return text + "."
    verdict = _verdict(best, others[0], comparisons or (), "the runner-up")
    text += ". " + verdict[0].upper() + verdict[1:]
    rival = next((r for r in others if r.profile != best.profile), None)
    if rival is not None and rival is not others[0]:
        text += f" Against the best of {rival.profile} ({_label(rival)}, gap {rival.gap:+.3f}): "
        text += _verdict(best, rival, comparisons or (), rival.profile)
    return text


def depth_advice_lines(stages: Iterable[int], optimizer: str = "adamw") -> str:
    """:func:`depth_advice` for each stage count, one per line, each followed by :func:`optimizer_advice` where
    several optimizers were measured (what ``plan`` prints)."""
    findings, comparisons, rows = load_findings(), load_comparisons(), load_seed_rows()
    lines = []
    for p in stages:
        lines.append(depth_advice(p, findings, optimizer, comparisons))
        across = optimizer_advice(p, rows) if p > 1 else None
        if across is not None:
            lines.append(across)
    return "\n".join(lines)
