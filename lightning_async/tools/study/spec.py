"""What a study is made of: its modes, its runs (:class:`RunSpec`), and the error it reports."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_async.identity import (
    CATEGORIES, DELAYED_MODES, DIVERGED_FILE, DONE_FILE, MODE_ASYNC_PIPE, MODE_DELAYED, MODE_SYNC, MODE_SYNC_PIPE,
    classify,
)

COMMAND_FILE = "STUDY_COMMAND.json"  # written into a finished run dir: the args that produced it
LOCK_SUFFIX = ".lock"  # <runs dir>/<run name>.lock while the run trains


class StudyError(ValueError):
    """A study file or command line that cannot run; the message says what is wrong and what is valid."""


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
        StudyMode(MODE_SYNC, ("modes/sync.yaml",), MODE_SYNC),
        StudyMode(MODE_DELAYED, ("modes/delayed.yaml",), MODE_DELAYED),
        StudyMode("delayed-ef", ("modes/delayed-ef.yaml",), MODE_DELAYED, "ef"),
        StudyMode(MODE_ASYNC_PIPE, ("pipeline/async.yaml",), MODE_ASYNC_PIPE),
        StudyMode(MODE_SYNC_PIPE, ("pipeline/sync.yaml",), MODE_SYNC_PIPE),
    )
}
CORRECTED_BASES = DELAYED_MODES
#: the study modes of the categories every study has (``identity.CATEGORIES``: sync, async, async+EF), in that
#: order: what a study runs by default and what ``probe`` runs
CATEGORY_MODES = ("sync", "delayed", "delayed-ef")
if [classify(MODES[m].logged, MODES[m].correction) for m in CATEGORY_MODES] != list(CATEGORIES):
    raise ImportError(f"CATEGORY_MODES {CATEGORY_MODES} do not fill identity.CATEGORIES {CATEGORIES} in order")


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
    """Every mode name :func:`study_mode` accepts with the correction recipes of ``recipes_dir``."""
    folder = recipes_dir / "corrections" if recipes_dir is not None else None
    methods = sorted(p.stem for p in folder.glob("*.yaml")) if folder is not None and folder.is_dir() else []
    return list(MODES) + [f"{base}-{m}" for base in CORRECTED_BASES for m in methods if f"{base}-{m}" not in MODES]


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


#: executes one run and returns its exit status (``run_study(..., runner=...)``)
Runner = Callable[[RunSpec], int]
