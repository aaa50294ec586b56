"""Shortened runs: one rule that caps every training a command starts, for smoke tests of the documentation.

* ``LIGHTNING_ASYNC_MAX_STEPS=N``: every Trainer the CLI builds (``fit`` and the ``study``/``probe`` runs, which
  inherit the environment; every rank of a pipeline) trains at most ``N`` steps and still validates once:
  ``max_steps``, an integer ``val_check_interval``, ``limit_val_batches``, ``limit_test_batches`` and
  ``log_every_n_steps`` are lowered to ``N``, and an epoch-based validation becomes one at step ``N``.
* ``LIGHTNING_ASYNC_MAX_RUNS=N``: a ``study`` (and a ``probe``, a small study) trains only the first ``N`` runs of
  its matrix, seeds outermost (``--dry-run`` still lists them all).

Unset, nothing changes. ``tests/cli/test_docs.py`` runs the commands of README.md and docs/ under both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TypeVar

MAX_STEPS_VARIABLE = "LIGHTNING_ASYNC_MAX_STEPS"
MAX_RUNS_VARIABLE = "LIGHTNING_ASYNC_MAX_RUNS"

T = TypeVar("T")


def limit_from_environment(variable: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The positive integer ``variable`` holds, ``None`` when it is unset or empty; ``ValueError`` otherwise."""
    value = (os.environ if environ is None else environ).get(variable, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{variable}={value!r}: give a positive number of steps or runs, or unset it")
    return int(value)


def _lowered(value, cap: int, default):
    """``value`` (``None`` meaning ``default``) as an integer count of at most ``cap``; a fraction becomes ``cap``."""
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int):
        return cap
    return value if 0 <= value <= cap else cap


def shorten_trainer_settings(settings: MutableMapping, max_steps: int) -> None:
    """Lower the Trainer arguments in ``settings`` (a dict of ``Trainer(**settings)`` or the CLI's ``trainer``
    section) so that the run trains at most ``max_steps`` steps and validates once, at the latest at the end."""
    steps = settings.get("max_steps")
    settings["max_steps"] = steps if steps is not None and 0 < steps <= max_steps else max_steps
    interval = settings.get("val_check_interval")
    if not (isinstance(interval, int) and not isinstance(interval, bool) and 0 < interval <= max_steps):
        settings["val_check_interval"] = max_steps  # (a fraction of an epoch, or an epoch, may never come)
        settings["check_val_every_n_epoch"] = None
    for key in ("limit_val_batches", "limit_test_batches"):
        if settings.get(key) not in (0, 0.0):  # 0 switches the loop off: keep it off
            settings[key] = _lowered(settings.get(key), max_steps, 1.0)
    settings["log_every_n_steps"] = _lowered(settings.get("log_every_n_steps"), max_steps, 50)


def shorten_cli_config(config, environ: Mapping[str, str] | None = None) -> None:
    """Apply ``LIGHTNING_ASYNC_MAX_STEPS`` to the ``trainer`` section of the subcommand of a parsed
    LightningCLI ``config`` (``config.fit.trainer`` for ``fit``)."""
    max_steps = limit_from_environment(MAX_STEPS_VARIABLE, environ)
    subcommand = config.get("subcommand") if max_steps is not None else None
    if subcommand and config.get(subcommand) is not None and config[subcommand].get("trainer") is not None:
        shorten_trainer_settings(config[subcommand]["trainer"], max_steps)


def first_runs(runs: Sequence[T], environ: Mapping[str, str] | None = None) -> tuple[list[T], str | None]:
    """The runs a study trains under ``LIGHTNING_ASYNC_MAX_RUNS`` and a note saying what was left out
    (``None`` when nothing was)."""
    limit = limit_from_environment(MAX_RUNS_VARIABLE, environ)
    if limit is None or limit >= len(runs):
        return list(runs), None
    return list(runs[:limit]), f"{MAX_RUNS_VARIABLE}={limit}: training the first {limit} of {len(runs)} runs"
