"""A whole study: check that no run of it trains elsewhere, train the missing runs, sum up, then ``compare``."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from lightning_async.run_limits import first_runs
from lightning_async.tools.study.locks import run_lock
from lightning_async.tools.study.matrix import Study
from lightning_async.tools.study.outcome import StudyResult, run_state
from lightning_async.tools.study.parsing import check_jobs
from lightning_async.tools.study.runner import RunningProcesses, subprocess_runner, terminate_as_interrupt
from lightning_async.tools.study.scheduler import MatrixProgress, run_concurrently, run_in_order
from lightning_async.tools.study.spec import Runner, RunSpec, StudyError


def run_study(
    study: Study,
    *,
    runner: Runner | None = None,
    dry_run: bool = False,
    compare: bool = True,
    fail_fast: bool = False,
    verbose: bool = False,
    paper: bool = False,
    jobs: int | None = None,
    print_fn: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> StudyResult:
    """Run every missing run of ``study`` in order, ``jobs`` (default ``study.jobs``) at a time, then
    ``compare`` the runs dir.

    ``runner(spec) -> exit status`` executes one run (default: :func:`~.runner.subprocess_runner`); with
    ``jobs`` > 1 it is called from several threads at once. Finished runs (``DONE``) and diverged ones are
    skipped; half-finished run dirs are removed first. Raises :class:`~.locks.RunInProgress` before touching
    anything if another process still trains one of the runs (see :class:`~.locks.RunLock`).
    ``KeyboardInterrupt`` (and :class:`~.runner.StudyTerminated`, for SIGTERM) propagates after the runs in
    flight stopped and a note on how to resume.
    """
    jobs = check_jobs(study.jobs if jobs is None else jobs)
    at_a_time = f" ({jobs} at a time)" if jobs > 1 else ""
    specs = study.expand()
    result = StudyResult(specs=specs)
    total = len(specs)
    if dry_run:
        print_fn(f"study {study.name}: {total} runs -> {study.output}{at_a_time}")
        for i, spec in enumerate(specs, 1):
            print_fn(f"[{i}/{total}] {spec.name} ({run_state(spec)})\n  {spec.shell()}")
        missing = study.missing_files()
        if missing:
            print_fn("warning: recipe files not found (yet): " + ", ".join(missing))
        return result
    try:  # LIGHTNING_ASYNC_MAX_RUNS=N: only the first N runs train (the docs test; run_limits.py)
        specs, left_out = first_runs(specs)
    except ValueError as err:
        raise StudyError(str(err)) from err
    if left_out:
        print_fn(left_out)
        result.specs, total = specs, len(specs)
    running = RunningProcesses()
    if runner is None:
        missing = study.missing_files()
        if missing:
            raise StudyError("recipe files not found: " + ", ".join(missing) + " (give paths that exist, or "
                             "names of shipped recipes: `lightning-async recipes` lists them)")

        def runner(spec: RunSpec) -> int:
            return subprocess_runner(spec, verbose=verbose, jobs=jobs, running=running)

    for spec in specs:  # before anything is removed: a run still training elsewhere stops the study here
        run_lock(spec).check(print_fn)
    study.runs_dir.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if not s.finished]
    print_fn(f"study {study.name}: {total} runs, {total - len(todo)} already done, {len(todo)} to run -> "
             f"{study.output}{at_a_time}")
    with terminate_as_interrupt():
        progress = MatrixProgress(specs, result, jobs=jobs, print_fn=print_fn, clock=clock)
        if jobs > 1:
            run_concurrently(specs, runner, progress, jobs=jobs, fail_fast=fail_fast, running=running)
        else:
            run_in_order(specs, runner, progress, fail_fast=fail_fast)
        if result.failed:
            print_fn(f"{len(result.failed)} run(s) failed: {', '.join(result.failed)}; rerun to retry them")
        if result.diverged:
            print_fn(f"{len(result.diverged)} run(s) diverged: {', '.join(result.diverged)} (a result: marked "
                     "DIVERGED in the report and not retried; delete a run's directory to train it again)")
        if compare:
            _compare_study(study, specs, result, paper=paper, print_fn=print_fn)
    return result


def _compare_study(study: Study, specs: list[RunSpec], result: StudyResult, *, paper: bool,
                   print_fn: Callable[[str], None]) -> None:
    from lightning_async.compare import CompareError
    from lightning_async.compare import compare as run_compare

    commands = [f"lightning-async compare {shlex.quote(str(study.runs_dir))} --output "
                f"{shlex.quote(str(study.compare_dir))}"] + [s.shell() for s in specs]
    try:
        result.compare_result = run_compare(
            [study.runs_dir], study.compare_dir, paper=paper, commands=commands, skip_invalid=True,
            warn=lambda m: print_fn(f"warning: {m}"),
        )
    except CompareError as err:
        result.compare_error = str(err)
        print_fn(f"compare: {err}")
    else:
        print_fn("\n" + result.compare_result.table(paper=paper))
        print_fn(f"\nreport: {result.compare_result.report}")
