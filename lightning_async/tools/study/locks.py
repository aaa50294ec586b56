"""Run locks: ``<run name>.lock`` names the processes training a run, so that no two studies touch it at once."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_async.tools.study.spec import RunSpec, StudyError


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
    """The lock of ``spec``'s run (``<runs dir>/<run name>.lock``)."""
    return RunLock(spec.lock_path, spec.name)
