"""Tables of the family study's sweeps (docs/results.md, C8 momentum and C9 batch size): for each setting, the sync
and 2BW final validation losses, the gap paired by seed with its 95% t interval, the update statistics the runs
measured (:class:`~lightning_async.callbacks.UpdateCorrelation`, where they did), the paired difference of the gap
between neighbouring settings, and a least-squares fit of the gap on each statistic::

    python -m lightning_async.tools.sweep_study momentum studies
    python -m lightning_async.tools.sweep_study batch studies

``momentum`` reads the study folders ``momentum-<optimizer>-<value>`` (``recipes/study/momentum/*.yaml``: AdamW's
beta1, Muon's momentum); ``batch`` reads ``batch-<model>-<batch size>`` (``recipes/study/batch/*.yaml``) and, for
``nano`` at batch 16, ``family-2bw`` (the same runs). Runs are named ``<optimizer>-<sync|delayed>-lr<lr>-s<seed>``
and count once they have a ``DONE`` file. A fit pools every seed of every setting of an optimizer (each seed's gap
against the statistic its 2BW run measured); its slope's interval has ``N - 2`` degrees of freedom, ``N - k - 1``
within ``k`` settings.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_async.callbacks.update_correlation import STATISTICS
from lightning_async.compare.events import read_scalars
from lightning_async.compare.statistics import LEVEL, Interval, critical_t, mean_interval, paired_differences
from lightning_async.identity import DIVERGED_FILE, DONE_FILE
from lightning_async.tools.depth_study import RUN_NAME

MODES = ("sync", "delayed")
MOMENTUM_FOLDER = re.compile(r"^momentum-(?P<optimizer>[a-z]+)-(?P<value>[0-9.]+)$")
BATCH_FOLDER = re.compile(r"^batch-(?P<model>[a-z]+)-(?P<value>\d+)$")
#: ``nano`` at batch 16 is the family study's 2BW folder (the paper regime's batch)
BATCH_ALIASES = {("nano", 16): "family-2bw"}
STATISTIC_LABELS = {"cosine": "cos(u_t, u_t-1)", "diff_correlation": "corr(d_t, d_t-1)", "lambda_star": "lambda*",
                    "diff_size": "abs(d) / abs(u)"}


@dataclass
class Setting:
    """One optimizer at one value of the swept quantity: final losses and update statistics by mode and seed."""

    group: str  # what else is fixed (the model of a batch sweep; "" for momentum)
    optimizer: str
    value: float
    final: dict[str, dict[int, float]] = field(default_factory=lambda: {m: {} for m in MODES})
    stats: dict[str, dict[str, dict[int, float]]] = field(default_factory=lambda: {m: {} for m in MODES})
    diverged: list[str] = field(default_factory=list)  # run names: no final loss to pair, said under the table

    def gaps(self, relative: bool = False) -> dict[int, float]:
        """Each seed's 2BW final loss minus its sync run's (in % of the sync loss when ``relative``)."""
        sync, delayed = self.final["sync"], self.final["delayed"]
        return {s: (delayed[s] - sync[s]) * (100.0 / sync[s] if relative else 1.0) for s in sorted(set(sync) & set(delayed))}

    def statistic(self, name: str, mode: str = "delayed") -> dict[int, float]:
        return self.stats[mode].get(name, {})


def read_folder(folder: Path, setting: Setting) -> None:
    """Add the finished sync and 2BW runs of ``setting.optimizer`` under ``folder/runs`` to ``setting``."""
    for run in sorted((folder / "runs").glob("*")):
        name = RUN_NAME.match(run.name)
        if name is None or name["optimizer"] != setting.optimizer or name["mode"] not in MODES:
            continue
        if (run / DIVERGED_FILE).exists():
            setting.diverged.append(run.name)
            continue
        if not (run / DONE_FILE).exists():
            continue
        scalars = read_scalars(run)
        if not scalars.get("val/loss"):
            continue
        seed, mode = int(name["seed"]), name["mode"]
        setting.final[mode][seed] = scalars["val/loss"][-1][1]
        for key in STATISTICS:
            if scalars.get(f"update/{key}"):
                setting.stats[mode].setdefault(key, {})[seed] = scalars[f"update/{key}"][-1][1]


def _optimizers(folder: Path) -> list[str]:
    names = {RUN_NAME.match(p.name) for p in (folder / "runs").glob("*")}
    return sorted({n["optimizer"] for n in names if n is not None})


def momentum_settings(root: Path) -> list[Setting]:
    """Every ``momentum-<optimizer>-<value>`` folder under ``root`` as a :class:`Setting`."""
    found = []
    for folder in sorted(p for p in root.iterdir() if MOMENTUM_FOLDER.match(p.name)):
        match = MOMENTUM_FOLDER.match(folder.name)
        setting = Setting("", match["optimizer"], float(match["value"]))
        read_folder(folder, setting)
        found.append(setting)
    return sorted(found, key=lambda s: (s.optimizer, s.value))


def batch_settings(root: Path) -> list[Setting]:
    """Every ``batch-<model>-<batch>`` folder under ``root`` (and :data:`BATCH_ALIASES`), one :class:`Setting` per
    optimizer found in it."""
    folders = {(m["model"], int(m["value"])): p for p in root.iterdir() if (m := BATCH_FOLDER.match(p.name))}
    swept = {}  # model -> the optimizers its own batch folders hold (an alias folder may hold more)
    for (model, _), folder in folders.items():
        swept.setdefault(model, set()).update(_optimizers(folder))
    for key, alias in BATCH_ALIASES.items():
        if (root / alias).is_dir() and key[0] in swept:
            folders.setdefault(key, root / alias)
    found = []
    for (model, batch), folder in folders.items():
        for optimizer in sorted(swept[model] & set(_optimizers(folder))):
            setting = Setting(model, optimizer, float(batch))
            read_folder(folder, setting)
            found.append(setting)
    return sorted(found, key=lambda s: (s.group, s.optimizer, s.value))


@dataclass(frozen=True)
class Fit:
    """Least squares ``y = intercept + slope x`` over ``n`` points, the slope's t interval and R^2."""

    slope: float
    intercept: float
    interval: Interval
    r_squared: float
    n: int


def least_squares(xs: Sequence[float], ys: Sequence[float], level: float = LEVEL, groups: Sequence | None = None) -> Fit | None:
    """The fit of ``ys`` on ``xs`` (None with too few points or no spread in ``xs``). With ``groups`` (a label per
    point) the fit is *within* groups: each group's means are taken out first (a fixed effect per group), so the
    slope says how ``y`` moves with ``x`` inside a group, and the interval loses one degree of freedom per group."""
    n = len(xs)
    labels = list(groups) if groups is not None else [None] * n
    mean_of = {g: (statistics.fmean(x for x, h in zip(xs, labels) if h == g),
                   statistics.fmean(y for y, h in zip(ys, labels) if h == g)) for g in set(labels)}
    dof = n - len(mean_of) - 1  # residual degrees of freedom: one per group mean, one for the slope
    if dof < 1:
        return None
    dx = [x - mean_of[g][0] for x, g in zip(xs, labels)]
    dy = [y - mean_of[g][1] for y, g in zip(ys, labels)]
    sxx = sum(x * x for x in dx)
    if sxx == 0:
        return None
    slope = sum(x * y for x, y in zip(dx, dy)) / sxx
    residual = sum((y - slope * x) ** 2 for x, y in zip(dx, dy))
    total = sum(y * y for y in dy)
    half = critical_t(dof + 1, level) * math.sqrt(residual / dof / sxx)  # (critical_t(k) has k - 1 degrees of freedom)
    intercept = statistics.fmean(ys) - slope * statistics.fmean(xs)
    return Fit(slope, intercept, Interval(slope - half, slope + half, level, n), 1 - residual / total if total else 0.0, n)


def _mean_sd(values: dict[int, float]) -> str:
    if not values:
        return "-"
    sd = f" ± {statistics.stdev(values.values()):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values.values()):.3f}{sd}"


def _interval_text(values: list[float], fmt: str = "{:+.3f}", unit: str = "") -> str:
    if not values:
        return "-"
    interval = mean_interval(values)
    ci = f" ({fmt.format(interval.low)}{unit} to {fmt.format(interval.high)}{unit})" if interval else ""
    return f"{fmt.format(statistics.fmean(values))}{unit}{ci}"


def format_settings(settings: Sequence[Setting], quantity: str) -> str:
    """A markdown table: one row per setting (losses over the seeds with both runs), with the update statistics where
    the runs measured them."""
    measured = [k for k in STATISTICS if any(s.statistic(k) for s in settings)]
    head = ["model", "optimizer", quantity, "n", "sync", "2BW", "gap (95% CI)", "relative gap (95% CI)"]
    head += [f"{STATISTIC_LABELS[k]} 2BW" for k in measured] + (["cos(u_t, u_t-1) sync"] if "cosine" in measured else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in settings:
        gaps = s.gaps()
        paired = {mode: {seed: s.final[mode][seed] for seed in gaps} for mode in MODES}  # the seeds of the gap
        cells = [s.group or "nano", s.optimizer, f"{s.value:g}", str(len(gaps)), _mean_sd(paired["sync"]),
                 _mean_sd(paired["delayed"]), _interval_text(list(gaps.values())),
                 _interval_text(list(s.gaps(relative=True).values()), "{:+.1f}", "%")]
        cells += [_mean_sd(s.statistic(k)) for k in measured]
        if "cosine" in measured:
            cells.append(_mean_sd(s.statistic("cosine", "sync")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_steps(settings: Sequence[Setting], quantity: str) -> str:
    """The paired difference of the gap between each setting and the next of the same optimizer (and model), and
    between the first and the last where there are more than two."""
    lines = [f"| model | optimizer | {quantity}: from -> to | n | gap difference (95% CI) |", "|---|---|---|---|---|"]
    series: dict[tuple[str, str], list[Setting]] = {}
    for s in settings:
        series.setdefault((s.group, s.optimizer), []).append(s)
    for members in series.values():
        pairs = list(zip(members, members[1:])) + ([(members[0], members[-1])] if len(members) > 2 else [])
        for low, high in pairs:
            differences = paired_differences(high.gaps(), low.gaps())
            lines.append(f"| {low.group or 'nano'} | {low.optimizer} | {low.value:g} -> {high.value:g} | "
                         f"{len(differences)} | {_interval_text(differences)} |")
    return "\n".join(lines)


def format_fits(settings: Sequence[Setting], mode: str = "delayed") -> str:
    """Per optimizer and pooled, the fit of each seed's relative gap (%) on each statistic its ``mode`` run measured
    (``delayed``: the 2BW run itself; ``sync``: the same seed's sync run, which no delay touched, so a slope there
    cannot be a consequence of the delay's damage): across every point, and within settings (each setting's means
    taken out: does the statistic predict the gap among the seeds of one setting, beyond what the setting itself
    does?)."""
    lines = ["| optimizer | statistic | points | slope across settings: gap % per unit (95% CI) | R^2 | "
             "slope within settings (95% CI) | R^2 within |", "|---|---|---|---|---|---|---|"]
    groups = {o: [s for s in settings if s.optimizer == o] for o in dict.fromkeys(s.optimizer for s in settings)}
    if len(groups) > 1:
        groups["pooled"] = list(settings)
    for name, members in groups.items():
        for key in STATISTICS:
            xs, ys, labels = [], [], []
            for s in members:
                stat = s.statistic(key, mode)
                for seed, gap in s.gaps(relative=True).items():
                    if seed in stat:
                        xs.append(stat[seed])
                        ys.append(gap)
                        labels.append((s.group, s.optimizer, s.value))
            across, within = least_squares(xs, ys), least_squares(xs, ys, groups=labels)
            if across is None:
                continue
            inside = (f"{within.slope:+.1f} ({within.interval.low:+.1f} to {within.interval.high:+.1f}) | "
                      f"{within.r_squared:.2f}") if within is not None else "- | -"
            lines.append(f"| {name} | {STATISTIC_LABELS[key]} | {across.n} | {across.slope:+.1f} "
                         f"({across.interval.low:+.1f} to {across.interval.high:+.1f}) | {across.r_squared:.2f} | {inside} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print a sweep's tables (0), or an ``error:`` line (2)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_async.tools.sweep_study", description=__doc__.split("::")[0])
    parser.add_argument("sweep", choices=["momentum", "batch"])
    parser.add_argument("root", help="the folder holding the study folders (e.g. studies)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not root.is_dir():
        print(f"error: {root} is not a folder; give the one holding the {args.sweep}-* studies (e.g. studies)",
              file=sys.stderr)
        return 2
    settings = momentum_settings(root) if args.sweep == "momentum" else batch_settings(root)
    settings = [s for s in settings if s.gaps()]
    if not settings:
        print(f"error: no finished {args.sweep} study runs with a sync and a 2BW run of one seed under {root}",
              file=sys.stderr)
        return 2
    quantity = "momentum" if args.sweep == "momentum" else "batch"
    print(format_settings(settings, quantity))
    diverged = [f"{s.group or 'nano'} {s.optimizer} {s.value:g}: {name}" for s in settings for name in s.diverged]
    if diverged:
        print("\ndiverged (left out of the gaps, not a result to average): " + "; ".join(diverged))
    print("\nthe gap's change from one setting to the next, and from the first to the last (paired by seed):\n")
    print(format_steps(settings, quantity))
    for mode, whose in (("delayed", "its 2BW run's"), ("sync", "its sync run's (no delay: a cause, not a consequence)")):
        fits = format_fits(settings, mode)
        if fits.count("\n") > 1:
            print(f"\nleast-squares fit of each seed's relative gap on {whose} update statistic, across settings and "
                  "within them:\n")
            print(fits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
