"""What a run is: the one schema of a run's identity, shared by the runs that write it and the tools that read it.

A training run records its identity in ``hparams.yaml`` (``RunTelemetry``); ``compare``, ``study`` and ``probe``
read it back to decide which cell of the gap table a run fills. Both sides go through :class:`RunIdentity`:

* ``RunIdentity(...).as_record()`` is the flat dict a run writes (the keys of :data:`IDENTITY_KEYS`);
* ``RunIdentity.from_mapping(raw)`` reads such a dict back, with the defaults that keep old run directories
  readable (no ``correction`` key: ``ef`` when ``ef_strength > 0``, else ``none``; ``correction_strength`` =
  ``ef_strength``; ``delay_profile`` ``uniform``; ``delay`` 0 for sync modes, 1 for delayed ones).

The *category* of a run is ``sync`` (modes ``sync``/``sync_pipe``), ``async`` (``delayed``/``async_pipe``
without a correction in effect), ``async+EF`` (the ``ef`` correction) or ``async+<correction>`` for the other
staleness corrections (``async+nesterov``, ...). A correction of strength 0 is off: such a run is ``async``.

What a user reads (logs, folder names, compare's tables and report, docs) is one vocabulary: the *schedule*
(a pipeline's ``2bw``, ``1f1b``, ``gpipe``, ..., or ``one device``) and the *mode*, ``sync`` or ``async``
(the category, with the correction after ``+``). The recorded ``mode`` values (``sync_pipe``, ``async_pipe``,
``delayed``) stay as they are in ``hparams.yaml``, so runs of every release read the same; :attr:`RunIdentity.schedule`
is recorded since 0.2.0 (an older pipeline run's is read from its ``config.yaml``, else it shows as ``pipeline``).

Framework-free on purpose (no torch, no Lightning). The correction names and default strengths are registered here
once: ``lightning_async.optim.corrections`` takes its classes' defaults from them and refuses, at import, a class not
registered here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# The run-directory contract (what training writes, what compare, study and probe read), in this module only:
#: the mode a run records: plain training, the one-device delay simulation, and the pipeline's two kinds
MODE_SYNC, MODE_DELAYED, MODE_SYNC_PIPE, MODE_ASYNC_PIPE = "sync", "delayed", "sync_pipe", "async_pipe"
SYNC_MODES = (MODE_SYNC, MODE_SYNC_PIPE)
DELAYED_MODES = (MODE_DELAYED, MODE_ASYNC_PIPE)
KNOWN_MODES = SYNC_MODES + DELAYED_MODES
PIPELINE_MODES = (MODE_SYNC_PIPE, MODE_ASYNC_PIPE)
#: the schedule a user reads for a run on one device (sync, or async simulated by ``DelaySimulation``)
ONE_DEVICE = "one device"
#: files in a run directory: fit finished (JSON identity and ``global_step``); a non-finite loss stopped it (JSON
#: ``step``, ``metric``, ``value``)
DONE_FILE, DIVERGED_FILE = "DONE", "DIVERGED"

NO_CORRECTION = "none"
EF = "ef"
#: the staleness corrections of ``lightning_async.optim.corrections`` (``method`` -> default strength), in table order
DEFAULT_STRENGTHS = {"ef": 1.0, "adaptive-ef": 1.0, "nesterov": 1.0, "dc-asgd": 2.0, "weight-prediction": 1.0}
KNOWN_CORRECTIONS = tuple(DEFAULT_STRENGTHS)
UNIFORM_PROFILE = "uniform"

#: the keys a run records, in the order it writes them
IDENTITY_KEYS = (
    "optimizer", "mode", "schedule", "ef_strength", "correction", "correction_strength", "delay", "delay_profile",
    "seed", "lr",
)
REQUIRED_KEYS = ("optimizer", "mode")

SYNC, ASYNC, ASYNC_EF = "sync", "async", "async+EF"
CATEGORIES = (SYNC, ASYNC, ASYNC_EF)  # the categories every study has; the other corrections add theirs


class IdentityError(ValueError):
    """Values that do not describe a run (an unknown mode or correction, contradictory strengths, ...)."""


class MissingIdentity(IdentityError):
    """A required key (``optimizer``, ``mode``) is absent; :attr:`missing` names them."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"missing {', '.join(missing)}")
        self.missing = missing


def correction_category(correction: str) -> str:
    """The category of a delayed run corrected by ``correction``: ``async+EF`` for ``ef``, else ``async+<name>``."""
    if correction == NO_CORRECTION:
        return ASYNC
    return ASYNC_EF if correction == EF else f"async+{correction}"


def correction_order(names) -> list[str]:
    """The corrections among ``names``, once each, in :data:`KNOWN_CORRECTIONS` order (``none`` left out)."""
    wanted = set(names)
    return [name for name in KNOWN_CORRECTIONS if name in wanted]


def classify(mode: str, correction: str = NO_CORRECTION, strength: float | None = None) -> str:
    """The category of a run of ``mode`` corrected by ``correction`` at ``strength`` (see the module docstring)."""
    if mode not in KNOWN_MODES:
        raise IdentityError(f"unknown mode {mode!r}; expected one of {', '.join(KNOWN_MODES)}")
    if not isinstance(correction, str):
        raise IdentityError(f"correction must be a name such as {EF!r}, got {correction!r}")
    if mode in SYNC_MODES:
        return SYNC
    return ASYNC if strength == 0 else correction_category(correction)


def _label_part(text: str) -> str:
    """``text`` as a piece of a folder name: letters, digits, ``.``, ``+`` and ``-`` only."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", str(text)).strip("-").lower() or "x"


def mode_word(mode: str) -> str:
    """The word a user reads for a recorded ``mode``: ``sync`` (``sync``, ``sync_pipe``) or ``async`` (``delayed``,
    ``async_pipe``)."""
    if mode not in KNOWN_MODES:
        raise IdentityError(f"unknown mode {mode!r}; expected one of {', '.join(KNOWN_MODES)}")
    return SYNC if mode in SYNC_MODES else ASYNC


def run_label(identity: RunIdentity, schedule: str | None = None) -> str:
    """The folder name that says what a run is. A pipeline run: its ``schedule``'s name, then its mode (``sync`` or
    ``async``: the schedule's name alone does not say which), the correction in effect and the optimizer:
    ``2bw-async-adamw``, ``2bw-async-ef-adamw``, ``1f1b-sync-muon``. A run on one device: the mode recipe it ran
    (``sync``, or ``delayed``: async simulated on one device; a non-uniform delay profile after it), the correction
    and the optimizer: ``sync-adamw``, ``delayed-ef-adamw``, ``delayed-pipedream-4-adamw``."""
    if identity.mode in PIPELINE_MODES:
        default = "2bw" if identity.mode == MODE_ASYNC_PIPE else "1f1b"
        parts = [schedule or identity.schedule or default, mode_word(identity.mode)]
    else:
        parts = [identity.mode]
        if identity.mode == MODE_DELAYED and identity.delay_profile != UNIFORM_PROFILE:
            parts.append(identity.delay_profile)
        elif identity.mode == MODE_DELAYED and identity.delay != 1:
            parts.append(f"d{identity.delay}")
    if identity.corrected:
        parts.append(identity.correction)
    parts.append(identity.optimizer)
    return "-".join(_label_part(part) for part in parts)


def _number(value: Any, kind: type, default):
    """``value`` as ``kind`` (int or float); ``default`` when absent or not a finite number."""
    if value is None or value == "" or isinstance(value, bool):
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    if not math.isfinite(number):
        return default
    return int(number) if kind is int else number


def _present(values: Mapping[str, Any], key: str) -> bool:
    return values.get(key) is not None and values.get(key) != ""


@dataclass(frozen=True)
class RunIdentity:
    """The knobs that decide which cell of the gap table a run fills.

    ``correction``, ``correction_strength`` and ``delay`` left ``None`` are derived (see the module docstring; a
    correction named without a strength has its default strength, :data:`DEFAULT_STRENGTHS`);
    ``ef_strength`` is the strength of the ``ef`` correction (0 for any other one). Raises :class:`IdentityError`
    for an unknown mode or correction, a negative strength or delay, and an ``ef_strength`` that contradicts the
    correction.
    """

    optimizer: str
    mode: str
    ef_strength: float = 0.0
    correction: str | None = None
    correction_strength: float | None = None
    delay: int | None = None
    delay_profile: str = UNIFORM_PROFILE
    seed: int | None = None
    lr: float | None = None
    schedule: str | None = None  # a pipeline run's schedule (``2bw``, ``1f1b``, ...); None on one device

    def __post_init__(self) -> None:
        if self.mode not in KNOWN_MODES:
            raise IdentityError(f"unknown mode {self.mode!r}; expected one of {', '.join(KNOWN_MODES)}")
        ef = float(self.ef_strength or 0.0)
        correction = self.correction or (EF if ef > 0 else NO_CORRECTION)
        if correction != NO_CORRECTION and correction not in KNOWN_CORRECTIONS:
            raise IdentityError(
                f"unknown correction {correction!r}; expected one of {', '.join((NO_CORRECTION,) + KNOWN_CORRECTIONS)}"
            )
        strength = self.correction_strength
        if strength is None:
            strength = ef if correction == EF and ef > 0 else DEFAULT_STRENGTHS.get(correction, 0.0)
        strength = 0.0 if correction == NO_CORRECTION else float(strength)
        if correction == EF and ef == 0:
            ef = strength  # a record naming the correction only
        if ef < 0 or strength < 0:
            raise IdentityError(f"strengths must be >= 0, got ef_strength {ef:g}, correction_strength {strength:g}")
        if ef > 0 and (correction != EF or ef != strength):
            raise IdentityError(
                f"ef_strength {ef:g} contradicts correction {correction!r} of strength {strength:g}: ef_strength is "
                "the strength of the ef correction (0 for any other)"
            )
        delay = self.delay if self.delay is not None else (0 if self.mode in SYNC_MODES else 1)
        if delay < 0:
            raise IdentityError(f"delay must be >= 0, got {delay}")
        set_ = object.__setattr__  # frozen: the derived values are filled in once, here
        set_(self, "ef_strength", ef)
        set_(self, "correction", correction)
        set_(self, "correction_strength", strength)
        set_(self, "delay", int(delay))
        set_(self, "delay_profile", str(self.delay_profile or UNIFORM_PROFILE))
        set_(self, "optimizer", str(self.optimizer))
        pipelined = self.mode in PIPELINE_MODES and self.schedule not in (None, "")
        set_(self, "schedule", str(self.schedule).lower() if pipelined else None)

    @property
    def category(self) -> str:
        """``sync``, ``async``, ``async+EF`` or ``async+<correction>``."""
        return classify(self.mode, self.correction, self.correction_strength)

    @property
    def mode_word(self) -> str:
        """``sync`` or ``async`` (see :func:`mode_word`; the category says which correction)."""
        return mode_word(self.mode)

    @property
    def schedule_name(self) -> str:
        """The schedule a user reads: the pipeline's (``2bw``, ``1f1b``, ...; ``pipeline`` for a run that did not
        record it) or ``one device``."""
        if self.mode in PIPELINE_MODES:
            return self.schedule or "pipeline"
        return ONE_DEVICE

    @property
    def corrected(self) -> bool:
        """Delayed, with a correction in effect."""
        return self.category not in (SYNC, ASYNC)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunIdentity:
        """Read raw recorded values (a run's ``hparams.yaml``, maybe an old one without the newer keys).

        Numbers are read leniently (a value that is not a finite number counts as absent); ``None`` and ``""``
        count as absent. Raises :class:`MissingIdentity` without ``optimizer`` or ``mode`` and
        :class:`IdentityError` for values that describe no run.
        """
        missing = [key for key in REQUIRED_KEYS if not _present(values, key)]
        if missing:
            raise MissingIdentity(missing)
        return cls(
            optimizer=str(values["optimizer"]),
            mode=str(values["mode"]),
            ef_strength=_number(values.get("ef_strength"), float, 0.0),
            correction=str(values["correction"]) if _present(values, "correction") else None,
            correction_strength=_number(values.get("correction_strength"), float, None),
            delay=_number(values.get("delay"), int, None),
            delay_profile=str(values["delay_profile"]) if _present(values, "delay_profile") else UNIFORM_PROFILE,
            seed=_number(values.get("seed"), int, None),
            lr=_number(values.get("lr"), float, None),
            schedule=str(values["schedule"]) if _present(values, "schedule") else None,
        )

    def as_record(self) -> dict[str, Any]:
        """The dict a run writes into ``hparams.yaml`` (and ``DONE``): every key of :data:`IDENTITY_KEYS`."""
        record = asdict(self)
        return {key: record[key] for key in IDENTITY_KEYS}


__all__ = [
    "ASYNC", "ASYNC_EF", "CATEGORIES", "DEFAULT_STRENGTHS", "DELAYED_MODES", "EF", "IDENTITY_KEYS", "IdentityError",
    "KNOWN_CORRECTIONS", "KNOWN_MODES", "MissingIdentity", "NO_CORRECTION", "ONE_DEVICE", "PIPELINE_MODES", "REQUIRED_KEYS", "RunIdentity", "SYNC",
    "SYNC_MODES", "UNIFORM_PROFILE", "classify", "correction_category", "correction_order", "mode_word", "run_label",
]
