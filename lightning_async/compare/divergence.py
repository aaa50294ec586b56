"""Telling whether a training run diverged.

A run diverged when its directory holds a ``DIVERGED`` marker (JSON ``{"step", "metric", "value"}``,
the value a number or a string such as ``"nan"``; written by the ``DivergenceGuard`` callback,
``lightning_async.callbacks.divergence``, on a non-finite loss or gradient norm) or, for runs made
without the guard, when one of its loss curves (any scalar tag with ``loss`` in its name) holds a
non-finite value. A diverged run is a result in its own right: ``compare`` marks it and never
averages it into a table cell, ``study`` reports it and does not retry it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_async.identity import DIVERGED_FILE, DONE_FILE  # (re-exported: the contract lives in identity)


@dataclass(frozen=True)
class Divergence:
    """Where a run diverged: the first non-finite ``metric`` (``value``) at optimizer ``step``."""

    step: int | None
    metric: str
    value: float
    source: str  # the marker file, or "loss curve" when found in the scalars

    def where(self) -> str:
        """``at step N (metric = value)``."""
        step = "at an unknown step" if self.step is None else f"at step {self.step}"
        return f"{step} ({self.metric} = {self.value})"

    def describe(self) -> str:
        return f"diverged {self.where()}"


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_marker(run_dir: str | os.PathLike) -> Divergence | None:
    """The ``DIVERGED`` marker of ``run_dir`` (fields it lacks or cannot be read as JSON become unknowns)."""
    path = Path(run_dir) / DIVERGED_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    step = data.get("step")
    return Divergence(
        step=int(step) if isinstance(step, (int, float)) and math.isfinite(step) else None,
        metric=str(data.get("metric") or "unknown metric"),
        value=_number(data.get("value")),
        source=DIVERGED_FILE,
    )


def first_non_finite(scalars: dict[str, list[tuple[int, float]]]) -> Divergence | None:
    """The earliest non-finite point of any loss curve (``train/loss`` before ``val/loss`` on a tie)."""
    found: Divergence | None = None
    for tag in sorted(t for t in scalars if "loss" in t and "by_tokens" not in t):
        for step, value in scalars[tag]:
            if not math.isfinite(value):
                if found is None or step < found.step:
                    found = Divergence(step=step, metric=tag, value=value, source="loss curve")
                break
    return found


def find_divergence(run_dir: str | os.PathLike, scalars: dict[str, list[tuple[int, float]]]) -> Divergence | None:
    """:class:`Divergence` of a run (its marker first, else the curves in ``scalars``), ``None`` if it did not
    diverge. To read the scalars from the run's event files only when needed, use
    :func:`lightning_async.compare.events.run_divergence`."""
    marker = read_marker(run_dir)
    return marker if marker is not None else first_non_finite(scalars)


def write_marker(run_dir: str | os.PathLike, divergence: Divergence) -> Path:
    """Write ``divergence`` as the run's ``DIVERGED`` marker (for runs found diverged by their curves)."""
    path = Path(run_dir) / DIVERGED_FILE
    value = divergence.value if math.isfinite(divergence.value) else str(divergence.value)  # "nan", as the guard
    payload = {"step": divergence.step, "metric": divergence.metric, "value": value, "source": divergence.source}
    path.write_text(json.dumps(payload))
    return path
