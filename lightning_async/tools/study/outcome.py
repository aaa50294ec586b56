"""What became of a run: its state before the study (dry run, skip lines), its outcome after, and the tally."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_async.compare.divergence import write_marker
from lightning_async.identity import DIVERGED_FILE, DONE_FILE
from lightning_async.compare.events import run_divergence
from lightning_async.tools.study.locks import run_lock
from lightning_async.tools.study.spec import RunSpec


@dataclass
class StudyResult:
    """What a study did with each run (names, in matrix order), and the report of its ``compare``."""

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
    divergence = run_divergence(spec.run_dir) if spec.run_dir.is_dir() else None
    if divergence is not None:
        if not (spec.run_dir / DIVERGED_FILE).exists():
            write_marker(spec.run_dir, divergence)
        return "diverged", f"DIVERGED {divergence.where()}" + (f", exit {rc}" if rc else "")
    if rc != 0:
        return "failed", f"FAILED (exit {rc})"
    if not (spec.run_dir / DONE_FILE).exists():
        return "failed", "FAILED (exited 0 but wrote no DONE file)"
    return "ok", "ok"
