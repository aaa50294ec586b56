"""Logging of ``pipeline_loss``'s extra values (:mod:`lightning_async.pipeline.metrics`) under the pipeline.

Scalars are logged with the loss, as ``train/<name>`` (the step semantics of ``train/loss``: under 2BW batch
``t - 1``'s at step ``t``), ``val/<name>`` and ``test/<name>`` (weighted by the rows of every replica's batch, so the
epoch's value is the mean over every row). torchmetrics ``Metric`` values are computed at the end of each epoch by
:class:`PipelineMetricsLogger`, which the strategy adds to the trainer. Every rank logs the same values, so
``callback_metrics`` and monitors agree everywhere.
"""

from __future__ import annotations

from lightning.pytorch import Callback
from lightning.pytorch.callbacks import Checkpoint


def log_values(module, split: str, values: dict, batch_size: int | None = None) -> None:
    """``module.log`` each value as ``<split>/<name>``."""
    for name, value in values.items():
        module.log(f"{split}/{name}", value, batch_size=batch_size)


class PipelineMetricsLogger(Callback):
    """Computes the Metrics ``pipeline_loss`` returned at the end of each epoch and logs them on every rank."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def _extras(self):
        return getattr(self.strategy, "loss_extras", None)

    def _log_epoch(self, pl_module, split: str) -> None:
        extras = self._extras()
        if extras is not None:
            log_values(pl_module, split, extras.compute_epoch(split))

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if self._extras() is not None:
            self._extras().begin_epoch("val")

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        if self._extras() is not None:
            self._extras().begin_epoch("test")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._log_epoch(pl_module, "train")

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._log_epoch(pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._log_epoch(pl_module, "test")


def add_metrics_logger(trainer, strategy) -> None:
    """Add :class:`PipelineMetricsLogger` (once; before the checkpoint callbacks, so a monitor sees its values)."""
    for callback in trainer.callbacks:
        if isinstance(callback, PipelineMetricsLogger):
            callback.strategy = strategy
            return
    first = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks))
    trainer.callbacks.insert(first, PipelineMetricsLogger(strategy))
