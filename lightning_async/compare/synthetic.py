"""Write run directories that follow the run conventions, without training anything.

Used by the tests of ``compare``/``study``/``probe`` and as the fake runner of
``lightning-async study --fake`` (a dry rehearsal of a study's bookkeeping and report).
Event files are written with TensorBoard's own writer, exactly as a training run would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_async.identity import DONE_FILE, RunIdentity


def _scalar_event(tag: str, value: float, step: int, wall: float):
    from tensorboard.compat.proto import event_pb2, summary_pb2

    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(value))])
    return event_pb2.Event(wall_time=wall, step=int(step), summary=summary)


def write_fake_run(
    run_dir: str | Path,
    *,
    optimizer: str = "adamw",
    mode: str = "sync",
    schedule: str | None = None,
    ef_strength: float = 0.0,
    correction: str | None = None,
    correction_strength: float | None = None,
    delay: int | None = None,
    delay_profile: str = "uniform",
    seed: int | None = 0,
    lr: float | None = 1e-3,
    val_loss: Mapping[int, float] | Iterable[tuple[int, float]] | None = None,
    train_loss: Mapping[int, float] | Iterable[tuple[int, float]] | None = None,
    tokens_per_step: int = 1024,
    hparams_yaml: bool = True,
    extra_hparams: Mapping[str, Any] | None = None,
    done: bool | Mapping[str, Any] = True,
    scalars: Mapping[str, Mapping[int, float]] | None = None,
) -> Path:
    """Create ``run_dir`` with an event file (``train/loss``, ``val/loss``, ``train/tokens``,
    ``val/loss_by_tokens``), an ``hparams.yaml`` with the identity, and a ``DONE`` marker.

    The identity arguments are those of :class:`lightning_async.identity.RunIdentity` (``ef_strength=1`` alone
    means the ``ef`` correction; ``correction="nesterov"`` another one, of strength 1 unless given). ``scalars``: more
    series to write, ``{tag: {step: value}}`` (e.g. ``update/cosine``).
    """
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    identity = RunIdentity(optimizer=optimizer, mode=mode, ef_strength=ef_strength, correction=correction,
                           correction_strength=correction_strength, delay=delay, delay_profile=delay_profile,
                           seed=seed, lr=lr, schedule=schedule)
    val = sorted(dict(val_loss).items()) if val_loss is not None else [(10, 3.0), (20, 2.5)]
    train = sorted(dict(train_loss).items()) if train_loss is not None else [(s, v + 0.05) for s, v in val]
    writer = EventFileWriter(str(path))
    wall = time.time()
    for step, value in train:
        writer.add_event(_scalar_event("train/loss", value, step, wall))
        writer.add_event(_scalar_event("train/tokens", step * tokens_per_step, step, wall))
    for step, value in val:
        writer.add_event(_scalar_event("val/loss", value, step, wall))
        writer.add_event(_scalar_event("val/loss_by_tokens", value, step * tokens_per_step, wall))
    for tag, series in (scalars or {}).items():
        for step, value in sorted(series.items()):
            writer.add_event(_scalar_event(tag, value, step, wall))
    writer.flush()
    writer.close()
    hparams = {**identity.as_record(), **dict(extra_hparams or {})}
    if hparams_yaml:
        (path / "hparams.yaml").write_text(yaml.safe_dump(hparams, sort_keys=False))
    if done:
        (path / DONE_FILE).write_text(json.dumps(dict(done)) if isinstance(done, Mapping) else "")
    return path
