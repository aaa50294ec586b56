"""Executing one run: ``lightning-async fit`` as a subprocess (stopped cleanly with the study), or a synthetic run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from lightning_async.identity import SYNC_MODES
from lightning_async.tools.study.locks import run_lock
from lightning_async.tools.study.spec import RunSpec

STOP_GRACE_S = 30.0  # how long a stopped study waits for its runs to end before SIGKILL


class StudyTerminated(KeyboardInterrupt):
    """The study received ``signum`` (SIGTERM): handled like Ctrl-C, the exit status is 128 + ``signum``."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`StudyTerminated` (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise StudyTerminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the run's own process group: the CLI and any ranks it started
    except (ProcessLookupError, PermissionError):
        pass


def stop_runs(procs: Sequence[subprocess.Popen], signum: int, grace: float, say: Callable[[str], None]) -> None:
    """Pass ``signum`` on to the process group of each run and wait for them all; SIGKILL after ``grace``
    seconds or at a second interrupt."""
    for proc in procs:
        _signal_group(proc, signum)
    deadline = time.monotonic() + grace
    several = len(procs) > 1
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return
    except subprocess.TimeoutExpired:
        late = f"{sum(proc.poll() is None for proc in procs)} of the runs" if several else "the run"
        say(f"{late} did not stop within {grace:g}s of {signal.Signals(signum).name}; "
            f"killing {'them' if several else 'it'}")
    except KeyboardInterrupt:
        say(f"interrupted again: killing the run{'s' if several else ''}")
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def stop_run(proc: subprocess.Popen, signum: int, grace: float, say: Callable[[str], None]) -> int:
    """:func:`stop_runs` for one run; returns its exit status."""
    stop_runs([proc], signum, grace, say)
    return proc.wait()


class RunningProcesses:
    """The training processes of the runs in flight (several under ``--jobs``), so that a stop of the study
    reaches every one of them from the main thread (signals never reach the threads that follow the runs)."""

    def __init__(self) -> None:
        self._procs: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self.signum: int | None = None  # the signal the study was stopped with, once it was

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.add(proc)
            signum = self.signum
        if signum is not None:  # started while the study was being stopped
            _signal_group(proc, signum)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(proc)

    def stop(self, signum: int, say: Callable[[str], None]) -> None:
        """:func:`stop_runs` on every process in flight (``STOP_GRACE_S``), and on any started meanwhile."""
        handled: set[subprocess.Popen] = set()
        while True:
            with self._lock:
                self.signum = signum
                procs = [p for p in self._procs if p not in handled]
            if not procs:
                return
            stop_runs(procs, signum, STOP_GRACE_S, say)
            handled.update(procs)


def run_env(jobs: int = 1, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a training subprocess: this one's (or ``environ``), unbuffered; with ``jobs`` > 1
    runs at the same time each gets ``OMP_NUM_THREADS`` = cores // jobs (at least 1) unless it is set."""
    env = dict(os.environ if environ is None else environ, PYTHONUNBUFFERED="1")
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    return env


def carry_niceness(pid: int) -> None:
    """Give the run ``pid`` this process's nice value as its scheduler autogroup's nice.

    A run starts its own session (so that a stop reaches all its ranks), and on Linux with autogroup scheduling
    (``kernel.sched_autogroup_enabled``, the default on most distributions) a new session is a new group whose
    CPU share ignores the processes' own nice values: ``nice lightning-async study`` would not yield to other
    work. Writing the nice value to ``/proc/<pid>/autogroup`` restores what the user asked for; a no-op when
    this process is not niced or the kernel has no autogroups.
    """
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= 0:
        return
    try:
        with open(f"/proc/{pid}/autogroup", "w") as group:
            group.write(str(nice))
    except OSError:  # no autogroup support, or the run has already ended
        pass


def _copy_lines(stream, log) -> None:
    for line in stream:
        log.write(line)


def subprocess_runner(spec: RunSpec, *, verbose: bool = False, grace: float | None = None, jobs: int = 1,
                      running: RunningProcesses | None = None) -> int:
    """Run one training as a subprocess; its output goes to ``spec.log_path`` (and the terminal if verbose,
    each line prefixed with the run name when ``jobs`` > 1), its environment is :func:`run_env`.

    The training runs in its own process group, at this process's niceness (:func:`carry_niceness`), and its pid
    goes into the run's lock (and into ``running``, through which a study with several runs in flight stops
    them). When the study is interrupted in this thread (Ctrl-C, or SIGTERM under :func:`terminate_as_interrupt`)
    the same signal is passed on to that group and the study waits for the run to end (:func:`stop_run`) before
    re-raising.
    """
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    echo = f"{spec.name}: " if jobs > 1 else ""
    with open(spec.log_path, "w") as log:
        log.write("$ " + spec.shell() + "\n\n")
        log.flush()
        proc = subprocess.Popen(spec.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=run_env(jobs),
                                text=True, start_new_session=True)
        carry_niceness(proc.pid)
        if running is not None:
            running.add(proc)
        try:
            run_lock(spec).set_child(proc.pid)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    sys.stdout.write(echo + line)
            rc = proc.wait()
        except BaseException as stop:
            signum = getattr(stop, "signum", signal.SIGINT) if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
            drain = threading.Thread(target=_copy_lines, args=(proc.stdout, log), daemon=True)
            drain.start()  # keep the pipe flowing while the run shuts down
            rc = stop_run(proc, signum, STOP_GRACE_S if grace is None else grace,
                          lambda m: print(f"study: {spec.name}: {m}", file=sys.stderr, flush=True))
            drain.join(timeout=5)
            log.write(f"\n(stopped by the study: {signal.Signals(signum).name}; exit {rc})\n")
            raise
        finally:
            if running is not None:
                running.discard(proc)
        if running is not None and running.signum is not None:
            log.write(f"\n(stopped by the study: {signal.Signals(running.signum).name}; exit {rc})\n")
        return rc


#: gap (async - sync) of the synthetic runner, by optimizer: AdamW and MARS hurt, the others barely
_FAKE_GAPS = {"adamw": 0.28, "mars": 0.2}
#: share of the gap the synthetic runner's corrections win back (EF 75%, as in the paper's order of magnitude)
_FAKE_RECOVERY = {"ef": 0.75, "adaptive-ef": 0.7, "nesterov": 0.6, "dc-asgd": 0.05, "weight-prediction": 0.5}


def synthetic_runner(spec: RunSpec) -> int:
    """A stand-in for training (``--fake``): writes a run dir that follows the run conventions, with
    made-up losses (sync 2.6; async + 0.28 for AdamW/MARS, + 0.015 otherwise; a correction recovers the share of
    :data:`_FAKE_RECOVERY`, EF 75%; a small seed effect). Rehearses a study's bookkeeping and report in seconds."""
    from lightning_async.compare.synthetic import write_fake_run

    seed = spec.seed or 0
    final = 2.6 + 0.004 * ((seed * 7919) % 5 - 2)
    if spec.mode not in SYNC_MODES:
        gap = _FAKE_GAPS.get(spec.optimizer or "", 0.015) * (spec.delay or 1)
        final += gap * (1.0 - _FAKE_RECOVERY.get(spec.correction, 0.0))
    steps = spec.max_steps or 100
    curve = {int(steps * f): final + 2.0 * (1 - f) ** 2 for f in (0.25, 0.5, 0.75, 1.0)}
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    spec.log_path.write_text("$ " + spec.shell() + "\n(synthetic run: nothing trained)\n")
    write_fake_run(
        spec.run_dir, optimizer=spec.optimizer or "adamw", mode=spec.logged_mode, correction=spec.correction,
        correction_strength=(spec.ef_strength or None) if spec.uses_ef else None, delay=spec.delay, seed=spec.seed,
        lr=spec.lr, val_loss=curve, done={"synthetic": True},
    )
    return 0
