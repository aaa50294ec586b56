"""The depth study's table (docs/results.md, "Depth"): per delay profile and correction, the final validation
loss gap to the sync run, the share of the plain delay's gap a correction recovers, and the paper's slowdown
measure (how many steps the sync run needed to reach each run's final loss; ``>=`` when the sync run was already
below it at its first validation), seeds paired with the sync run::

    python -m lightning_async.tools.depth_study studies --json depth.json

It reads the run folders of the depth studies (``recipes/study/evidence/depth-*.yaml``): a study folder named
``evidence-depth-2bw`` (sync, 2BW's constant delay) or ``evidence-depth-pipedream-<p>``, runs named
``<optimizer>-<mode>-lr<lr>-s<seed>`` with a ``DONE`` file. Unfinished runs are left out and counted.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from lightning_async.compare.events import read_scalars
from lightning_async.compare.statistics import mean_interval
from lightning_async.identity import DONE_FILE

STUDY_FOLDER = re.compile(r"^evidence-depth-(?P<profile>2bw|pipedream-\d+)$")
RUN_NAME = re.compile(r"^(?P<optimizer>[a-z0-9]+)-(?P<mode>sync|delayed(?:-[a-z-]+)?)-lr[^-]+-s(?P<seed>\d+)$")
#: study mode -> the correction it applies (``delayed-ef`` is EF's k-step form: one step under 2BW)
CORRECTIONS = {"delayed": "none", "delayed-ef": "ef", "delayed-ef-one-step": "ef-one-step"}
VAL_LOSS = "val/loss"

Curve = list[tuple[int, float]]


@dataclass(frozen=True)
class DepthRow:
    """One profile and correction against the sync run, over the seeds both have."""

    optimizer: str
    profile: str  # "2bw" or "pipedream-<p>"
    correction: str  # "none", "ef" (the k-step form), "ef-one-step"
    seeds: int
    gap: float  # mean final validation loss minus sync's
    gap_low: float | None  # its 95% paired interval (None with one seed)
    gap_high: float | None
    recovered: float | None  # 1 - gap / the plain delay's gap, means over the seeds both have (None: no plain run)
    slowdown: float | None  # mean of final step / the step the sync run reached this run's final loss
    slowdown_is_bound: bool = False  # some seed's sync run was below it at its first validation: a lower bound


def collect(root: Path) -> tuple[dict[tuple[str, str, str], dict[int, Curve]], int]:
    """Finished runs' validation curves by ``(optimizer, profile, mode)`` and seed, and how many were unfinished."""
    runs: dict[tuple[str, str, str], dict[int, Curve]] = defaultdict(dict)
    unfinished = 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and STUDY_FOLDER.match(p.name)):
        profile = STUDY_FOLDER.match(folder.name)["profile"]
        for run in sorted(p for p in (folder / "runs").glob("*") if p.is_dir()):
            name = RUN_NAME.match(run.name)
            if name is None:
                continue
            if not (run / DONE_FILE).exists():
                unfinished += 1
                continue
            curve = sorted(read_scalars(run).get(VAL_LOSS, []))
            if curve:
                runs[(name["optimizer"], profile, name["mode"])][int(name["seed"])] = curve
    return runs, unfinished


def steps_to_reach(curve: Curve, loss: float) -> float | None:
    """The first step at which ``curve`` (linearly interpolated) is at or below ``loss``; None if it never is."""
    previous = None
    for step, value in curve:
        if value <= loss:
            if previous is None or previous[1] == value:
                return float(step)
            (s0, v0) = previous
            return s0 + (step - s0) * (v0 - loss) / (v0 - value)
        previous = (step, value)
    return None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def depth_rows(runs: dict[tuple[str, str, str], dict[int, Curve]]) -> list[DepthRow]:
    """:class:`DepthRow` for every delayed ``(optimizer, profile, mode)`` with a sync run of the same optimizer."""
    rows = []
    for (optimizer, profile, mode), by_seed in sorted(runs.items(), key=lambda kv: _order(kv[0])):
        sync = runs.get((optimizer, "2bw", "sync"), {})
        seeds = sorted(set(by_seed) & set(sync))
        if mode not in CORRECTIONS or not seeds:
            continue
        gaps = [by_seed[s][-1][1] - sync[s][-1][1] for s in seeds]
        interval = mean_interval(gaps)
        plain = runs.get((optimizer, profile, "delayed"), {})
        shared = [s for s in seeds if s in plain]
        recovered = None
        if mode != "delayed" and shared:
            plain_gap = _mean([plain[s][-1][1] - sync[s][-1][1] for s in shared])
            gap = _mean([by_seed[s][-1][1] - sync[s][-1][1] for s in shared])
            recovered = 1.0 - gap / plain_gap if plain_gap else None
        reached = [steps_to_reach(sync[s], by_seed[s][-1][1]) for s in seeds]
        slowdowns = [by_seed[s][-1][0] / r if r else math.inf for s, r in zip(seeds, reached)]
        rows.append(DepthRow(optimizer, profile, CORRECTIONS[mode], len(seeds), statistics.fmean(gaps),
                             interval.low if interval else None, interval.high if interval else None, recovered,
                             _mean(slowdowns), any(r == sync[s][0][0] for s, r in zip(seeds, reached))))
    return rows


def _order(key: tuple[str, str, str]) -> tuple:
    optimizer, profile, mode = key
    stages = 1 if profile == "2bw" else int(profile.split("-")[1])
    return optimizer, stages, list(CORRECTIONS).index(mode) if mode in CORRECTIONS else -1


def format_rows(rows: list[DepthRow]) -> str:
    """A markdown table of ``rows``."""
    lines = ["| optimizer | profile | correction | n | gap to sync (95% CI) | recovered | slowdown |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = f" ({r.gap_low:+.4f} to {r.gap_high:+.4f})" if r.gap_low is not None else " (one seed: no interval)"
        recovered = "" if r.recovered is None else f"{100 * r.recovered:.0f}%"
        slowdown = "" if r.slowdown is None else ("sync never got there" if math.isinf(r.slowdown) else
                                                  f"{'>= ' if r.slowdown_is_bound else ''}{r.slowdown:.2f}x")
        lines.append(f"| {r.optimizer} | {r.profile} | {r.correction} | {r.seeds} | {r.gap:+.4f}{ci} | {recovered} | {slowdown} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table of the depth studies under a folder (0), or an ``error:`` line (2)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_async.tools.depth_study", description=__doc__.split("::")[0])
    parser.add_argument("root", help="the folder holding the evidence-depth-* study folders (e.g. studies)")
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        print(f"error: {root} is not a folder; give the one holding the evidence-depth-* studies (e.g. studies)", file=sys.stderr)
        return 2
    runs, unfinished = collect(root)
    rows = depth_rows(runs)
    if not rows:
        print(f"error: no finished depth-study runs with a sync run under {root}", file=sys.stderr)
        return 2
    print(format_rows(rows))
    if unfinished:
        print(f"({unfinished} unfinished run(s) left out)")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
