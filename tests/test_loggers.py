"""``lightning_async.loggers.TensorBoardLogger``: Lightning's logger without the flat ``epoch`` series."""

from __future__ import annotations

from lightning_async.compare.events import read_scalars
from lightning_async.loggers import TensorBoardLogger


def test_the_epoch_series_is_left_out_unless_asked_for(tmp_path):
    for log_epoch in (False, True):
        logger = TensorBoardLogger(tmp_path, name=f"epoch-{log_epoch}", log_epoch=log_epoch)
        logger.log_metrics({"train/loss": 2.5, "epoch": 0}, step=1)
        logger.log_metrics({"epoch": 0}, step=2)  # nothing else: no empty event either
        logger.finalize("success")
        scalars = read_scalars(logger.log_dir)
        assert scalars["train/loss"] == [(1, 2.5)]
        assert ("epoch" in scalars) is log_epoch
        if log_epoch:
            assert scalars["epoch"] == [(1, 0.0), (2, 0.0)]
