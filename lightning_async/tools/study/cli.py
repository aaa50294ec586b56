"""``lightning-async study`` on the command line: the options, the study they make, the exit status."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_async.recipes_index import find_recipe
from lightning_async.tools.study.loop import run_study
from lightning_async.tools.study.matrix import Study
from lightning_async.tools.study.parsing import add_jobs_argument, check_jobs, load_study, parse_set
from lightning_async.tools.study.runner import StudyTerminated, synthetic_runner
from lightning_async.tools.study.spec import Runner, StudyError


def build_parser(prog: str = "lightning-async study") -> argparse.ArgumentParser:
    """The options of ``lightning-async study``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a matrix of trainings (optimizers x modes x lrs x seeds) one after another (or --jobs N "
        "at a time), skipping finished runs, then compare them. `lightning-async recipes` lists the shipped "
        "studies (study/); see docs/compare.md.",
    )
    parser.add_argument("--config", "-c", required=True,
                        help="study YAML: a path, or a shipped study by name (e.g. quickstart)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--data-override", action="append", default=[], metavar="FILE.yaml",
                        help="extra config added after the recipes of every run (e.g. a data section)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="CLI override for every run, e.g. --set data.path=corpus.txt (repeatable)")
    parser.add_argument("--output", help="override the study's output dir")
    parser.add_argument("--max-steps", type=int, help="override the study's max_steps")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the study's seeds")
    parser.add_argument("--only", nargs="+", metavar="OPTIMIZER", help="run only these optimizers of the study")
    parser.add_argument("--modes", nargs="+", metavar="MODE", help="run only these modes of the study")
    parser.add_argument("--lr", action="append", default=[], metavar="OPTIMIZER=LR[,LR...]",
                        help="replace the study's lrs of one optimizer, e.g. --lr adamw=3e-2 (repeatable)")
    parser.add_argument("--no-compare", action="store_true", help="do not run compare at the end")
    parser.add_argument("--paper", action="store_true", help="add the paper's numbers to the report")
    parser.add_argument("--fail-fast", action="store_true",
                        help="stop at the first failed run (with --jobs: launch no more, let the running ones finish)")
    add_jobs_argument(parser)
    parser.add_argument("--verbose", "-v", action="store_true", help="stream each run's output")
    parser.add_argument("--fake", action="store_true",
                        help="rehearsal: write synthetic runs instead of training (check bookkeeping and report)")
    return parser


def parse_lr_override(item: str, optimizers: list) -> tuple[str, list[float]]:
    """``--lr OPTIMIZER=LR[,LR...]``: the optimizer (one of the study's) and its learning rates."""
    optimizer, _, values = item.partition("=")
    if optimizer not in optimizers:
        raise StudyError(f"--lr {item}: give OPTIMIZER=LR[,LR...] with one of the study's optimizers {optimizers}")
    try:
        lrs = [float(v) for v in values.split(",")]
    except ValueError:
        raise StudyError(f"--lr {item}: {values!r} is not a comma-separated list of numbers") from None
    if any(not lr > 0 for lr in lrs):
        raise StudyError(f"--lr {item}: learning rates must be positive")
    return optimizer, lrs


def study_from_args(args: argparse.Namespace) -> Study:
    """The study of ``--config`` with the command line's overrides applied."""
    study = load_study(args.config)
    if args.output:
        study.output = Path(args.output)
    if args.max_steps is not None:  # (one length for every run, also in place of the study's lengths)
        study.max_steps, study.lengths = args.max_steps, None
    if args.seeds:
        study.seeds = list(dict.fromkeys(args.seeds))
    if args.only:
        bad = [o for o in args.only if o not in study.optimizers]
        if bad:
            raise StudyError(f"--only {' '.join(bad)}: not in the study's optimizers {study.optimizers}")
        study.optimizers = [o for o in study.optimizers if o in args.only]
    if args.modes:
        bad = [m for m in args.modes if m not in study.modes]
        if bad:
            raise StudyError(f"--modes {' '.join(bad)}: not in the study's modes {study.modes}")
        study.modes = [m for m in study.modes if m in args.modes]
    for item in args.lr:
        optimizer, lrs = parse_lr_override(item, study.optimizers)
        study.lrs[optimizer] = lrs
    for extra in args.data_override:
        found = extra if Path(extra).is_file() else find_recipe(extra, study.recipes_dir)
        if found is None:
            raise StudyError(f"--data-override {extra}: no such file, and no shipped recipe of that name")
        study.extra_configs.append(str(found))
    study.overrides = study.overrides + parse_set(args.set)
    if args.jobs is not None:
        study.jobs = check_jobs(args.jobs)
    return study


def study_main(argv: list[str] | None = None, *, runner: Runner | None = None) -> int:
    """Entry point of ``lightning-async study``: 0 all ran (or diverged) and compared, 1 some run failed,
    2 bad input or a run still in progress elsewhere, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM."""
    args = build_parser().parse_args(argv)
    if args.fake and runner is None:
        runner = synthetic_runner
    try:
        study = study_from_args(args)
        result = run_study(
            study, runner=runner, dry_run=args.dry_run, compare=not args.no_compare, fail_fast=args.fail_fast,
            verbose=args.verbose, paper=args.paper,
        )
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StudyTerminated as stop:
        return 128 + stop.signum
    except KeyboardInterrupt:
        return 130
    if args.dry_run:
        return 0
    if result.failed:
        return 1
    return 0 if result.compare_error is None else 1
