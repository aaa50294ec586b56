"""The depth study's findings (docs/results.md, Part D): per delay profile and correction, the final validation
loss gap to the sync run of the same seed, the share of the plain delay's gap a correction recovers, the paired
differences between configurations, and the paper's slowdown measure (how many steps the sync run needed to reach
each run's final loss; ``>=`` when the sync run was already below it at its first validation)::

    python -m lightning_async.tools.depth_study studies --rows lightning_async/tools/depth_findings.json \\
        --json lightning_async/tools/depth_findings.json

It reads the run folders of the depth studies (``recipes/study/evidence/depth-*.yaml``) under the folder given: a
study folder named ``evidence-depth-2bw`` (sync, 2BW's constant delay) or ``evidence-depth-pipedream-<p>``, runs
named ``<optimizer>-<mode>-lr<lr>-s<seed>`` with a ``DONE`` file. Unfinished runs are left out and counted; diverged
runs (a ``DIVERGED`` marker) are left out and named.

The findings file keeps every seed: ``rows`` holds one :class:`SeedRow` per delayed run (its gap to the sync run of
its seed), ``summaries`` and ``comparisons`` what is derived from them. ``--rows FILE`` reads recorded rows (a
findings file, or a list of rows) and merges them with the runs found under the folder by the key ``(optimizer,
profile, correction, seed)``: a run found now replaces the recorded row of its key, no recorded row is dropped.
Without a folder, the summaries are recomputed from the recorded rows alone.

Every interval is paired by seed and reuses :mod:`lightning_async.compare.statistics` (what ``compare`` prints in
Part C): the gap's 95% Student t interval over its seeds (:func:`~lightning_async.compare.statistics.mean_interval`;
n = 3 is mean +- 4.303 sd / sqrt(3)), Fieller's interval of a correction's recovered share ``mean(plain - corrected)
/ mean(plain)`` over the seeds both ran (:func:`~lightning_async.compare.statistics.ratio_interval`; n/a, as in
``compare``, when the plain gap is ~0 or its interval includes 0), and the t interval of the per-seed difference of
two configurations' gaps. The sync and 2BW runs do not depend on ``p``: one ``2bw`` row per seed serves every ``p``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from lightning_async.compare.events import read_scalars
from lightning_async.compare.render import fmt_interval
from lightning_async.compare.rows import GAP_TOLERANCE
from lightning_async.compare.statistics import LEVEL, Interval, mean_interval, paired_differences, ratio_interval
from lightning_async.identity import DIVERGED_FILE, DONE_FILE

STUDY_FOLDER = re.compile(r"^evidence-depth-(?P<profile>2bw|pipedream-\d+)$")
RUN_NAME = re.compile(r"^(?P<optimizer>[a-z0-9_]+)-(?P<mode>sync|delayed(?:-[a-z-]+)?)-lr[^-]+-s(?P<seed>\d+)$")
#: study mode -> the correction it applies (``delayed-ef`` is EF's k-step form: one step under 2BW)
CORRECTIONS = {"delayed": "none", "delayed-ef": "ef", "delayed-ef-one-step": "ef-one-step"}
VAL_LOSS = "val/loss"

Curve = list[tuple[int, float]]
#: a configuration of one optimizer: ``(profile, correction)``
Config = tuple[str, str]


@dataclass(frozen=True)
class SeedRow:
    """One delayed run against the sync run of its seed: what the findings file records for every seed."""

    optimizer: str
    profile: str  # "2bw" or "pipedream-<p>"
    correction: str  # "none", "ef" (the k-step form), "ef-one-step"
    seed: int
    gap: float  # final validation loss minus the same seed's sync run's
    slowdown: float  # final step / the step at which the sync run reached this run's final loss (inf: never)
    slowdown_is_bound: bool = False  # the sync run was below it at its first validation: a lower bound
    source: str = ""  # where the row was recorded (a run folder, or the record it was taken from)

    @property
    def key(self) -> tuple[str, str, str, int]:
        return self.optimizer, self.profile, self.correction, self.seed


@dataclass(frozen=True)
class DepthRow:
    """One profile and correction against the sync run, over the seeds recorded (a summary of :class:`SeedRow`)."""

    optimizer: str
    profile: str
    correction: str
    seeds: int
    gap: float  # mean of the per-seed gaps to sync
    gap_low: float | None  # its 95% paired t interval (None with one seed)
    gap_high: float | None
    recovered: float | None  # mean(plain gap - gap) / mean(plain gap) over the seeds both ran (None: n/a)
    slowdown: float | None  # mean of the per-seed slowdowns
    slowdown_is_bound: bool = False  # some seed's slowdown is a lower bound
    recovered_low: float | None = None  # Fieller's 95% interval of ``recovered`` (may be -inf/+inf: unbounded)
    recovered_high: float | None = None
    seed_ids: tuple[int, ...] = ()
    seed_gaps: tuple[float, ...] = ()
    seed_recovered: tuple[float, ...] = ()  # per-seed shares (seeds whose plain gap is positive)
    recovered_n: int = 0  # the seeds ``recovered`` is over (those that ran this and the plain delay)

    @property
    def gap_interval(self) -> Interval | None:
        return None if self.gap_low is None else Interval(self.gap_low, self.gap_high, LEVEL, self.seeds)

    @property
    def recovered_interval(self) -> Interval | None:
        if self.recovered_low is None:
            return None
        return Interval(self.recovered_low, self.recovered_high, LEVEL, self.recovered_n)


@dataclass(frozen=True)
class Comparison:
    """The per-seed difference of two configurations' gaps (``first - second``; negative: ``first`` ends lower)."""

    optimizer: str
    first_profile: str
    first_correction: str
    second_profile: str
    second_correction: str
    seed_ids: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    low: float  # its 95% paired t interval
    high: float

    @property
    def interval(self) -> Interval:
        return Interval(self.low, self.high, LEVEL, len(self.seed_ids))


def collect(root: Path, pattern: re.Pattern = STUDY_FOLDER) -> tuple[dict[tuple[str, str, str], dict[int, Curve]], int, list[str]]:
    """Finished runs' validation curves by ``(optimizer, profile, mode)`` and seed, how many runs were unfinished,
    and the diverged ones (``<study folder>/<run>``: a ``DIVERGED`` marker; no final loss to pair, so left out of
    every gap and named instead), from the study folders under ``root`` whose name ``pattern`` matches (its group
    ``profile`` names the delay profile; the sync runs are in the ``2bw`` folder)."""
    runs: dict[tuple[str, str, str], dict[int, Curve]] = defaultdict(dict)
    unfinished, diverged = 0, []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and pattern.match(p.name)):
        profile = pattern.match(folder.name)["profile"]
        for run in sorted(p for p in (folder / "runs").glob("*") if p.is_dir()):
            name = RUN_NAME.match(run.name)
            if name is None:
                continue
            if (run / DIVERGED_FILE).exists():
                diverged.append(f"{folder.name}/{run.name}")
                continue
            if not (run / DONE_FILE).exists():
                unfinished += 1
                continue
            curve = sorted(read_scalars(run).get(VAL_LOSS, []))
            if curve:
                runs[(name["optimizer"], profile, name["mode"])][int(name["seed"])] = curve
    return runs, unfinished, diverged


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


def _stages(profile: str) -> int:
    return 1 if profile == "2bw" else int(profile.split("-")[1])


def _config_order(optimizer: str, profile: str, correction: str) -> tuple:
    order = list(CORRECTIONS.values())
    return optimizer, _stages(profile), order.index(correction) if correction in order else len(order), correction


def seed_rows(runs: dict[tuple[str, str, str], dict[int, Curve]], source: str = "") -> list[SeedRow]:
    """:class:`SeedRow` for every finished delayed run whose seed has a sync run of the same optimizer."""
    rows = []
    for (optimizer, profile, mode), by_seed in runs.items():
        if mode not in CORRECTIONS:
            continue
        sync = runs.get((optimizer, "2bw", "sync"), {})
        for seed in sorted(set(by_seed) & set(sync)):
            final_step, final = by_seed[seed][-1]
            reached = steps_to_reach(sync[seed], final)
            rows.append(SeedRow(optimizer, profile, CORRECTIONS[mode], seed, final - sync[seed][-1][1],
                                final_step / reached if reached else math.inf, reached == sync[seed][0][0], source))
    return sort_rows(rows)


def sort_rows(rows: list[SeedRow]) -> list[SeedRow]:
    return sorted(rows, key=lambda r: (_config_order(r.optimizer, r.profile, r.correction), r.seed))


def merge_rows(recorded: list[SeedRow], new: list[SeedRow]) -> tuple[list[SeedRow], int]:
    """``recorded`` and ``new`` by :attr:`SeedRow.key`, a new row replacing the recorded one of its key; and how
    many recorded rows were replaced. No recorded row is dropped."""
    merged = {r.key: r for r in recorded}
    replaced = sum(r.key in merged for r in new)
    merged.update((r.key, r) for r in new)
    return sort_rows(list(merged.values())), replaced


def _gaps(rows: list[SeedRow]) -> dict[tuple[str, str, str], dict[int, float]]:
    """Per-seed gaps by ``(optimizer, profile, correction)``, in the configurations' order."""
    gaps: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in sort_rows(rows):
        gaps.setdefault((r.optimizer, r.profile, r.correction), {})[r.seed] = r.gap
    return gaps


Share = tuple[float | None, Interval | None, list[float], int]


def recovered_share(plain: dict[int, float], corrected: dict[int, float]) -> Share:
    """The share of the plain gap a correction recovers over the seeds both ran: ``mean(plain - corrected) /
    mean(plain)``, Fieller's interval of it (None with one seed), the per-seed shares (seeds whose plain gap is
    positive) and how many seeds both ran. Share and interval are None when n/a: no common seed, the plain gap ~0,
    or its interval includes 0."""
    seeds = sorted(set(plain) & set(corrected))
    won = paired_differences({s: plain[s] for s in seeds}, corrected)
    gaps = [plain[s] for s in seeds]
    if not seeds or abs(statistics.fmean(gaps)) < GAP_TOLERANCE:
        return None, None, [], len(seeds)
    gap_interval = mean_interval(gaps)
    if gap_interval is not None and not gap_interval.excludes(0.0):
        return None, None, [], len(seeds)
    shares = [w / g for w, g in zip(won, gaps) if g >= GAP_TOLERANCE]
    return statistics.fmean(won) / statistics.fmean(gaps), ratio_interval(won, gaps), shares, len(seeds)


def summarize(rows: list[SeedRow]) -> list[DepthRow]:
    """:class:`DepthRow` for every ``(optimizer, profile, correction)`` of ``rows``, paired by seed."""
    gaps = _gaps(rows)
    by_key = {r.key: r for r in rows}
    summaries = []
    for (optimizer, profile, correction), by_seed in gaps.items():
        seeds = sorted(by_seed)
        values = [by_seed[s] for s in seeds]
        interval = mean_interval(values)
        share, share_interval, shares, share_n = (None, None, [], 0)
        if correction != "none":
            share, share_interval, shares, share_n = recovered_share(gaps.get((optimizer, profile, "none"), {}), by_seed)
        recorded = [by_key[(optimizer, profile, correction, s)] for s in seeds]
        summaries.append(DepthRow(
            optimizer, profile, correction, len(seeds), statistics.fmean(values),
            interval.low if interval else None, interval.high if interval else None, share,
            statistics.fmean(r.slowdown for r in recorded), any(r.slowdown_is_bound for r in recorded),
            share_interval.low if share_interval else None, share_interval.high if share_interval else None,
            tuple(seeds), tuple(values), tuple(shares), share_n))
    return summaries


def comparisons(rows: list[SeedRow]) -> list[Comparison]:
    """Every pair of one optimizer's configurations with two or more seeds in common: the later configuration (more
    stages, or a correction against none) minus the earlier, per seed, with its t interval."""
    out = []
    by_optimizer = defaultdict(list)
    for (optimizer, profile, correction), by_seed in _gaps(rows).items():
        by_optimizer[optimizer].append(((profile, correction), by_seed))
    for optimizer, configs in by_optimizer.items():
        for (second, gaps_second), (first, gaps_first) in itertools.combinations(configs, 2):
            differences = paired_differences(gaps_first, gaps_second)
            interval = mean_interval(differences)
            if interval is None:
                continue
            out.append(Comparison(optimizer, *first, *second, tuple(sorted(set(gaps_first) & set(gaps_second))),
                                  tuple(differences), statistics.fmean(differences), interval.low, interval.high))
    return out


def find_comparison(found: list[Comparison], optimizer: str, first: Config, second: Config) -> tuple[float, Interval] | None:
    """The mean and interval of ``first - second`` from ``found`` (either orientation); None when not compared."""
    for c in found:
        pair = ((c.first_profile, c.first_correction), (c.second_profile, c.second_correction))
        if c.optimizer == optimizer and pair in ((first, second), (second, first)):
            if pair == (first, second):
                return c.mean, c.interval
            return -c.mean, Interval(-c.high, -c.low, LEVEL, len(c.seed_ids))
    return None


# ---- the findings file -----------------------------------------------------------------------------------
def optimizers_compared(rows: Sequence[SeedRow], profile: str, source: str) -> str | None:
    """Across optimizers under ``profile`` without a correction: the optimizer with the smallest mean gap to its own
    sync run, and against each other one measured there whether the paired difference (by seed) is established;
    ``None`` when fewer than two optimizers were measured at that profile. ``source``: where the rows come from."""
    gaps: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.profile == profile and r.correction == "none":
            gaps.setdefault(r.optimizer, {})[r.seed] = r.gap
    if len(gaps) < 2:
        return None
    mean = {o: sum(g.values()) / len(g) for o, g in gaps.items()}
    best, *others = sorted(gaps, key=mean.get)
    parts = []
    for other in others:
        differences = paired_differences(gaps[best], gaps[other])
        interval = mean_interval(differences)
        if interval is None:
            parts.append(f"against {other}'s ({mean[other]:+.3f}): not established, fewer than two seeds in common")
            continue
        verdict = "established" if interval.below(0.0) else "not established (the interval includes 0)"
        parts.append(f"minus {other}'s ({mean[other]:+.3f}): {sum(differences) / len(differences):+.3f} "
                     f"({interval.describe()}, paired by seed), {verdict}")
    return (f"across optimizers under {profile} without a correction ({source}): {best} has the smallest gap to its "
            f"own sync run, {mean[best]:+.3f} (n={len(gaps[best])}); its gap " + "; ".join(parts) + ".")


def _from_dict(cls, data: dict):
    names = {f.name for f in fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names})


def read_rows(path: Path) -> list[SeedRow]:
    """The recorded :class:`SeedRow` of a findings file (its ``rows``) or of a JSON list of rows."""
    data = json.loads(Path(path).read_text())
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or any(not isinstance(r, dict) or "seed" not in r for r in rows):
        raise ValueError(f"{path} holds no per-seed rows (each with a 'seed'): summaries alone cannot be merged")
    return sort_rows([_from_dict(SeedRow, r) for r in rows])


def findings(rows: list[SeedRow]) -> dict:
    """The findings file's content: the rows of every seed, and the paired summaries and comparisons of them."""
    return {"level": LEVEL, "rows": [asdict(r) for r in sort_rows(rows)],
            "summaries": [asdict(r) for r in summarize(rows)], "comparisons": [asdict(c) for c in comparisons(rows)]}


def load_summaries(path: Path) -> tuple[list[DepthRow], list[Comparison]]:
    """The summaries and comparisons of a findings file (an older file, a bare list of summaries, has no
    comparisons)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        return [_from_dict(DepthRow, r) for r in data], []
    return ([_from_dict(DepthRow, r) for r in data.get("summaries", [])],
            [_from_dict(Comparison, c) for c in data.get("comparisons", [])])


# ---- tables ---------------------------------------------------------------------------------------------
def _label(profile: str, correction: str) -> str:
    return profile if correction == "none" else f"{profile} + {correction}"


def _per_seed(seeds: tuple[int, ...], values: tuple[float, ...], fmt: str = "{:+.4f}") -> str:
    return ", ".join(f"s{s} {fmt.format(v)}" for s, v in zip(seeds, values))


def _slowdown(r: DepthRow) -> str:
    if r.slowdown is None:
        return ""
    return "sync never got there" if math.isinf(r.slowdown) else f"{'>= ' if r.slowdown_is_bound else ''}{r.slowdown:.2f}x"


def format_rows(rows: list[DepthRow]) -> str:
    """A markdown table of the summaries ``rows``."""
    lines = ["| optimizer | profile | correction | n | gap to sync per seed | mean gap | recovered | slowdown |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = f"{r.gap:+.3f} {fmt_interval(r.gap_interval, r.seeds)}"
        recovered = ""
        if r.recovered is not None:
            scaled = r.recovered_interval.scaled(100) if r.recovered_interval else None
            recovered = f"{100 * r.recovered:.0f}% {fmt_interval(scaled, r.recovered_n, '{:.0f}', '%')}"
            if len(r.seed_recovered) > 1:
                recovered += f"; per seed {', '.join(f'{100 * s:.0f}' for s in r.seed_recovered)}%"
        lines.append(f"| {r.optimizer} | {r.profile} | {r.correction} | {r.seeds} | {_per_seed(r.seed_ids, r.seed_gaps)} "
                     f"| {gap} | {recovered} | {_slowdown(r)} |")
    return "\n".join(lines)


def format_comparisons(found: list[Comparison]) -> str:
    """A markdown table of the paired differences between configurations."""
    lines = ["| optimizer | difference of gaps | per seed | mean |", "|---|---|---|---|"]
    for c in found:
        lines.append(f"| {c.optimizer} | {_label(c.first_profile, c.first_correction)} minus "
                     f"{_label(c.second_profile, c.second_correction)} | {_per_seed(c.seed_ids, c.differences, '{:+.3f}')} "
                     f"| {c.mean:+.3f} {fmt_interval(c.interval, len(c.seed_ids))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, *, pattern: re.Pattern = STUDY_FOLDER, folders: str = "evidence-depth-*",
         prog: str = "python -m lightning_async.tools.depth_study", description: str = __doc__) -> int:
    """Print the findings of the studies under a folder (those named like ``folders``, matched by ``pattern``) and/or
    of recorded rows (0), or an ``error:`` line (2). The family study's findings reuse it with their own folders."""
    parser = argparse.ArgumentParser(prog=prog, description=description.split("::")[0])
    parser.add_argument("root", nargs="?", help=f"the folder holding the {folders} study folders (e.g. studies)")
    parser.add_argument("--rows", help="recorded rows to merge with the runs found (a findings file, e.g. "
                                       "lightning_async/tools/depth_findings.json)")
    parser.add_argument("--json", help="write the findings (every seed's row, the summaries, the comparisons) here")
    args = parser.parse_args(argv)
    if args.root is None and args.rows is None:
        print(f"error: give the folder holding the {folders} studies (e.g. studies), --rows FILE, or both",
              file=sys.stderr)
        return 2
    recorded, new, unfinished, diverged = [], [], 0, []
    if args.rows is not None:
        try:
            recorded = read_rows(Path(args.rows))
        except (OSError, ValueError) as err:
            print(f"error: --rows: {err}", file=sys.stderr)
            return 2
    if args.root is not None:
        root = Path(args.root)
        if not root.is_dir():
            print(f"error: {root} is not a folder; give the one holding the {folders} studies (e.g. studies)",
                  file=sys.stderr)
            return 2
        runs, unfinished, diverged = collect(root, pattern)
        new = seed_rows(runs, source=str(root))
    rows, replaced = merge_rows(recorded, new)
    if not rows:
        left_out = f" ({len(diverged)} diverged: {', '.join(diverged)})" if diverged else ""
        print(f"error: no finished {folders} runs with a sync run under {args.root}{left_out}", file=sys.stderr)
        return 2
    print(format_rows(summarize(rows)))
    print("\npaired differences between configurations (seeds in common, 95% t interval):\n")
    print(format_comparisons(comparisons(rows)))
    profiles = sorted({r.profile for r in rows}, key=_stages)
    across = [text for text in (optimizers_compared(rows, profile, "these rows") for profile in profiles) if text]
    if across:
        print("\n" + "\n".join(across))
    print(f"\n{len(rows)} rows: {len(recorded)} recorded ({replaced} replaced by runs found), {len(new)} from runs")
    if unfinished:
        print(f"({unfinished} unfinished run(s) left out)")
    if diverged:
        print("diverged (left out of every gap, not a result to average): " + ", ".join(diverged))
    if args.json:
        Path(args.json).write_text(json.dumps(findings(rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
