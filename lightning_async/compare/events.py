"""Reading training runs: TensorBoard scalars and each run's identity.

A *run directory* is a directory that directly holds ``events.out.tfevents.*`` files (the
``<save_dir>/<experiment>/<run_name>/`` folder of Lightning's ``TensorBoardLogger``). Its
*identity* (a :class:`lightning_async.identity.RunIdentity`: optimizer, mode, correction and its
strength, delay and delay profile, seed, learning rate) comes from the ``hparams.yaml`` Lightning
writes next to the event files; when that file is missing or lacks a key, from the TensorBoard
hparams plugin data inside the event files; and as a last resort from the ``config.yaml``
LightningCLI saves there. Keys are looked up at the top level first, then anywhere in nested
sections (``model.optimizer``, ``model/optimizer``). Old runs without the newer keys
(``correction``, ``correction_strength``, ``delay_profile``) read with the schema's defaults.

Scalars are read with TensorBoard's own ``EventAccumulator`` and a ``size_guidance`` of 0
(keep everything), so no point is dropped by reservoir sampling.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_async.compare.divergence import Divergence, find_divergence, first_non_finite, read_marker
from lightning_async.identity import (  # noqa: F401  (re-exported: compare's names for the schema)
    DONE_FILE,
    ASYNC,
    ASYNC_EF,
    IDENTITY_KEYS,
    SYNC,
    IdentityError,
    MissingIdentity,
    RunIdentity,
    classify,
)

EVENT_PREFIX = "events.out.tfevents."
OUTPUT_MARKER = ".lightning-async-compare"  # written into compare's own output dir: never a run
VAL_LOSS = "val/loss"
TRAIN_LOSS = "train/loss"
VAL_LOSS_BY_TOKENS = "val/loss_by_tokens"
#: Lightning's loggers file what optimizer step ``t`` (counted from 1) logged under TensorBoard step ``t - 1``: the
#: validation after 300 steps sits at 299. compare reads the files as they are and reports the run's own step.
LOGGED_STEP_OFFSET = 1


def optimizer_step(logged_step: int | None) -> int | None:
    """The optimizer step (counted from 1) a TensorBoard step of Lightning's stands for: ``299`` -> ``300``."""
    return None if logged_step is None else logged_step + LOGGED_STEP_OFFSET


class CompareError(RuntimeError):
    """A problem with the input runs that makes a comparison impossible; the message says what to do."""


@dataclass
class Run:
    """One training run: where it is, what it is, and its scalar series (tag -> [(step, value)])."""

    path: Path
    identity: RunIdentity
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hparams: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    divergence: Divergence | None = None

    @property
    def name(self) -> str:
        """The run's folder name; with its parent for Lightning's numbered ones (``2bw-async-adamw/version_0``)."""
        if re.fullmatch(r"version_\d+", self.path.name) and self.path.parent.name:
            return f"{self.path.parent.name}/{self.path.name}"
        return self.path.name

    @property
    def category(self) -> str:
        return self.identity.category

    def series(self, tag: str) -> list[tuple[int, float]]:
        return self.scalars.get(tag, [])

    @property
    def final_val_loss(self) -> float | None:
        """The validation loss at the largest logged step (``None`` when the run never validated).

        A diverged run keeps its non-finite value (``nan``/``inf``): divergence is a result, not noise.
        """
        points = self.series(VAL_LOSS)
        if not points:
            return None
        return max(points, key=lambda p: p[0])[1]

    def val_loss_at(self, step: int) -> float | None:
        """The validation loss logged at exactly ``step`` (``None`` when the run did not validate there)."""
        return dict(self.series(VAL_LOSS)).get(step)

    @property
    def val_steps(self) -> list[int]:
        """Steps at which the run logged ``val/loss``, ascending."""
        return [step for step, _ in self.series(VAL_LOSS)]

    @property
    def diverged(self) -> bool:
        return self.divergence is not None

    @property
    def finished(self) -> bool:
        """Ended with a result: ``DONE`` written, or diverged (a diverged run is a result, not a crash)."""
        return self.done or self.diverged

    @property
    def status(self) -> str:
        """``done``, ``diverged at step N (metric = value)`` or ``unfinished``."""
        if self.divergence is not None:
            return self.divergence.describe()
        return "done" if self.done else "unfinished"

    @property
    def last_step(self) -> int | None:
        """Last optimizer step logged (series stepped by tokens, like ``val/loss_by_tokens``, do not count)."""
        steps = [s for tag, series in self.scalars.items() if "by_tokens" not in tag for s, _ in series]
        return max(steps) if steps else None


# ---- discovery --------------------------------------------------------------------------------
def has_event_files(directory: Path) -> bool:
    try:
        return any(entry.is_file() and entry.name.startswith(EVENT_PREFIX) for entry in directory.iterdir())
    except OSError:
        return False


def find_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every directory under ``paths`` (a run dir itself, or any parent) that holds event files.

    Directories written by ``compare`` itself (marked with :data:`OUTPUT_MARKER`) are skipped, so a
    report folder inside a study folder is not mistaken for a run. Raises :class:`CompareError` for a
    path that does not exist or when nothing is found.
    """
    found: list[Path] = []
    for raw in paths:
        root = Path(raw)
        if not root.exists():
            raise CompareError(f"{root}: no such file or directory")
        if root.is_file():
            root = root.parent
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if OUTPUT_MARKER in filenames:
                dirnames[:] = []
                continue
            if any(name.startswith(EVENT_PREFIX) for name in filenames):
                found.append(Path(dirpath))
    unique = sorted({p.resolve(): p for p in found}.values(), key=lambda p: str(p))
    if not unique:
        shown = ", ".join(str(p) for p in paths)
        raise CompareError(
            f"no TensorBoard event files (events.out.tfevents.*) found under {shown}; pass the run "
            "directories written by `lightning-async fit` (<save_dir>/<experiment>/<run_name>/) or a parent of them"
        )
    return unique


# ---- scalars ----------------------------------------------------------------------------------
def _accumulator(run_dir: Path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    guidance = {
        ea.SCALARS: 0,
        ea.TENSORS: 0,
        ea.HISTOGRAMS: 1,
        ea.IMAGES: 1,
        ea.AUDIO: 1,
        ea.COMPRESSED_HISTOGRAMS: 1,
    }
    acc = ea.EventAccumulator(str(run_dir), size_guidance=guidance)
    acc.Reload()
    return acc


def read_scalars(run_dir: str | os.PathLike, acc=None) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of a run dir: ``{tag: [(step, value), ...]}`` sorted by step.

    When a tag has several points at one step (a resumed run logging the same step again) the
    last written one wins.
    """
    acc = acc if acc is not None else _accumulator(Path(run_dir))
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        by_step: dict[int, float] = {}
        for event in acc.Scalars(tag):
            by_step[int(event.step)] = float(event.value)
        out[tag] = sorted(by_step.items())
    return out


def _plugin_hparams(acc) -> dict[str, Any]:
    """Hyperparameters stored by the TensorBoard hparams plugin (``session_start_info``), flat."""
    try:
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2
    except ImportError:  # pragma: no cover - tensorboard always ships it
        return {}
    try:
        contents = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    except KeyError:
        return {}
    out: dict[str, Any] = {}
    for content in contents.values():
        try:
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
        except Exception:  # noqa: BLE001 - an unreadable record is simply not used
            continue
        if not data.HasField("session_start_info"):
            continue
        for key, value in data.session_start_info.hparams.items():
            kind = value.WhichOneof("kind")
            if kind == "number_value":
                out[key] = value.number_value
            elif kind == "string_value":
                out[key] = value.string_value
            elif kind == "bool_value":
                out[key] = value.bool_value
            else:
                out[key] = None
    return out


def _load_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        try:  # Lightning may dump python objects (unsafe tags): read those leniently
            data = yaml.load(path.read_text(), Loader=yaml.UnsafeLoader)  # noqa: S506 - our own run files
        except Exception:  # noqa: BLE001
            return {}
    return data if isinstance(data, dict) else {}


def _lookup(data: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """``key`` at the top level, else in nested mappings (breadth first), else as a flat ``a/key``/``a.key``."""
    if key in data:
        return True, data[key]
    queue = [v for v in data.values() if isinstance(v, Mapping)]
    while queue:
        node = queue.pop(0)
        if key in node:
            return True, node[key]
        queue.extend(v for v in node.values() if isinstance(v, Mapping))
    for flat_key, value in data.items():
        if isinstance(flat_key, str) and (flat_key.endswith("/" + key) or flat_key.endswith("." + key)):
            return True, value
    return False, None


def identity_from(sources: list[tuple[str, Mapping[str, Any]]], run_dir: Path) -> RunIdentity:
    """Build a :class:`RunIdentity` from ordered sources (first source that has a key wins)."""
    values: dict[str, Any] = {}
    for key in IDENTITY_KEYS:
        for _, data in sources:
            ok, value = _lookup(data, key)
            if ok and value is not None and value != "":
                values[key] = value
                break
    try:
        return RunIdentity.from_mapping(values)
    except MissingIdentity as err:
        looked = ", ".join(name for name, data in sources if data) or "nothing readable"
        raise CompareError(
            f"run {run_dir}: cannot tell what this run is: {err} "
            f"(looked in: {looked}; expected hparams.yaml with top-level keys {', '.join(IDENTITY_KEYS)}, "
            "or the same keys in the TensorBoard hparams of the event files)"
        ) from None
    except IdentityError as err:
        raise CompareError(f"run {run_dir}: {err}") from None


def run_divergence(run_dir: str | os.PathLike) -> Divergence | None:
    """:class:`Divergence` of the run in ``run_dir``: its ``DIVERGED`` marker, else the first non-finite point of
    its loss curves (read from its event files only when there is no marker); ``None`` if it did not diverge."""
    marker = read_marker(run_dir)
    if marker is not None:
        return marker
    path = Path(run_dir)
    return first_non_finite(read_scalars(path)) if has_event_files(path) else None


def load_run(run_dir: str | os.PathLike) -> Run:
    """Read one run dir: identity, every scalar, whether it finished (``DONE``) and whether it diverged."""
    path = Path(run_dir)
    if not has_event_files(path):
        raise CompareError(f"{path}: no TensorBoard event files in this directory")
    acc = _accumulator(path)
    hparams = _load_yaml(path / "hparams.yaml")
    sources: list[tuple[str, Mapping[str, Any]]] = [("hparams.yaml", hparams)]
    sources.append(("TensorBoard hparams plugin", _plugin_hparams(acc)))
    sources.append(("config.yaml", _load_yaml(path / "config.yaml")))
    identity = identity_from(sources, path)
    scalars = read_scalars(path, acc)
    return Run(
        path=path,
        identity=identity,
        scalars=scalars,
        hparams=hparams or dict(sources[1][1]),
        done=(path / DONE_FILE).exists(),
        divergence=find_divergence(path, scalars),
    )


def load_runs(paths: Iterable[str | os.PathLike], *, skip_invalid: bool = False, warn=None) -> list[Run]:
    """Find and load every run under ``paths``.

    With ``skip_invalid`` a run without identity is reported through ``warn`` and left out;
    otherwise its :class:`CompareError` propagates.
    """
    runs: list[Run] = []
    for run_dir in find_run_dirs(paths):
        try:
            runs.append(load_run(run_dir))
        except CompareError as err:
            if not skip_invalid:
                raise
            if warn is not None:
                warn(f"skipping: {err}")
    if not runs:
        raise CompareError("no usable runs: every run directory found lacks an identity (see the warnings above)")
    return runs

