"""Training the runs of a matrix in order, one at a time or up to ``jobs`` at the same time.

Both ways share the bookkeeping of :class:`MatrixProgress`: a finished run is skipped, a run to train
takes its lock and loses what a half-finished attempt left, and each run that ends gets its status line
``[i/total] name: status in T (elapsed E, ETA R)``. With several runs in flight each runner is called in a
thread of its own while the main thread keeps all the bookkeeping and printing, and is the one that gets
the signals: a stop passes the signal on to every run (:class:`~.runner.RunningProcesses`) and waits for
them all before re-raising.
"""

from __future__ import annotations

import math
import queue
import shutil
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable

from lightning_async.tools.study.locks import run_lock
from lightning_async.tools.study.outcome import StudyResult, run_outcome, run_state
from lightning_async.tools.study.runner import RunningProcesses, StudyTerminated
from lightning_async.tools.study.spec import Runner, RunSpec


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _tail(path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _interrupted(stop: BaseException, names: list[str]) -> str:
    why = f" ({signal.Signals(stop.signum).name})" if isinstance(stop, StudyTerminated) else ""
    what = "the run was stopped" if len(names) == 1 else "the runs were stopped"
    return (f"interrupted{why} during {', '.join(names)}; {what}. Rerun the same command to resume "
            "(finished runs are kept)")


class MatrixProgress:
    """The bookkeeping of one pass over the matrix: skips, locks, clean-up, outcomes and status lines."""

    def __init__(self, specs: list[RunSpec], result: StudyResult, *, jobs: int, print_fn: Callable[[str], None],
                 clock: Callable[[], float]) -> None:
        self.result, self.jobs, self.say, self.clock = result, jobs, print_fn, clock
        self.total = len(specs)
        self.start = clock()
        self.durations: list[float] = []
        self.remaining = sum(not s.finished for s in specs)

    def begin(self, i: int, spec: RunSpec) -> bool:
        """Skip a finished run (``False``), or take its lock and remove what an earlier attempt left (``True``)."""
        if spec.finished:
            self.result.skipped.append(spec.name)
            self.say(f"[{i}/{self.total}] {spec.name}: {run_state(spec).replace(', skip', ', skipped')}")
            return False
        lock = run_lock(spec)
        lock.acquire(self.say)
        try:
            if spec.run_dir.exists():
                why = "finished with different arguments" if spec.stale else "half-finished"
                self.say(f"[{i}/{self.total}] {spec.name}: removing {why} run {spec.run_dir}")
                shutil.rmtree(spec.run_dir)
            self.say(f"[{i}/{self.total}] {spec.name}: running (log: {spec.log_path})")
        except BaseException:
            lock.release()
            raise
        return True

    def end(self, i: int, spec: RunSpec, rc: int, started: float) -> str:
        """Release the run's lock, record its outcome and print its status line; returns the outcome's kind."""
        run_lock(spec).release()
        self.durations.append(self.clock() - started)
        self.remaining -= 1
        eta = (sum(self.durations) / len(self.durations)) * math.ceil(self.remaining / self.jobs)
        kind, status = run_outcome(spec, rc)
        if kind == "failed":
            self.result.failed.append(spec.name)
            if spec.log_path.exists():
                self.say(f"--- last lines of {spec.log_path} ---\n{_tail(spec.log_path)}\n---")
        else:
            (self.result.ran if kind == "ok" else self.result.diverged).append(spec.name)
            spec.record_command()
        self.say(
            f"[{i}/{self.total}] {spec.name}: {status} in {_fmt_time(self.durations[-1])} "
            f"(elapsed {_fmt_time(self.clock() - self.start)}, ETA {_fmt_time(eta)})"
        )
        return kind


def run_in_order(specs: list[RunSpec], runner: Runner, progress: MatrixProgress, *, fail_fast: bool) -> None:
    """One run after the other, in this thread (an interrupt reaches the runner itself)."""
    for i, spec in enumerate(specs, 1):
        if not progress.begin(i, spec):
            continue
        started = progress.clock()
        try:
            rc = runner(spec)
        except BaseException as stop:
            run_lock(spec).release()
            if isinstance(stop, KeyboardInterrupt):
                progress.say(_interrupted(stop, [spec.name]))
            raise
        if progress.end(i, spec, rc, started) == "failed" and fail_fast:
            progress.say("stopping at the first failure (--fail-fast)")
            break


def _follow(runner: Runner, spec: RunSpec, ended: queue.Queue) -> None:
    try:
        ended.put((spec.name, runner(spec), None))
    except BaseException as error:  # noqa: BLE001 - handed to the main thread, which re-raises it
        ended.put((spec.name, None, error))


def run_concurrently(specs: list[RunSpec], runner: Runner, progress: MatrixProgress, *, jobs: int, fail_fast: bool,
                     running: RunningProcesses) -> None:
    """Up to ``jobs`` runs at the same time, launched in matrix order; ``--fail-fast`` stops the launching
    and lets the runs in flight finish. The result lists end up in matrix order."""
    ended: queue.Queue = queue.Queue()
    in_flight: dict[str, tuple[int, RunSpec, float, threading.Thread]] = {}
    todo = deque(enumerate(specs, 1))
    launching = True
    try:
        while True:
            while launching and todo and len(in_flight) < jobs:
                i, spec = todo.popleft()
                if progress.begin(i, spec):
                    thread = threading.Thread(target=_follow, args=(runner, spec, ended), name=f"study {spec.name}",
                                              daemon=True)
                    in_flight[spec.name] = (i, spec, progress.clock(), thread)
                    thread.start()
            if not in_flight:
                break
            name, rc, error = ended.get()
            if error is not None:
                raise error
            i, spec, started, _ = in_flight.pop(name)
            if progress.end(i, spec, rc, started) == "failed" and fail_fast and launching:
                launching = False
                waiting = f"; waiting for the {len(in_flight)} run(s) in flight" if in_flight else ""
                progress.say(f"stopping at the first failure (--fail-fast){waiting}")
    except BaseException as stop:
        _stop_in_flight(stop, in_flight, running, progress)
        raise
    order = {spec.name: i for i, spec in enumerate(specs)}
    for names in (progress.result.ran, progress.result.skipped, progress.result.failed, progress.result.diverged):
        names.sort(key=order.__getitem__)


def _stop_in_flight(stop: BaseException, in_flight: dict[str, tuple[int, RunSpec, float, threading.Thread]],
                    running: RunningProcesses, progress: MatrixProgress) -> None:
    """Pass the stop on to every run in flight (SIGINT for Ctrl-C, the signal received, SIGTERM after an
    error), wait for their runners to return, and release their locks."""
    if isinstance(stop, StudyTerminated):
        signum = stop.signum
    else:
        signum = signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
    running.stop(signum, lambda m: print(f"study: {m}", file=sys.stderr, flush=True))
    for _, spec, _, thread in in_flight.values():
        if thread.ident is not None:  # started
            thread.join()
        run_lock(spec).release()
    if isinstance(stop, KeyboardInterrupt):
        progress.say(_interrupted(stop, list(in_flight)))
