"""``DivergenceGuard``: a non-finite loss stops the fit (every rank of a pipeline, same step) and marks the run."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from _pipeline_harness import as_torchrun, spawn
from test_strategy import SHAPE, TinyData

from lightning_async.callbacks import Diverged, DivergenceGuard
from lightning_async.lm import CausalLM
from lightning_async.strategies import AsyncPipelineStrategy

DIVERGING_LR = 1e6  # NaN loss within a few steps


def _trainer(log_dir: str, callbacks=(), strategy="auto", devices: int = 1, max_steps: int = 10) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=CSVLogger(log_dir),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
    )


def _model(lr: float = DIVERGING_LR) -> CausalLM:
    L.seed_everything(0)
    return CausalLM(vocab_size=257, model_overrides=SHAPE, lr=lr)


def _marker(trainer: L.Trainer) -> dict:
    with open(os.path.join(trainer.logger.log_dir, "DIVERGED")) as f:
        return json.load(f)


@pytest.mark.slow
def test_nan_loss_stops_with_the_step_and_marks_the_run(tmp_path):
    """Before: training went on to max_steps with a NaN loss and exited normally."""
    trainer = _trainer(str(tmp_path), callbacks=[DivergenceGuard()])
    with pytest.raises(Diverged, match=r"train/loss = nan at step (\d+)\..*DIVERGED.*--divergence.stop false"):
        trainer.fit(_model(), datamodule=TinyData())
    marker = _marker(trainer)
    assert marker["metric"] == "train/loss" and marker["value"] == "nan"
    assert marker["step"] < 10 and trainer.global_step == marker["step"] + 1  # stopped at once
    assert not os.path.exists(os.path.join(trainer.logger.log_dir, "DONE"))


@pytest.mark.slow
def test_keep_going_records_and_warns_once(tmp_path):
    trainer = _trainer(str(tmp_path), callbacks=[DivergenceGuard(stop=False)])
    with pytest.warns(UserWarning, match="Training diverged") as warned:
        trainer.fit(_model(), datamodule=TinyData())
    assert trainer.global_step == 10
    assert len([w for w in warned if "Training diverged" in str(w.message)]) == 1
    assert _marker(trainer)["metric"] == "train/loss"


@pytest.mark.slow
def test_non_finite_gradient_norm_is_caught(tmp_path):
    class InfiniteNorm(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                pl_module.log("train/grad_norm", torch.tensor(float("inf")))

    trainer = _trainer(str(tmp_path), callbacks=[InfiniteNorm(), DivergenceGuard()])
    with pytest.raises(Diverged, match="train/grad_norm = inf at step 1"):
        trainer.fit(_model(lr=1e-3), datamodule=TinyData())
    assert _marker(trainer) == {"step": 1, "metric": "train/grad_norm", "value": "inf"}


@pytest.mark.slow
def test_finite_training_is_left_alone(tmp_path):
    trainer = _trainer(str(tmp_path), callbacks=[DivergenceGuard()], max_steps=4)
    trainer.fit(_model(lr=1e-3), datamodule=TinyData())
    assert trainer.global_step == 4 and not os.path.exists(os.path.join(trainer.logger.log_dir, "DIVERGED"))


# ---- pipeline: every rank stops at the same step; the strategy guards by default -----------------------------
def _pipeline_divergence(tmp: str) -> dict:
    rank = as_torchrun()
    out = {}
    # keep going (explicit guard): trains to max_steps, marks the run
    kept = _trainer(os.path.join(tmp, "kept"), callbacks=[DivergenceGuard(stop=False)], strategy=AsyncPipelineStrategy(n_microbatches=2), devices=2)
    kept.fit(_model(), datamodule=TinyData())
    out["kept"] = {"steps": kept.global_step, "guards": sum(isinstance(cb, DivergenceGuard) for cb in kept.callbacks)}
    if rank == 0:
        out["kept"]["marker"] = _marker(kept)
    # no guard given: the strategy adds one that stops (last: a stopped pipeline is not reused)
    stopped = _trainer(os.path.join(tmp, "stopped"), strategy=AsyncPipelineStrategy(n_microbatches=2), devices=2)
    try:
        stopped.fit(_model(), datamodule=TinyData())
        out["stopped"] = {"error": None}
    except Diverged as err:
        out["stopped"] = {"error": str(err), "steps": stopped.global_step}
        if rank == 0:
            out["stopped"]["marker"] = _marker(stopped)
    out["ddp"] = _ddp_divergence_on_one_rank(tmp, rank)
    return out


class NanOnOneRank(CausalLM):
    """Rank ``rank``'s loss is NaN at step ``step`` (say a bad batch in its shard); the other ranks' are finite."""

    def __init__(self, rank: int, step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.nan_rank, self.nan_step = rank, step

    def _loss(self, batch):
        loss = super()._loss(batch)
        return loss * float("nan") if (self.global_rank, self.global_step) == (self.nan_rank, self.nan_step) else loss


def _ddp_divergence_on_one_rank(tmp: str, rank: int) -> dict:
    trainer = _trainer(os.path.join(tmp, "ddp"), callbacks=[DivergenceGuard()], strategy="ddp", devices=2)
    L.seed_everything(0)
    try:
        trainer.fit(NanOnOneRank(1, 2, vocab_size=257, model_overrides=SHAPE, lr=1e-3), datamodule=TinyData())
        out = {"error": None}
    except Exception as err:
        out = {"error": f"{type(err).__name__}: {err}", "steps": trainer.global_step}
    if rank == 0 and os.path.exists(os.path.join(trainer.logger.log_dir, "DIVERGED")):
        out["marker"] = _marker(trainer)
    return out


@pytest.fixture(scope="module")
def pipeline_divergence(tmp_path_factory):
    return spawn(2, _pipeline_divergence, str(tmp_path_factory.mktemp("diverge")), timeout=240)


def test_pipeline_stops_every_rank_at_the_same_step_by_default(pipeline_divergence):
    """Before: the pipeline trained to max_steps on NaN losses and exited normally."""
    first, second = (rank["stopped"] for rank in pipeline_divergence)
    assert first["error"] and "Training diverged: train/loss = nan" in first["error"], first
    assert first["error"] == second["error"] and first["steps"] == second["steps"] < 10
    assert f"at step {first['marker']['step']}." in first["error"]


@pytest.mark.slow
def test_data_parallel_ranks_stop_together_when_one_rank_diverges(pipeline_divergence):
    """Before: only the rank whose loss was NaN raised Diverged; the other trained on into a collective with a rank
    that had left (a gloo error, or a hang until the group's timeout)."""
    first, second = (rank["ddp"] for rank in pipeline_divergence)
    assert second["error"].startswith("Diverged: Training diverged: train/loss = nan at step 2."), second
    assert first["error"] == second["error"] and first["steps"] == second["steps"] == 3, (first, second)
    assert first["marker"] == {"step": 2, "metric": "train/loss", "value": "nan"}  # rank 0 saw a finite loss


def test_pipeline_keeps_going_when_asked(pipeline_divergence):
    for rank in pipeline_divergence:
        assert rank["kept"]["steps"] == 10 and rank["kept"]["guards"] == 1  # the user's guard, none added
    assert pipeline_divergence[0]["kept"]["marker"]["metric"] == "train/loss"
