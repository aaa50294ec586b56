"""TensorBoard view of a comparison: a logdir whose runs are the compared series.

``<output>/tensorboard/`` holds one TensorBoard *run* (a subdirectory) per series: ``sync``, ``async``,
``async+EF``, ``async+<correction>`` (with ``-s<seed>`` when a category has several seeds). Each holds a copy of
the compared runs' whole ``val/loss`` and ``train/loss`` curves under ``<group>/val_loss`` and
``<group>/train_loss`` (a group is a row of the table, e.g. ``adamw``), and the first series folder also holds a
custom-scalars layout (``tensorboard.plugins.custom_scalar.layout_pb2``) with one category per optimizer and,
per group, a multiline chart of each tag (TensorBoard reads a layout from any run; in the top folder it made a
run named ``.`` with nothing to plot). Only the compared runs are there (the single-device quick start only
when it is part of the comparison).

``tensorboard --logdir <output>/tensorboard`` then shows, in *Scalars* / *Time Series* (cards by tag, series by
run) and in *Custom Scalars*, the same overlays as the PNGs, series named by category.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from lightning_async.compare.events import EVENT_PREFIX, TRAIN_LOSS, VAL_LOSS
from lightning_async.compare.rows import Row

#: the tags a comparison copies, and the name each gets under its group
COPIED_TAGS = {VAL_LOSS: "val_loss", TRAIN_LOSS: "train_loss"}


def _tag_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", text).strip("_") or "x"


def overlay_tag(row: Row, tag: str) -> str:
    """The tag a group's copy of ``tag`` gets: ``adamw/val_loss``."""
    return f"{_tag_part(row.label)}/{COPIED_TAGS[tag]}"


def series_runs(row: Row) -> list[tuple[str, object]]:
    """``(series name, run)`` for every run of ``row``: the category, ``-s<seed>`` (or ``-<n>``) after it when the
    category has several runs."""
    named = []
    for category in row.categories:
        runs = sorted(row.runs.get(category, []), key=lambda r: (r.identity.seed is None, r.identity.seed or 0))
        for i, run in enumerate(runs):
            suffix = "" if len(runs) == 1 else f"-s{run.identity.seed}" if run.identity.seed is not None else f"-{i}"
            named.append((_tag_part(category + suffix), run))
    return named


def build_layout(rows: list[Row]):
    """The ``Layout`` proto: a category per optimizer, a multiline chart per group and copied tag."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    categories = []
    for optimizer in dict.fromkeys(r.optimizer for r in rows):
        charts = []
        for row in (r for r in rows if r.optimizer == optimizer):
            shown = " vs ".join(c for c in row.categories if row.runs.get(c))
            for tag in COPIED_TAGS:
                charts.append(layout_pb2.Chart(
                    title=f"{row.label}: {tag}, {shown}",
                    multiline=layout_pb2.MultilineChartContent(tag=[rf"^{re.escape(overlay_tag(row, tag))}$"]),
                ))
        categories.append(layout_pb2.Category(title=f"compare: {optimizer}", chart=charts))
    return layout_pb2.Layout(category=categories)


def layout_summary(layout):
    """The layout as a ``Summary`` proto, as ``tensorboard.summary.v1.custom_scalar_pb`` makes it.

    ``custom_scalar_pb`` needs TensorFlow; without it the same proto (a scalar string tensor under
    the ``custom_scalars__config__`` tag with the plugin's metadata) is built from TensorBoard's
    bundled protos.
    """
    try:
        from tensorboard.summary.v1 import custom_scalar_pb

        return custom_scalar_pb(layout)
    except ImportError:
        pass
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.custom_scalar import metadata

    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_STRING,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
        string_val=[layout.SerializeToString()],
    )
    summary_metadata = summary_pb2.SummaryMetadata.FromString(metadata.create_summary_metadata().SerializeToString())
    return summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, metadata=summary_metadata, tensor=tensor)]
    )


def read_layout(directory: Path):
    """The custom-scalars ``Layout`` stored in the event files of ``directory`` or of one of its series folders
    (None if absent)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.util import tensor_util

    directory = Path(directory)
    for folder in [directory, *sorted(p for p in directory.iterdir() if p.is_dir())]:
        acc = ea.EventAccumulator(str(folder), size_guidance={ea.TENSORS: 0, ea.SCALARS: 0})
        acc.Reload()
        if metadata.CONFIG_SUMMARY_TAG in acc.Tags().get("tensors", []):
            event = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[-1]
            raw = tensor_util.make_ndarray(event.tensor_proto).item()
            return layout_pb2.Layout.FromString(raw)
    return None


def _clear(output: Path) -> None:
    """Remove the event files (and then empty series folders) an earlier report wrote: rerunning replaces them."""
    for old in [*output.glob(f"{EVENT_PREFIX}*"), *output.glob(f"*/{EVENT_PREFIX}*")]:
        old.unlink()
    for folder in output.iterdir():
        if folder.is_dir() and not any(folder.iterdir()):
            shutil.rmtree(folder)


def _write_events(directory: Path, events) -> None:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    directory.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(directory))
    for event in events:
        writer.add_event(event)
    writer.flush()
    writer.close()


def write_layout(rows: list[Row], output: Path) -> Path:
    """Write one series folder per category and seed (``output/<series>``) holding the groups' copies of
    :data:`COPIED_TAGS`, the first of them with the layout too; return ``output``."""
    from tensorboard.compat.proto import event_pb2, summary_pb2

    output.mkdir(parents=True, exist_ok=True)
    _clear(output)
    wall = time.time()
    layout = event_pb2.Event(wall_time=wall, step=0, summary=layout_summary(build_layout(rows)))
    series: dict[str, list] = {}
    for row in rows:
        for name, run in series_runs(row):
            for tag in COPIED_TAGS:
                copied = overlay_tag(row, tag)
                series.setdefault(name, []).extend(
                    event_pb2.Event(wall_time=wall, step=int(step), summary=summary_pb2.Summary(
                        value=[summary_pb2.Summary.Value(tag=copied, simple_value=value)]))
                    for step, value in run.series(tag)
                )
    if not series:  # nothing logged a compared tag: the layout still needs a folder (a run) to live in
        series["sync"] = []
    for i, (name, events) in enumerate(series.items()):
        _write_events(output / name, [layout, *events] if i == 0 else events)
    return output
