"""``TensorBoardLogger``: Lightning's, without the ``epoch`` series Lightning adds to every logging call.

An LLM pretraining run has one epoch or none (``max_steps`` decides), so that series is a flat line at 0, and
TensorBoard's *Time Series* tab opened on it first, above the losses. The quick-start recipe uses this logger;
``log_epoch=True`` keeps the series.
"""

from __future__ import annotations

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

EPOCH_KEY = "epoch"


class TensorBoardLogger(LightningTensorBoardLogger):
    """:class:`lightning.pytorch.loggers.TensorBoardLogger` (same arguments) plus ``log_epoch``: write Lightning's
    ``epoch`` series (default ``False``)."""

    def __init__(self, *args, log_epoch: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_epoch = log_epoch

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if not self.log_epoch:
            metrics = {key: value for key, value in metrics.items() if key != EPOCH_KEY}
        if metrics:
            super().log_metrics(metrics, step)
