"""``lightning-async study``: run a matrix of trainings (optimizers x modes x lrs x seeds), then compare.

A study YAML (see ``recipes/study/*.yaml`` and ``docs/compare.md``)::

    name: quickstart                     # default: the file's stem
    base: [quickstart]                   # recipes every run starts from (later ones win): names or paths
    optimizers: [adamw, muon]            # each adds the recipe optimizers/<name> if it exists
    optimizer_recipes: study/nano        # optional: a recipe folder whose <name>.yaml (if any) follows
                                         # optimizers/<name> (settings tuned for this study)
    modes: [sync, delayed, delayed-ef]   # sync | delayed | delayed-ef | async_pipe | sync_pipe, or
                                         # delayed-<c> / async_pipe-<c> for a recipe corrections/<c>.yaml
    lrs: {adamw: [1e-3, 3e-3]}           # optional: a number, a list, or per optimizer
    seeds: [0, 1]                        # a list, or an int N meaning 0..N-1 (default [0])
    max_steps: 200                       # optional --trainer.max_steps
    output: studies/quickstart           # default studies/<name>
    overrides: ["--data.source", "text"] # extra CLI args (a list) or {key: value}
    ef_strengths: [0.5, 1.0]             # optional ablation of the delayed-ef modes
    delays: [1, 2]                       # optional ablation of the delayed modes

Runs go to ``<output>/runs/<run name>/`` (run name ``{optimizer}-{mode}-lr{lr}-s{seed}``, the lr part
only when ``lrs`` is given), the log of each run to ``<output>/logs/<run name>.log``, the report to
``<output>/compare/``. A run whose dir holds ``DONE`` is skipped, and so is one that diverged
(``DIVERGED``, or non-finite loss curves: a result, reported as such, not retried); a dir without
either is a half-finished run: it is removed and the run starts over. So rerunning the same command
after an interruption resumes the study.

While a run trains, ``<output>/runs/<run name>.lock`` holds the pids of the study and of the training
process: a second study on the same output refuses to start while either is alive (and so never
deletes a directory that is still being written), and takes over a lock whose processes are gone.
SIGTERM (or Ctrl-C) stops the study: the signal is passed on to the training's process group, the
study waits for it to end (``STOP_GRACE_S``, then SIGKILL) and exits with 128 + the signal number.

The function that executes one run is injectable (``run_study(..., runner=...)``): the default
launches ``lightning-async fit ...`` as a subprocess; tests pass a function that writes a fake run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_async.compare.divergence import DIVERGED_FILE, DONE_FILE, find_divergence, write_marker
from lightning_async.recipes_index import find_recipe, recipes_root

#: The seven optimizers of the paper's comparison, always accepted.
KNOWN_OPTIMIZERS = ("adamw", "muon", "normuon", "adan", "soap", "lion", "mars")

@dataclass(frozen=True)
class StudyMode:
    """A study mode: the recipes (relative to the recipes dir) a run of it adds, the ``mode`` the run records,
    and the correction it applies."""

    name: str
    recipes: tuple[str, ...]
    logged: str
    correction: str = "none"


#: the modes every study knows; ``delayed-<c>`` / ``async_pipe-<c>`` add ``corrections/<c>.yaml`` (any shipped)
MODES: dict[str, StudyMode] = {
    m.name: m for m in (
        StudyMode("sync", ("modes/sync.yaml",), "sync"),
        StudyMode("delayed", ("modes/delayed.yaml",), "delayed"),
        StudyMode("delayed-ef", ("modes/delayed-ef.yaml",), "delayed", "ef"),
        StudyMode("async_pipe", ("pipeline/async.yaml",), "async_pipe"),
        StudyMode("sync_pipe", ("pipeline/sync.yaml",), "sync_pipe"),
    )
}
CORRECTED_BASES = ("delayed", "async_pipe")


def study_mode(name: str, recipes_dir: Path | None) -> StudyMode | None:
    """The mode called ``name``: one of :data:`MODES`, or ``<delayed|async_pipe>-<correction recipe>``."""
    if name in MODES:
        return MODES[name]
    for base in CORRECTED_BASES:
        method = name[len(base) + 1:] if name.startswith(base + "-") else ""
        if method and recipes_dir is not None and (recipes_dir / "corrections" / f"{method}.yaml").is_file():
            return StudyMode(name, MODES[base].recipes + (f"corrections/{method}.yaml",), MODES[base].logged, method)
    return None


def valid_modes(recipes_dir: Path | None) -> list[str]:
    folder = recipes_dir / "corrections" if recipes_dir is not None else None
    methods = sorted(p.stem for p in folder.glob("*.yaml")) if folder is not None and folder.is_dir() else []
    return list(MODES) + [f"{base}-{m}" for base in CORRECTED_BASES for m in methods if f"{base}-{m}" not in MODES]


STUDY_KEYS = (
    "name", "description", "base", "optimizers", "modes", "lrs", "seeds", "max_steps", "output", "overrides",
    "ef_strengths", "delays", "ef_strength_key", "delay_key", "launcher", "optimizer_recipes",
)
DEFAULT_EF_STRENGTH_KEY = "error_feedback.strength"
DEFAULT_DELAY_KEY = "delay.delay"
COMMAND_FILE = "STUDY_COMMAND.json"  # written into a finished run dir: the args that produced it
LOCK_SUFFIX = ".lock"  # <runs dir>/<run name>.lock while the run trains
STOP_GRACE_S = 30.0  # how long a stopped study waits for its run to end before SIGKILL


def validation_interval(max_steps: int, evaluations: int = 5) -> int:
    """Smallest divisor of ``max_steps`` giving at most ``evaluations`` validations; the last lands on the final step."""
    for interval in range(max(1, -(-max_steps // evaluations)), max_steps + 1):
        if max_steps % interval == 0:
            return interval
    return max_steps


class StudyError(ValueError):
    """A study file or command line that cannot run; the message says what is wrong and what is valid."""


def valid_optimizers(recipes_dir: Path | None = None) -> list[str]:
    """Known optimizers: the paper's seven, the zoo's names, and any ``recipes/optimizers/*.yaml``."""
    names = set(KNOWN_OPTIMIZERS)
    try:
        from lightning_async.optim import OPTIMIZER_NAMES

        names.update(OPTIMIZER_NAMES)
    except Exception:  # noqa: BLE001 - the zoo is optional for validation
        pass
    recipes_dir = recipes_dir or find_recipes_dir()
    if recipes_dir is not None and (recipes_dir / "optimizers").is_dir():
        names.update(p.stem for p in (recipes_dir / "optimizers").glob("*.yaml"))
    return sorted(names)


def find_recipes_dir() -> Path:
    """The shipped recipes (:func:`~lightning_async.recipes_index.recipes_root`), relative to the current
    directory when they are below it (``recipes`` in the repository root), so commands stay short."""
    root = recipes_root()
    try:
        return root.relative_to(Path.cwd())
    except ValueError:
        return root


def default_launcher() -> list[str]:
    """This environment's ``lightning-async`` (by name when it is also the one on the PATH, else by its path:
    runs never use another installation's), or ``python -m lightning_async.cli`` when it has none."""
    mine = Path(sys.executable).with_name("lightning-async")
    if not mine.is_file():
        return [sys.executable, "-m", "lightning_async.cli"]
    on_path = shutil.which("lightning-async")
    return ["lightning-async"] if on_path and Path(on_path).samefile(mine) else [str(mine)]


def _fmt_lr(lr: float) -> str:
    return f"{lr:g}"


def _fmt_time(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@dataclass
class RunSpec:
    """One run of the matrix: its identity, where it writes, and the command that trains it."""

    name: str
    optimizer: str | None
    mode: str  # study mode (sync, delayed, delayed-ef, async_pipe, sync_pipe)
    lr: float | None
    seed: int | None
    ef_strength: float | None  # None: the recipe's default
    delay: int | None  # None: the recipe's default
    run_dir: Path
    log_path: Path
    command: list[str]
    max_steps: int | None = None
    mode_info: StudyMode | None = None  # None: MODES[mode]

    @property
    def logged_mode(self) -> str:
        """The ``mode`` the run records in ``hparams.yaml``."""
        return (self.mode_info or MODES[self.mode]).logged

    @property
    def correction(self) -> str:
        """The correction the run applies (``none``, ``ef``, ...)."""
        return (self.mode_info or MODES[self.mode]).correction

    @property
    def uses_ef(self) -> bool:
        return self.correction == "ef"

    @property
    def done(self) -> bool:
        """Finished (``DONE``) by this very command (a run finished with other arguments is not done)."""
        return (self.run_dir / DONE_FILE).exists() and not self.stale

    @property
    def diverged(self) -> bool:
        """Holds a ``DIVERGED`` marker (from the guard, or written by the study from the loss curves)."""
        return (self.run_dir / DIVERGED_FILE).exists() and not self.stale

    @property
    def finished(self) -> bool:
        """Has a result from this very command: done or diverged (neither is run again)."""
        return self.done or self.diverged

    @property
    def lock_path(self) -> Path:
        return self.run_dir.with_name(self.run_dir.name + LOCK_SUFFIX)

    @property
    def train_args(self) -> list[str]:
        """The command without its launcher (what decides the result; the launcher path may move)."""
        return self.command[self.command.index("fit"):] if "fit" in self.command else list(self.command)

    @property
    def stale(self) -> bool:
        """True when the run dir records a different command than this spec's (e.g. other max_steps)."""
        record = self.run_dir / COMMAND_FILE
        if not record.is_file():
            return False
        try:
            return json.loads(record.read_text()) != self.train_args
        except ValueError:
            return True

    def record_command(self) -> None:
        if self.run_dir.is_dir():
            (self.run_dir / COMMAND_FILE).write_text(json.dumps(self.train_args))

    def shell(self) -> str:
        return shlex.join(self.command)


Runner = Callable[[RunSpec], int]


# ---- run locks ----------------------------------------------------------------------------------
def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class RunInProgress(StudyError):
    """A run of the study is still being trained by another process (its lock is held)."""


@dataclass
class RunLock:
    """``<run name>.lock``: JSON with the study's ``pid``, the training's ``child_pid``, ``host``, ``since``.

    Held while a run trains. A lock is *live* while any of its pids is alive (or when it was taken on
    another host, which cannot be checked from here); a lock whose processes are all gone is *stale*
    and may be taken over.
    """

    path: Path
    run: str

    def read(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    @staticmethod
    def pids(info: dict[str, Any]) -> list[int]:
        return [int(info[k]) for k in ("pid", "child_pid") if isinstance(info.get(k), int)]

    def is_live(self, info: dict[str, Any]) -> bool:
        if info.get("host", socket.gethostname()) != socket.gethostname():
            return True
        if not info:  # unreadable: maybe being written this instant by another study
            try:
                return time.time() - self.path.stat().st_mtime < 10
            except OSError:
                return False
        return any(pid_alive(pid) for pid in self.pids(info))

    def holder(self, info: dict[str, Any]) -> str:
        pids = " and ".join(f"{k.replace('_', ' ')} {info[k]}" for k in ("pid", "child_pid") if k in info) or "no pid"
        host = info.get("host", "?")
        where = "" if host == socket.gethostname() else f" on host {host} (cannot be checked from here)"
        return f"{pids}{where}, since {info.get('since', '?')}"

    def check(self, say: Callable[[str], None]) -> None:
        """Raise :class:`RunInProgress` if the lock is live; remove it (with a message) if stale."""
        info = self.read()
        if info is None:
            return
        if self.is_live(info):
            here = info.get("host", socket.gethostname()) == socket.gethostname()
            running = [p for p in self.pids(info) if pid_alive(p)] if here else self.pids(info)
            raise RunInProgress(
                f"run {self.run} is still in progress ({self.holder(info)}; lock {self.path}). Wait for it to "
                f"end or stop it (kill {' '.join(map(str, running)) or '<pid>'}), then rerun; delete the "
                "lock by hand only if no such process runs"
            )
        say(f"taking over the stale lock {self.path} of run {self.run} ({self.holder(info)}: no such process now)")
        self.path.unlink(missing_ok=True)

    def acquire(self, say: Callable[[str], None]) -> None:
        """Create the lock for this process (atomically); a stale one is taken over, a live one refused."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self.check(say)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self._info(), f)
            return
        raise RunInProgress(f"run {self.run}: could not take the lock {self.path} (another study keeps taking it)")

    def set_child(self, pid: int) -> None:
        """Record the training process, so that a later study sees it even if this one is killed."""
        info = self.read()
        if info is not None and info.get("pid") == os.getpid():
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({**info, "child_pid": pid}))
            os.replace(tmp, self.path)

    def release(self) -> None:
        info = self.read()
        if info is not None and info.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def _info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "run": self.run,
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_lock(spec: RunSpec) -> RunLock:
    return RunLock(spec.lock_path, spec.name)


# ---- stopping ----------------------------------------------------------------------------------
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


def stop_run(proc: subprocess.Popen, signum: int, grace: float, say: Callable[[str], None]) -> int:
    """Pass ``signum`` on to the run's process group and wait for it; SIGKILL after ``grace`` seconds
    or at a second interrupt. Returns the run's exit status."""
    _signal_group(proc, signum)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        say(f"the run did not stop within {grace:g}s of {signal.Signals(signum).name}; killing it")
    except KeyboardInterrupt:
        say("interrupted again: killing the run")
    _signal_group(proc, signal.SIGKILL)
    return proc.wait()


@dataclass
class Study:
    """A parsed, validated study."""

    name: str
    base: list[str]
    optimizers: list[str | None]
    modes: list[str]
    lrs: dict[str | None, list[float | None]] = field(default_factory=dict)
    seeds: list[int | None] = field(default_factory=lambda: [0])
    max_steps: int | None = None
    output: Path = Path("studies/study")
    overrides: list[str] = field(default_factory=list)
    ef_strengths: list[float] | None = None
    delays: list[int] | None = None
    ef_strength_key: str = DEFAULT_EF_STRENGTH_KEY
    delay_key: str = DEFAULT_DELAY_KEY
    launcher: list[str] | None = None
    optimizer_recipes: str | None = None
    extra_configs: list[str] = field(default_factory=list)
    recipes_dir: Path | None = None
    description: str = ""

    @property
    def runs_dir(self) -> Path:
        return self.output / "runs"

    @property
    def logs_dir(self) -> Path:
        return self.output / "logs"

    @property
    def compare_dir(self) -> Path:
        return self.output / "compare"

    # ---- matrix -----------------------------------------------------------------------------
    def recipe(self, relative: str) -> Path | None:
        if self.recipes_dir is None:
            return None
        path = self.recipes_dir / relative
        return path if path.is_file() else None

    def mode_info(self, mode: str) -> StudyMode:
        return study_mode(mode, self.recipes_dir) or MODES[mode]

    def mode_recipes(self, mode: str) -> list[Path]:
        return [self.recipe(rel) or (self.recipes_dir or Path("recipes")) / rel for rel in self.mode_info(mode).recipes]

    def missing_files(self) -> list[str]:
        missing = [b for b in self.base + self.extra_configs if not Path(b).is_file()]
        missing += [str(r) for m in self.modes for r in self.mode_recipes(m) if not r.is_file()]
        return missing

    def run_name(self, optimizer, mode, lr, seed, ef_strength, delay) -> str:
        parts = [optimizer] if optimizer else []
        parts.append(mode)
        if delay is not None and self.delays is not None and len(self.delays) > 1:
            parts.append(f"d{delay}")
        if ef_strength is not None and self.ef_strengths is not None and len(self.ef_strengths) > 1:
            parts.append(f"ef{ef_strength:g}")
        if lr is not None:
            parts.append(f"lr{_fmt_lr(lr)}")
        parts.append(f"s{seed}" if seed is not None else "snone")
        return "-".join(parts)

    def command(self, optimizer, mode, lr, seed, ef_strength, delay, name) -> list[str]:
        cmd = list(self.launcher or default_launcher()) + ["fit"]
        for config in self.base:
            cmd += ["--config", str(config)]
        if optimizer:
            for folder in ["optimizers"] + ([self.optimizer_recipes] if self.optimizer_recipes else []):
                opt_recipe = self.recipe(f"{folder}/{optimizer}.yaml")
                if opt_recipe is not None:
                    cmd += ["--config", str(opt_recipe)]
        for recipe in self.mode_recipes(mode):
            cmd += ["--config", str(recipe)]
        for config in self.extra_configs:
            cmd += ["--config", str(config)]
        if seed is not None:
            cmd += ["--seed_everything", str(seed)]
        if optimizer:
            cmd += ["--model.optimizer", optimizer]
        if lr is not None:
            cmd += ["--model.lr", _fmt_lr(lr)]
        if delay is not None:
            cmd += [f"--{self.delay_key}", str(delay)]
        if ef_strength is not None:
            cmd += [f"--{self.ef_strength_key}", f"{ef_strength:g}"]
        if self.max_steps is not None:
            cmd += ["--trainer.max_steps", str(self.max_steps)]
            cmd += ["--trainer.val_check_interval", str(validation_interval(self.max_steps))]
        cmd += [
            "--trainer.logger.init_args.save_dir", str(self.output),
            "--trainer.logger.init_args.name", "runs",
            "--trainer.logger.init_args.version", name,
        ]
        return cmd + list(self.overrides)

    def expand(self) -> list[RunSpec]:
        """Every run of the matrix, seeds outermost (so a partial study has whole seeds)."""
        specs: list[RunSpec] = []
        for seed in self.seeds:
            for optimizer in self.optimizers:
                for lr in self.lrs.get(optimizer, self.lrs.get(None, [None])):
                    for mode in self.modes:
                        delayed = self.mode_info(mode).logged == "delayed"
                        delays = self.delays if (self.delays is not None and delayed) else [None]
                        efs = self.ef_strengths if (self.ef_strengths is not None and mode == "delayed-ef") else [None]
                        for delay in delays:
                            for ef in efs:
                                name = self.run_name(optimizer, mode, lr, seed, ef, delay)
                                specs.append(RunSpec(
                                    name=name, optimizer=optimizer, mode=mode, lr=lr, seed=seed, ef_strength=ef,
                                    delay=delay, run_dir=self.runs_dir / name, log_path=self.logs_dir / f"{name}.log",
                                    command=self.command(optimizer, mode, lr, seed, ef, delay, name),
                                    max_steps=self.max_steps, mode_info=self.mode_info(mode),
                                ))
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise StudyError(f"study {self.name}: duplicate run names {duplicates} (repeated optimizer/lr/seed?)")
        return specs


# ---- parsing ----------------------------------------------------------------------------------
def _as_list(value: Any, what: str) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (str, int, float)):
        return [value]
    raise StudyError(f"{what}: expected a list, got {type(value).__name__}")


def _floats(values: Any, what: str) -> list[float]:
    out = []
    for v in _as_list(values, what):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise StudyError(f"{what}: {v!r} is not a number") from None
    return out


def _resolve_file(raw: str, study_dir: Path | None, recipes_dir: Path | None = None) -> str:
    """A recipe path as given if it exists (relative to the cwd), else next to the study file, else the
    shipped recipe of that name (``quickstart`` or ``recipes/quickstart.yaml``); unchanged if none exists."""
    path = Path(raw).expanduser()
    if path.is_absolute() or path.exists():
        return str(path)
    if study_dir is not None and (study_dir / path).exists():
        return str(study_dir / path)
    found = find_recipe(raw, recipes_dir)
    return str(found) if found is not None else str(path)


def _overrides(value: Any, what: str = "overrides") -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"--{str(k).lstrip('-')}={_scalar(v)}" for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, str):
        return shlex.split(value)
    raise StudyError(f"{what}: expected a list of CLI args or a mapping key: value")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def parse_set(items: Sequence[str]) -> list[str]:
    """``key=value`` pairs from ``--set`` as CLI args ``--key=value``."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StudyError(f"--set {item!r}: expected key=value (e.g. --set data.path=corpus.txt)")
        out.append(f"--{key.strip().lstrip('-')}={value}")
    return out


def study_from_dict(
    data: dict[str, Any], *, name: str = "study", study_dir: Path | None = None, recipes_dir: Path | None = None
) -> Study:
    """Validate a study mapping (unknown optimizer/mode/key -> :class:`StudyError` listing valid ones)."""
    if not isinstance(data, dict):
        raise StudyError("a study file must be a mapping (base, optimizers, modes, ...)")
    unknown = sorted(set(data) - set(STUDY_KEYS))
    if unknown:
        raise StudyError(f"unknown study key(s) {', '.join(unknown)}; valid keys: {', '.join(STUDY_KEYS)}")
    recipes_dir = recipes_dir or find_recipes_dir()
    name = str(data.get("name") or name)

    optimizers = [str(o) for o in _as_list(data.get("optimizers"), "optimizers")]
    if not optimizers:
        raise StudyError(f"study {name}: 'optimizers' is empty; valid: {', '.join(valid_optimizers(recipes_dir))}")
    valid = valid_optimizers(recipes_dir)
    bad = [o for o in optimizers if o not in valid]
    if bad:
        raise StudyError(f"study {name}: unknown optimizer(s) {', '.join(bad)}; valid optimizers: {', '.join(valid)}")

    modes = [str(m) for m in _as_list(data.get("modes", ["sync", "delayed", "delayed-ef"]), "modes")]
    bad = [m for m in modes if study_mode(m, recipes_dir) is None]
    if bad:
        raise StudyError(f"study {name}: unknown mode(s) {', '.join(bad)}; valid modes: {', '.join(valid_modes(recipes_dir))}")
    if not modes:
        raise StudyError(f"study {name}: 'modes' is empty; valid modes: {', '.join(valid_modes(recipes_dir))}")

    raw_lrs = data.get("lrs")
    lrs: dict[str | None, list[float | None]] = {}
    if isinstance(raw_lrs, dict):
        bad = [k for k in raw_lrs if k not in optimizers]
        if bad:
            raise StudyError(f"study {name}: lrs given for {', '.join(map(str, bad))}, not in optimizers {optimizers}")
        lrs = {str(k): _floats(v, f"lrs.{k}") or [None] for k, v in raw_lrs.items()}
    elif raw_lrs is not None:
        lrs = {None: _floats(raw_lrs, "lrs") or [None]}

    raw_seeds = data.get("seeds", [0])
    if isinstance(raw_seeds, int) and not isinstance(raw_seeds, bool):
        if raw_seeds < 1:
            raise StudyError(f"study {name}: seeds: {raw_seeds} (an int N means seeds 0..N-1; N >= 1)")
        seeds: list[int | None] = list(range(raw_seeds))
    else:
        seeds = []
        for s in _as_list(raw_seeds, "seeds"):
            if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
                raise StudyError(f"study {name}: seed {s!r} is not an integer")
            seeds.append(s)
        seeds = seeds or [0]
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"study {name}: repeated seeds {seeds}")

    max_steps = data.get("max_steps")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise StudyError(f"study {name}: max_steps must be a positive integer, got {max_steps!r}")

    ef_strengths = _floats(data["ef_strengths"], "ef_strengths") if data.get("ef_strengths") is not None else None
    if ef_strengths is not None and any(e <= 0 for e in ef_strengths):
        raise StudyError(f"study {name}: ef_strengths must be > 0 (the sync/delayed modes cover EF off)")
    delays = None
    if data.get("delays") is not None:
        delays = [int(d) for d in _floats(data["delays"], "delays")]
        if any(d < 1 for d in delays):
            raise StudyError(f"study {name}: delays must be >= 1 (sync covers delay 0)")

    base = [_resolve_file(str(b), study_dir, recipes_dir) for b in _as_list(data.get("base"), "base")]
    optimizer_recipes = data.get("optimizer_recipes")
    if optimizer_recipes is not None and not (recipes_dir is not None and (recipes_dir / str(optimizer_recipes)).is_dir()):
        raise StudyError(f"study {name}: optimizer_recipes: {optimizer_recipes!r} is not a folder of the shipped "
                         f"recipes ({recipes_dir})")
    launcher = data.get("launcher")
    if launcher is not None:
        launcher = shlex.split(launcher) if isinstance(launcher, str) else [str(x) for x in launcher]
    return Study(
        name=name,
        description=str(data.get("description") or ""),
        base=base,
        optimizers=list(optimizers),
        modes=modes,
        lrs=lrs,
        seeds=seeds,
        max_steps=max_steps,
        output=Path(data.get("output") or Path("studies") / name),
        overrides=_overrides(data.get("overrides")),
        ef_strengths=ef_strengths,
        delays=delays,
        ef_strength_key=str(data.get("ef_strength_key") or DEFAULT_EF_STRENGTH_KEY),
        delay_key=str(data.get("delay_key") or DEFAULT_DELAY_KEY),
        launcher=launcher,
        optimizer_recipes=None if optimizer_recipes is None else str(optimizer_recipes),
        recipes_dir=recipes_dir,
    )


def find_study_file(raw: str | os.PathLike, recipes_dir: Path | None = None) -> Path:
    """The study file ``raw``: a path, else a shipped study by name (``quickstart``, ``study/quickstart`` or
    ``recipes/study/quickstart.yaml``)."""
    path = Path(raw).expanduser()
    if path.is_file():
        return path
    found = find_recipe(f"study/{raw}", recipes_dir) or find_recipe(str(raw), recipes_dir)
    if found is None:
        raise StudyError(f"study file {raw} not found, and no shipped study of that name "
                         "(`lightning-async recipes` lists them under study/)")
    return found


def load_study(path: str | os.PathLike, *, recipes_dir: Path | None = None) -> Study:
    """The study of the file (or shipped study name) ``path``; recipes it names resolve next to it or by name."""
    path = find_study_file(path, recipes_dir)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise StudyError(f"study file {path}: not valid YAML: {err}") from None
    return study_from_dict(data, name=path.stem, study_dir=path.parent, recipes_dir=recipes_dir)


# ---- running ----------------------------------------------------------------------------------
def _copy_lines(stream, log) -> None:
    for line in stream:
        log.write(line)


def subprocess_runner(spec: RunSpec, *, verbose: bool = False, grace: float | None = None) -> int:
    """Run one training as a subprocess; its output goes to ``spec.log_path`` (and the terminal if verbose).

    The training runs in its own process group and its pid goes into the run's lock. When the study is
    interrupted (Ctrl-C, or SIGTERM under :func:`terminate_as_interrupt`) the same signal is passed on
    to that group and the study waits for the run to end (:func:`stop_run`) before re-raising.
    """
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(spec.log_path, "w") as log:
        log.write("$ " + spec.shell() + "\n\n")
        log.flush()
        proc = subprocess.Popen(spec.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                start_new_session=True)
        try:
            run_lock(spec).set_child(proc.pid)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    sys.stdout.write(line)
            return proc.wait()
        except BaseException as stop:
            signum = getattr(stop, "signum", signal.SIGINT) if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM
            drain = threading.Thread(target=_copy_lines, args=(proc.stdout, log), daemon=True)
            drain.start()  # keep the pipe flowing while the run shuts down
            rc = stop_run(proc, signum, STOP_GRACE_S if grace is None else grace,
                          lambda m: print(f"study: {spec.name}: {m}", file=sys.stderr, flush=True))
            drain.join(timeout=5)
            log.write(f"\n(stopped by the study: {signal.Signals(signum).name}; exit {rc})\n")
            raise


#: gap (async - sync) of the synthetic runner, by optimizer: AdamW and MARS hurt, the others barely
_FAKE_GAPS = {"adamw": 0.28, "mars": 0.2}


def synthetic_runner(spec: RunSpec) -> int:
    """A stand-in for training (``--fake``): writes a run dir that follows the run conventions, with
    made-up losses (sync 2.6; async + 0.28 for AdamW/MARS, + 0.015 otherwise; EF recovers 75%; a
    small seed effect). Rehearses a study's bookkeeping and report in seconds."""
    from lightning_async.compare.synthetic import write_fake_run

    seed = spec.seed or 0
    final = 2.6 + 0.004 * ((seed * 7919) % 5 - 2)
    if spec.mode != "sync" and spec.mode != "sync_pipe":
        gap = _FAKE_GAPS.get(spec.optimizer or "", 0.015) * (spec.delay or 1)
        final += gap * (0.25 if spec.uses_ef else 1.0)
    steps = spec.max_steps or 100
    curve = {int(steps * f): final + 2.0 * (1 - f) ** 2 for f in (0.25, 0.5, 0.75, 1.0)}
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    spec.log_path.write_text("$ " + spec.shell() + "\n(synthetic run: nothing trained)\n")
    write_fake_run(
        spec.run_dir, optimizer=spec.optimizer or "adamw", mode=spec.logged_mode,
        ef_strength=(spec.ef_strength or 1.0) if spec.uses_ef else 0.0, delay=spec.delay, seed=spec.seed, lr=spec.lr,
        val_loss=curve, done={"synthetic": True},
    )
    return 0


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class StudyResult:
    specs: list[RunSpec]
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    diverged: list[str] = field(default_factory=list)
    compare_result: Any = None
    compare_error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and self.compare_error is None


def run_state(spec: RunSpec) -> str:
    """What a (re)run of the study will do with ``spec``, as the dry run and the skip lines say it."""
    if spec.diverged:
        return "diverged, skip"
    if spec.done:
        return "done, skip"
    lock = run_lock(spec)
    info = lock.read()
    if info is not None and lock.is_live(info):
        return f"in progress: {lock.holder(info)}"
    if spec.stale:
        return "stale, rerun"
    return "partial, restart" if spec.run_dir.exists() else "todo"


def run_outcome(spec: RunSpec, rc: int) -> tuple[str, str]:
    """``(kind, status line)`` of a run that just ended; kind is ``ok``, ``diverged`` or ``failed``.

    A run diverged when the guard left its ``DIVERGED`` marker (it then exits non-zero by default) or
    when its loss curves hold a non-finite value (a run made without the guard: the marker is written
    here, so that reruns and ``compare`` see it without reading the curves again).
    """
    divergence = find_divergence(spec.run_dir) if spec.run_dir.is_dir() else None
    if divergence is not None:
        if not (spec.run_dir / DIVERGED_FILE).exists():
            write_marker(spec.run_dir, divergence)
        return "diverged", f"DIVERGED {divergence.where()}" + (f", exit {rc}" if rc else "")
    if rc != 0:
        return "failed", f"FAILED (exit {rc})"
    if not (spec.run_dir / DONE_FILE).exists():
        return "failed", "FAILED (exited 0 but wrote no DONE file)"
    return "ok", "ok"


def run_study(
    study: Study,
    *,
    runner: Runner | None = None,
    dry_run: bool = False,
    compare: bool = True,
    fail_fast: bool = False,
    verbose: bool = False,
    paper: bool = False,
    print_fn: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> StudyResult:
    """Run every missing run of ``study`` in order, then ``compare`` the runs dir.

    ``runner(spec) -> exit status`` executes one run (default: :func:`subprocess_runner`).
    Finished runs (``DONE``) and diverged ones are skipped; half-finished run dirs are removed first.
    Raises :class:`RunInProgress` before touching anything if another process still trains one of the
    runs (see :class:`RunLock`). ``KeyboardInterrupt`` (and :class:`StudyTerminated`, for SIGTERM)
    propagates after the current run stopped and a note on how to resume.
    """
    specs = study.expand()
    result = StudyResult(specs=specs)
    total = len(specs)
    if dry_run:
        print_fn(f"study {study.name}: {total} runs -> {study.output}")
        for i, spec in enumerate(specs, 1):
            print_fn(f"[{i}/{total}] {spec.name} ({run_state(spec)})\n  {spec.shell()}")
        missing = study.missing_files()
        if missing:
            print_fn("warning: recipe files not found (yet): " + ", ".join(missing))
        return result
    if runner is None:
        missing = study.missing_files()
        if missing:
            raise StudyError("recipe files not found: " + ", ".join(missing) + " (give paths that exist, or "
                             "names of shipped recipes: `lightning-async recipes` lists them)")

        def runner(spec: RunSpec) -> int:
            return subprocess_runner(spec, verbose=verbose)

    for spec in specs:  # before anything is removed: a run still training elsewhere stops the study here
        run_lock(spec).check(print_fn)
    study.runs_dir.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if not s.finished]
    print_fn(f"study {study.name}: {total} runs, {total - len(todo)} already done, {len(todo)} to run -> {study.output}")
    with terminate_as_interrupt():
        _run_matrix(specs, runner, result, fail_fast=fail_fast, print_fn=print_fn, clock=clock)
        if result.failed:
            print_fn(f"{len(result.failed)} run(s) failed: {', '.join(result.failed)}; rerun to retry them")
        if result.diverged:
            print_fn(f"{len(result.diverged)} run(s) diverged: {', '.join(result.diverged)} (a result: marked "
                     "DIVERGED in the report and not retried; delete a run's directory to train it again)")
        if compare:
            _compare_study(study, specs, result, paper=paper, print_fn=print_fn)
    return result


def _run_matrix(specs: list[RunSpec], runner: Runner, result: StudyResult, *, fail_fast: bool,
                print_fn: Callable[[str], None], clock: Callable[[], float]) -> None:
    total = len(specs)
    start = clock()
    durations: list[float] = []
    remaining = sum(not s.finished for s in specs)
    for i, spec in enumerate(specs, 1):
        if spec.finished:
            result.skipped.append(spec.name)
            print_fn(f"[{i}/{total}] {spec.name}: {run_state(spec).replace(', skip', ', skipped')}")
            continue
        lock = run_lock(spec)
        lock.acquire(print_fn)
        try:
            if spec.run_dir.exists():
                why = "finished with different arguments" if spec.stale else "half-finished"
                print_fn(f"[{i}/{total}] {spec.name}: removing {why} run {spec.run_dir}")
                shutil.rmtree(spec.run_dir)
            print_fn(f"[{i}/{total}] {spec.name}: running (log: {spec.log_path})")
            t0 = clock()
            try:
                rc = runner(spec)
            except KeyboardInterrupt as stop:
                why = f" ({signal.Signals(stop.signum).name})" if isinstance(stop, StudyTerminated) else ""
                print_fn(f"interrupted{why} during {spec.name}; the run was stopped. Rerun the same command to "
                         "resume (finished runs are kept)")
                raise
        finally:
            lock.release()
        durations.append(clock() - t0)
        remaining -= 1
        eta = (sum(durations) / len(durations)) * remaining
        kind, status = run_outcome(spec, rc)
        if kind == "failed":
            result.failed.append(spec.name)
            if spec.log_path.exists():
                print_fn(f"--- last lines of {spec.log_path} ---\n{_tail(spec.log_path)}\n---")
        else:
            (result.ran if kind == "ok" else result.diverged).append(spec.name)
            spec.record_command()
        print_fn(
            f"[{i}/{total}] {spec.name}: {status} in {_fmt_time(durations[-1])} "
            f"(elapsed {_fmt_time(clock() - start)}, ETA {_fmt_time(eta)})"
        )
        if kind == "failed" and fail_fast:
            print_fn("stopping at the first failure (--fail-fast)")
            break


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


def build_parser(prog: str = "lightning-async study") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a matrix of trainings (optimizers x modes x lrs x seeds) one after another, skipping "
        "finished runs, then compare them. `lightning-async recipes` lists the shipped studies (study/); see "
        "docs/compare.md.",
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
    parser.add_argument("--no-compare", action="store_true", help="do not run compare at the end")
    parser.add_argument("--paper", action="store_true", help="add the paper's numbers to the report")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    parser.add_argument("--verbose", "-v", action="store_true", help="stream each run's output")
    parser.add_argument("--fake", action="store_true",
                        help="rehearsal: write synthetic runs instead of training (check bookkeeping and report)")
    return parser


def study_from_args(args: argparse.Namespace) -> Study:
    study = load_study(args.config)
    if args.output:
        study.output = Path(args.output)
    if args.max_steps is not None:
        study.max_steps = args.max_steps
    if args.seeds:
        study.seeds = list(dict.fromkeys(args.seeds))
    if args.only:
        bad = [o for o in args.only if o not in study.optimizers]
        if bad:
            raise StudyError(f"--only {' '.join(bad)}: not in the study's optimizers {study.optimizers}")
        study.optimizers = [o for o in study.optimizers if o in args.only]
    for extra in args.data_override:
        found = extra if Path(extra).is_file() else find_recipe(extra, study.recipes_dir)
        if found is None:
            raise StudyError(f"--data-override {extra}: no such file, and no shipped recipe of that name")
        study.extra_configs.append(str(found))
    study.overrides = study.overrides + parse_set(args.set)
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


if __name__ == "__main__":
    sys.exit(study_main())
