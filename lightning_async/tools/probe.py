"""``lightning-async probe``: does one-step delay hurt *my* recipe, and which correction fixes it best?

Runs short single-device trainings of the user's recipe(s), sync, delayed and delayed + each correction
asked for (EF by default; ``--corrections all`` for the whole family), with the same seed(s), then prints the
gap table, a plain-language verdict with 95% intervals over the seeds, and a recommended correction only when it
ends significantly lower (95%, seeds paired) than both no correction and the runner-up::

    lightning-async probe --config my_model.yaml --config my_data.yaml --steps 200 --seeds 3 --corrections all

It is a small :mod:`lightning_async.tools.study` (same runner, same skip/resume bookkeeping, runs under
``<output>/runs``) read back with :mod:`lightning_async.compare`'s reader. A recipe that trains with a
pipeline strategy is refused: the delay is simulated on one device, and the pipeline would be the
"sync" leg.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from lightning_async.compare import ASYNC, ASYNC_EF, SYNC, CompareError, Interval, Row, compare
from lightning_async.compare.ranking import Recommendation, recommend
from lightning_async.identity import EF, KNOWN_CORRECTIONS
from lightning_async.optim.corrections import CORRECTIONS, FORWARD
from lightning_async.recipes_index import RecipeNotFound, resolve_config
from lightning_async.tools.depth_advice import depth_advice, optimizer_advice
from lightning_async.tools.family_advice import family_advice
from lightning_async.tools.study import Runner, Study, StudyError, find_recipes_dir, parse_set, run_study
from lightning_async.tools.study.parsing import add_jobs_argument, check_jobs
from lightning_async.tools.study.spec import CATEGORY_MODES

PROBE_MODES = list(CATEGORY_MODES)
#: the corrections ``--corrections all`` tries: the whole family, EF first
ALL_CORRECTIONS = KNOWN_CORRECTIONS


def probe_modes(corrections: list[str]) -> list[str]:
    """sync, delayed, then ``delayed-<c>`` for each correction (``delayed-ef`` is EF)."""
    chosen = list(ALL_CORRECTIONS) if corrections == ["all"] else list(dict.fromkeys(corrections))
    unknown = [c for c in chosen if c not in ALL_CORRECTIONS]
    if unknown or not chosen:
        raise StudyError(f"--corrections {' '.join(corrections)}: choose from {', '.join(ALL_CORRECTIONS)} or all")
    return ["sync", "delayed"] + [f"delayed-{c}" for c in chosen]


def _where(correction: str) -> str:
    """How to turn ``correction`` on (and whether the pipeline can run it)."""
    simulation = f"`--config modes/delayed --config corrections/{correction}`"
    if CORRECTIONS[correction].level == FORWARD:  # the 2BW runtime holds no third weight version
        return f"{simulation}; single-device simulation only: the pipeline cannot run it"
    return f"{simulation}, or under the pipeline `--config pipeline/async --config corrections/{correction}`"


def recommendation(rec: Recommendation | None) -> str:
    """One paragraph: the correction to use, only when it ends lower than both no correction and the runner-up at
    95% (seeds paired), with how to turn it on; otherwise "no significant difference", with the numbers that say
    why (:meth:`~lightning_async.compare.ranking.Recommendation.describe`)."""
    if rec is None:
        return "No correction could be ranked (a mode is missing: no corrected run paired with a delayed run)."
    return rec.describe(_where(rec.best) if rec.significant else None)


@dataclass
class Verdict:
    """The probe's conclusion: one paragraph of text and a confidence level (high/moderate/low/none)."""

    text: str
    confidence: str
    gap: float | None
    gap_pct: float | None
    recovered: float | None
    seeds: int
    gap_interval: Interval | None


def _ef_phrase(recovered: float) -> str:
    if recovered >= 0.8:
        return "EF closes (nearly) all of it"
    if recovered >= 0.3:
        return "EF closes part of it"
    if recovered >= 0:
        return "EF barely helps"
    return "EF makes it worse"


#: the lower level at which a gap whose 95% interval includes 0 still counts as "moderate" evidence
MODERATE_LEVEL = 0.8


def verdict(row: Row) -> Verdict:
    """Judge one gap-table row in plain language.

    * ``async costs X in final loss (Y%)`` with the 95% t interval of the per-seed gaps (2+ seeds);
    * ``EF recovers Z% of it`` with a qualifier (closes all / part / barely / worse) and Fieller's interval;
    * confidence *high* when the gap's 95% interval excludes 0, *moderate* when only its 80% interval does,
      else *low*; with one seed, *low* (no interval).
    """
    seeds = row.seeds
    gap, pct, recovered = row.gap, row.gap_pct, row.recovered
    interval = row.gap_interval()
    if gap is None:
        diverged = [c for c in (SYNC, ASYNC) if row.stat(c) is None and row.diverged_runs(c)]
        if diverged:
            return Verdict(f"cannot judge: the {' and '.join(diverged)} run diverged (non-finite loss); lower the "
                           "learning rate or check the recipe", "none", None, None, None, seeds, None)
        missing = ", ".join(c for c in (SYNC, ASYNC) if row.stat(c) is None)
        return Verdict(f"cannot judge: no finished {missing} run with a val/loss", "none", None, None, None, seeds, None)
    sentences = []
    pct_text = f" ({pct:+.2f}%)" if pct is not None else ""
    bounds = f" ({interval.describe('{:+.4f}')})" if interval is not None else ""
    if row.gap_is_zero:
        sentences.append(f"async costs nothing measurable in final loss (gap {gap:+.4f}{pct_text})")
    elif gap < 0:
        sentences.append(f"async ended lower than sync by {-gap:.4f}{pct_text}{bounds}: no cost from the delay here")
    else:
        sentences.append(f"async costs {gap:.4f} in final loss{pct_text.replace('+', '')}{bounds}")
    if row.async_ef is None:
        sentences.append("EF was not measured (no delayed-ef run)")
    elif recovered is None:
        ef_delta = row.async_.mean - row.async_ef.mean
        why = "the gap is within seed noise" if row.gap_within_noise else "no gap to recover"
        sentences.append(f"EF changes the final loss by {-ef_delta:+.4f} ({why})")
    elif gap > 0:
        share_interval = row.recovered_interval_by(EF)
        share_bounds = f" ({share_interval.scaled(100).describe('{:.0f}', '%')})" if share_interval else ""
        sentences.append(f"EF recovers {100 * recovered:.0f}%{share_bounds} of it ({_ef_phrase(recovered)})")
    else:
        sentences.append(f"EF moves the loss by {row.async_ef.mean - row.async_.mean:+.4f} relative to async")

    if interval is None:
        confidence = "low"
        sentences.append(
            f"with {seeds} seed there is no interval for the gap, so a gap this size may be chance; "
            "rerun with --seeds 3 to know"
        )
    else:
        significant = interval.excludes(0.0)
        loose = row.gap_interval(MODERATE_LEVEL)
        confidence = "high" if significant else ("moderate" if loose is not None and loose.excludes(0.0) else "low")
        sentences.append(
            f"with {interval.n} seeds the gap's 95% interval {'excludes' if significant else 'includes'} zero"
            + ("" if significant else ": the delay's cost is not told apart from seed noise")
        )
        ef_change = row.difference(ASYNC_EF, ASYNC)
        if ef_change is not None and ef_change[1] is not None:
            changed = ef_change[1].excludes(0.0)
            sentences.append(
                f"EF's change of the final loss, {ef_change[0].mean:+.4f} ({ef_change[1].describe('{:+.4f}')}), is "
                f"{'' if changed else 'not '}significant at 95%"
            )
    text = "; ".join(sentences) + "."
    return Verdict(text, confidence, gap, pct, recovered, seeds, interval)


def confidence_statement(v: Verdict) -> str:
    explain = {
        "high": "the gap's 95% interval over seeds excludes zero",
        "moderate": "the gap's 80% interval excludes zero but its 95% interval does not; more seeds would settle it",
        "low": "the gap is within seed noise, or one seed gives no interval",
        "none": "nothing to compare",
    }
    return f"Confidence: {v.confidence} ({explain[v.confidence]})."


def build_parser(prog: str = "lightning-async probe") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Short sync / delayed / delayed+EF trainings of your recipe on one device, then a verdict: "
        "how much the one-step delay costs and how much Error Feedback recovers.",
    )
    parser.add_argument("--config", "-c", action="append", required=True,
                        help="your recipe(s), as for `lightning-async fit` (repeatable; later ones win)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    parser.add_argument("--seeds", type=int, default=1, help="number of seeds (default 1; 3 gives a spread)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--ef-strength", type=float, help="EF strength of the delayed-ef run (default: the recipe's)")
    parser.add_argument("--corrections", nargs="+", default=["ef"], metavar="NAME",
                        help=f"corrections to try next to the plain delay: {', '.join(ALL_CORRECTIONS)}, or all "
                        "(default: ef)")
    parser.add_argument("--stages", type=int, metavar="P",
                        help="also say which delay profile and correction the depth study supports for P pipeline "
                        "stages (measured configurations only; docs/results.md, Depth)")
    parser.add_argument("--output", help="where runs and the report go (default probes/<recipe>-<steps>steps)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="CLI override (repeatable)")
    add_jobs_argument(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--verbose", "-v", action="store_true", help="stream each run's output")
    return parser


def pipeline_strategy_name(value) -> str | None:
    """The class name when ``value`` (a ``trainer.strategy`` setting: registered name, class path or
    ``{class_path: ...}``) is a pipeline strategy, else ``None``."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_async.strategies import AsyncPipelineStrategy

    if isinstance(value, dict):
        value = value.get("class_path")
    if not isinstance(value, str):
        return None
    if value in StrategyRegistry:
        cls = StrategyRegistry[value]["strategy"]
    else:
        module, _, name = value.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module or "lightning_async.strategies"), name)
        except (ImportError, AttributeError, ValueError):
            return None
    return cls.__name__ if isinstance(cls, type) and issubclass(cls, AsyncPipelineStrategy) else None


def check_single_device(configs: list[str], overrides: list[str]) -> None:
    """Refuse recipes (or ``--set``) whose final ``trainer.strategy`` is a pipeline: the probe simulates the
    delay on one device, and its sync leg would otherwise run the pipeline."""
    setting, where = None, None
    for config in configs:
        if Path(config).is_file():
            try:
                with open(config) as stream:  # a stream, so that YAML errors name the file
                    recipe = yaml.safe_load(stream) or {}
            except yaml.YAMLError as err:
                raise StudyError(f"recipe {config} is not valid YAML: {err}") from err
            trainer = recipe.get("trainer") if isinstance(recipe, dict) else None
            if isinstance(trainer, dict) and "strategy" in trainer:
                setting, where = trainer["strategy"], f"recipe {config}"
    for override in overrides:
        key, _, value = override.lstrip("-").partition("=")
        if key == "trainer.strategy":
            try:
                setting = yaml.safe_load(value)
            except yaml.YAMLError:
                setting = value
            where = f"--set {key}={value}"
    name = pipeline_strategy_name(setting)
    if name:
        raise StudyError(
            f"{where} trains with a pipeline strategy ({name}), but probe compares single-device runs (sync, "
            "a simulated one-step delay, delay + EF) and would run the pipeline as its sync leg. Leave the "
            "pipeline recipe out of --config, or add --set trainer.strategy=auto --set trainer.devices=1."
        )


def probe_study(args: argparse.Namespace) -> Study:
    if args.steps < 1:
        raise StudyError("--steps must be >= 1")
    if args.stages is not None and args.stages < 1:
        raise StudyError(f"--stages must be a positive number of pipeline stages, got {args.stages}")
    if args.seeds < 1:
        raise StudyError("--seeds must be >= 1")
    try:
        args.config = [resolve_config(c) for c in args.config]  # shipped recipe names -> files
    except RecipeNotFound as err:
        raise StudyError(str(err)) from err
    stem = Path(args.config[-1]).stem
    output = Path(args.output) if args.output else Path("probes") / f"{stem}-{args.steps}steps"
    missing = [c for c in args.config if not Path(c).is_file()]
    if missing and not args.dry_run:
        raise StudyError(f"recipe file(s) not found: {', '.join(missing)}")
    overrides = parse_set(args.set)
    check_single_device(args.config, overrides)
    return Study(
        name=f"probe-{stem}",
        base=list(args.config),
        optimizers=[None],
        modes=probe_modes(args.corrections),
        seeds=list(range(args.seed, args.seed + args.seeds)),
        max_steps=args.steps,
        output=output,
        overrides=overrides,
        ef_strengths=[args.ef_strength] if args.ef_strength is not None else None,
        recipes_dir=find_recipes_dir(),
        jobs=1 if args.jobs is None else check_jobs(args.jobs),
    )


def probe_main(argv: list[str] | None = None, *, runner: Runner | None = None) -> int:
    """Entry point of ``lightning-async probe``: 0 verdict given, 1 runs failed / nothing to judge, 2 bad input."""
    args = build_parser().parse_args(argv)
    try:
        study = probe_study(args)
        result = run_study(study, runner=runner, dry_run=args.dry_run, compare=False, verbose=args.verbose)
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.dry_run:
        return 0
    try:
        report = compare([study.runs_dir], study.compare_dir, skip_invalid=True,
                         commands=[s.shell() for s in result.specs],
                         warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    except CompareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n" + report.table())
    lines = []
    for row in report.rows:
        v = verdict(row)
        prefix = f"{row.label}: " if len(report.rows) > 1 else ""
        lines += [prefix + v.text, confidence_statement(v)]
    recommendations = recommend(report.rows)
    optimizers = list(dict.fromkeys(row.optimizer for row in report.rows))
    for optimizer in optimizers:
        prefix = f"{optimizer}: " if len(recommendations) > 1 else ""
        lines.append(prefix + recommendation(recommendations.get(optimizer)))
    if args.stages is not None:
        lines.append("Depth: " + depth_advice(args.stages))
        across = optimizer_advice(args.stages) if args.stages > 1 else None
        if across is not None:
            lines.append("Depth: " + across)
    lines += ["Schedules: " + line for line in family_advice(optimizers).splitlines()]
    text = "\n".join(lines)
    print("\n" + text)
    (study.compare_dir / "verdict.md").write_text("# Probe verdict\n\n" + text.replace("\n", "\n\n") + "\n")
    print(f"\nreport: {report.report}")
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(probe_main())
