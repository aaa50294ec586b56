"""What the depth study supports for a pipeline of ``p`` stages: the delay profile (2BW's constant one step,
or PipeDream's ``p - 1 - s``) and the correction, said only for what was measured.

The measurements are the rows of :mod:`lightning_async.tools.depth_study`, shipped as ``depth_findings.json``
beside this module (docs/results.md, "Depth", has the commands that produced them). ``probe --stages P`` and
``plan --compare`` print :func:`depth_advice` for their stage counts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning_async.tools.depth_study import DepthRow

FINDINGS = Path(__file__).with_name("depth_findings.json")
SOURCE = "docs/results.md, Depth"


def load_findings(path: Path = FINDINGS) -> list[DepthRow]:
    """The shipped depth-study rows (an empty list when there are none)."""
    if not path.is_file():
        return []
    return [DepthRow(**row) for row in json.loads(path.read_text())]


def _label(row: DepthRow) -> str:
    correction = {"none": "no correction", "ef": "Error Feedback (k-step form)", "ef-one-step": "one-step EF"}
    return f"{row.profile} + {correction.get(row.correction, row.correction)}"


def _describe(row: DepthRow) -> str:
    ci = f", 95% CI {row.gap_low:+.3f} to {row.gap_high:+.3f}" if row.gap_low is not None else ", one seed: no interval"
    return f"{_label(row)}: gap to sync {row.gap:+.3f}{ci}, n={row.seeds}"


def depth_advice(stages: int, findings: Sequence[DepthRow] | None = None, optimizer: str = "adamw") -> str:
    """One paragraph for ``stages`` pipeline stages: the measured profile and correction with the smallest gap to
    sync, with the runner-up, or what is not measured."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive number of pipeline stages, got {stages!r}")
    if stages == 1:
        return "p=1: one stage, no pipeline staleness (nothing to correct)."
    rows = [r for r in (load_findings() if findings is None else findings) if r.optimizer == optimizer]
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
    significant = best.gap_high is not None and others[0].gap_low is not None and best.gap_high < others[0].gap_low
    text += ". " + ("The two intervals do not overlap." if significant else
                    "Not established: the intervals overlap or are missing; more seeds would settle it.")
    return text


def depth_advice_lines(stages: Iterable[int], optimizer: str = "adamw") -> str:
    """:func:`depth_advice` for each stage count, one per line (what ``plan --compare`` prints)."""
    findings = load_findings()
    return "\n".join(depth_advice(p, findings, optimizer) for p in stages)
