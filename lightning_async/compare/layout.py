"""TensorBoard *Custom Scalars* view of a comparison.

TensorBoard's custom-scalar charts select series by tag (regex), not by run, so the overlay of
sync / async / async+EF / async+<correction> per optimizer cannot be expressed on the original
runs (they all log ``val/loss``). Instead the output dir gets one event file (``<output>/tensorboard/``) that holds

* a copy of each run's ``val/loss`` under the tag ``<group>/val_loss/<class>/<run name>``, and
* a custom-scalars layout (``tensorboard.plugins.custom_scalar.layout_pb2``) with one category
  per optimizer and a multiline chart per row group matching those tags (and a category that
  overlays the original ``val/loss`` / ``train/loss`` tags of every run in the logdir).

``tensorboard --logdir <output>/tensorboard`` then shows the same overlay as the PNGs.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from lightning_async.compare.events import VAL_LOSS
from lightning_async.compare.rows import Row


def _tag_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", text).strip("_") or "x"


def overlay_tag(row: Row, category: str, run_name: str) -> str:
    return f"{_tag_part(row.label)}/val_loss/{_tag_part(category)}/{_tag_part(run_name)}"


def build_layout(rows: list[Row]):
    """The ``Layout`` proto: a category per optimizer, a multiline chart per row group."""
    from tensorboard.plugins.custom_scalar import layout_pb2

    categories = []
    for optimizer in dict.fromkeys(r.optimizer for r in rows):
        charts = []
        for row in (r for r in rows if r.optimizer == optimizer):
            prefix = re.escape(_tag_part(row.label))
            shown = " vs ".join(c for c in row.categories if row.runs.get(c))
            charts.append(
                layout_pb2.Chart(
                    title=f"{row.label}: val/loss, {shown}",
                    multiline=layout_pb2.MultilineChartContent(tag=[rf"^{prefix}/val_loss/"]),
                )
            )
        categories.append(layout_pb2.Category(title=f"compare: {optimizer}", chart=charts))
    categories.append(
        layout_pb2.Category(
            title="compare: original tags (all runs in the logdir)",
            chart=[
                layout_pb2.Chart(title="val/loss", multiline=layout_pb2.MultilineChartContent(tag=[r"^val/loss$"])),
                layout_pb2.Chart(title="train/loss", multiline=layout_pb2.MultilineChartContent(tag=[r"^train/loss$"])),
            ],
        )
    )
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
    """The custom-scalars ``Layout`` stored in the event files of ``directory`` (None if absent)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata
    from tensorboard.util import tensor_util

    acc = ea.EventAccumulator(str(directory), size_guidance={ea.TENSORS: 0, ea.SCALARS: 0})
    acc.Reload()
    if metadata.CONFIG_SUMMARY_TAG not in acc.Tags().get("tensors", []):
        return None
    event = acc.Tensors(metadata.CONFIG_SUMMARY_TAG)[-1]
    raw = tensor_util.make_ndarray(event.tensor_proto).item()
    return layout_pb2.Layout.FromString(raw)


def write_layout(rows: list[Row], output: Path, tag: str = VAL_LOSS) -> Path:
    """Write the overlay scalars and the layout as one event file under ``output``; return its dir."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    output.mkdir(parents=True, exist_ok=True)
    for old in output.glob("events.out.tfevents.*"):  # one layout per report: rerunning replaces it
        old.unlink()
    writer = EventFileWriter(str(output))
    wall = time.time()
    writer.add_event(event_pb2.Event(wall_time=wall, step=0, summary=layout_summary(build_layout(rows))))
    for row in rows:
        for category in row.categories:
            for run in row.runs.get(category, []):
                name = overlay_tag(row, category, run.name)
                for step, value in run.series(tag):
                    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=name, simple_value=value)])
                    writer.add_event(event_pb2.Event(wall_time=wall, step=int(step), summary=summary))
    writer.flush()
    writer.close()
    return output
