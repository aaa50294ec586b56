"""A Lightning user's own habits under the pipeline, against the same module on one device.

One spawn of four processes runs every pipeline scenario (as torchrun starts ranks, a fresh default group each):
a classifier whose ``pipeline_loss`` returns ``(loss, {"hit": tensor, "accuracy": MulticlassAccuracy})`` fits under
1f1b and 2bw on 2 stages and under 2bw on 2 stages x 2 replicas, is tested and predicts; and the 1f1b and 2bw fits
resume from their step-4 ``ModelCheckpoint`` file. The test process replays each on one device (plain training for
1f1b, ``DelaySimulation`` for 2bw, twice the batch for the replicas): the logged extra values, the epoch-level
Metric, ``predict`` and the resumed weights must agree. The refusals before launch and the learning rate that
``RunTelemetry`` logs next to ``LearningRateMonitor`` run without a spawn.
"""

from __future__ import annotations

import csv
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from _pipeline_harness import in_world, spawn
from lightning_async.callbacks import DelaySimulation, RunTelemetry
from lightning_async.data.sampler import ResumableDataLoader, ResumableShuffleSampler, trainer_position
from lightning_async.strategies import AsyncPipelineStrategy, refusals

CLASSES, STEPS, BATCH, TOL = 4, 8, 8, 1e-6
TRAIN_ROWS, VAL_ROWS, TEST_ROWS, PREDICT_ROWS = 32, 20, 12, 9  # last evaluation batches smaller; 9 rows: replicas differ

# name -> (stages, replicas, schedule)
SCENARIOS = {"1f1b": (2, 1, "1f1b"), "2bw": (2, 1, "2bw"), "2bw-dp2": (2, 2, "2bw")}
RESUMED = ("1f1b", "2bw")


def _tensors(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() * 2 + (x[:, 4:].sum(1) > 0).long()


class Classifier(L.LightningModule):
    """The pipeline contract, extra values from ``pipeline_loss`` and the same steps on one device."""

    pipeline_ignores_steps = True

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, CLASSES))
        self.accuracy = nn.ModuleDict({f"{split}_acc": MulticlassAccuracy(CLASSES, average="micro") for split in ("train", "val", "test")})

    def pipeline_units(self):
        return [(f"layers.{i}", m) for i, m in enumerate(self.layers)]

    def pipeline_split_batch(self, batch):
        return batch

    def pipeline_loss(self, logits, y):
        split = "train" if self.training else "test" if self.trainer.testing else "val"
        metric = self.accuracy[f"{split}_acc"]
        metric.update(logits.detach(), y)
        return F.cross_entropy(logits, y), {"hit": (logits.argmax(-1) == y).float().mean(), "accuracy": metric}

    def pipeline_predict(self, logits):
        return {"log_probs": logits.log_softmax(-1), "label": logits.argmax(-1)}

    def forward(self, x):
        return self.layers(x)

    # ---- one device: what the pipeline does, written as Lightning's docs teach ----
    def _step(self, split: str, batch):
        x, y = batch
        loss, extras = self.pipeline_loss(self(x), y)
        self.log(f"{split}/loss", loss, batch_size=len(y))
        self.log(f"{split}/hit", extras["hit"], batch_size=len(y), on_step=split == "train", on_epoch=split != "train")
        self.log(f"{split}/accuracy", extras["accuracy"], on_step=False, on_epoch=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step("train", batch)

    def validation_step(self, batch, batch_idx):
        self._step("val", batch)

    def test_step(self, batch, batch_idx):
        self._step("test", batch)

    def predict_step(self, batch, batch_idx):
        return self.pipeline_predict(self(batch))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-2)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9), "interval": "step"}}


class Data(L.LightningDataModule):
    """Training batches through the resumable sampler (replicas together read a single device's batch of twice the
    size); evaluation and predict sets whose last batch is smaller."""

    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        data = TensorDataset(*_tensors(TRAIN_ROWS, 1))
        shards = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = ResumableShuffleSampler(data, self.batch_size, seed=0, resume_point=trainer_position(self.trainer), **shards)
        return ResumableDataLoader(data, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def val_dataloader(self):
        return DataLoader(TensorDataset(*_tensors(VAL_ROWS, 2)), batch_size=BATCH)

    def test_dataloader(self):
        return DataLoader(TensorDataset(*_tensors(TEST_ROWS, 3)), batch_size=BATCH)

    def predict_dataloader(self):
        return DataLoader(_tensors(PREDICT_ROWS, 4)[0], batch_size=4)


def _trainer(strategy, devices: int, log_dir: str | None = None, callbacks=(), **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=CSVLogger(log_dir) if log_dir else False,
        enable_checkpointing=any(isinstance(cb, ModelCheckpoint) for cb in callbacks), enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0, max_steps=STEPS, callbacks=list(callbacks),
        **kwargs,
    )


def _logged_steps(log_dir: str, key: str) -> dict[int, float]:
    path = next(os.path.join(root, f) for root, _, files in os.walk(log_dir) for f in files if f == "metrics.csv")
    with open(path) as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def _pipeline(tmp: str, name: str, resume: str | None = None) -> dict:
    stages, replicas, schedule = SCENARIOS[name]
    ckpt_dir, log_dir = os.path.join(tmp, f"ckpt-{name}"), os.path.join(tmp, f"logs-{name}-{resume is not None}")
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1, filename="{step}"),
                 ModelCheckpoint(dirpath=os.path.join(ckpt_dir, "best"), monitor="val/accuracy", mode="max")]
    strategy = AsyncPipelineStrategy(schedule=schedule, n_microbatches=4, pipeline_parallel_size=stages)
    trainer = _trainer(strategy, stages * replicas, log_dir, callbacks=callbacks if resume is None else ())
    model, data = Classifier(), Data()
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    out = {"state": trainer.strategy.gather_full_state_dict()}
    if resume is None:
        out["fit"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        out["test"] = trainer.test(model, datamodule=data, verbose=False)[0]
        out["predict"] = trainer.predict(model, datamodule=data)
        out["hit"] = _logged_steps(log_dir, "train/hit") if dist.get_rank() == 0 else None
        out["best"] = callbacks[1].best_model_score is not None
    return out


def _all_scenarios(tmp: str) -> dict:
    os.environ["SPAWN_RANK"] = str(dist.get_rank())
    dist.destroy_process_group()  # each scenario gets its own default group
    out = {name: in_world(stages * replicas, _pipeline, tmp, name) for name, (stages, replicas, _) in SCENARIOS.items()}
    for name in RESUMED:
        out[f"{name}-resumed"] = in_world(2, _pipeline, tmp, name, os.path.join(tmp, f"ckpt-{name}", "step=4.ckpt"))
    return out


@pytest.fixture(scope="module")
def habits(tmp_path_factory):
    return spawn(4, _all_scenarios, str(tmp_path_factory.mktemp("habits")), timeout=600)


def _one_device(name: str, tmp: str) -> dict:
    _, replicas, schedule = SCENARIOS[name]
    log_dir = os.path.join(tmp, name)
    trainer = _trainer("auto", 1, log_dir, callbacks=[DelaySimulation(1)] if schedule == "2bw" else [])
    model, data = Classifier(), Data(BATCH * replicas)
    trainer.fit(model, datamodule=data)
    out = {"fit": {k: float(v) for k, v in trainer.callback_metrics.items()}, "state": model.state_dict(),
           "hit": _logged_steps(log_dir, "train/hit")}
    out["test"] = trainer.test(model, datamodule=data, verbose=False)[0]
    out["predict"] = trainer.predict(model, datamodule=data)
    return out


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("one-device"))
    return {name: _one_device(name, tmp) for name in SCENARIOS}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_extra_values_and_metrics_equal_one_device_on_every_rank(habits, one_device, name):
    stages, replicas, schedule = SCENARIOS[name]
    reference = one_device[name]
    assert _max_diff(habits[0][name]["state"], reference["state"]) < 2e-5  # the same training
    for rank in habits[: stages * replicas]:
        run = rank[name]
        for key in ("val/hit", "val/accuracy", "train/accuracy", "val/loss"):
            assert run["fit"][key] == pytest.approx(reference["fit"][key], abs=TOL), key
        for key in ("test/hit", "test/accuracy"):
            assert run["test"][key] == pytest.approx(reference["test"][key], abs=TOL), key
        assert run["best"]  # ModelCheckpoint(monitor="val/accuracy") found its value on this rank
    lag = 1 if schedule == "2bw" else 0  # under 2BW step t logs batch t - 1's values, as train/loss
    logged = habits[0][name]["hit"]
    assert sorted(logged) == list(range(lag, STEPS))
    for step, value in logged.items():
        assert value == pytest.approx(reference["hit"][step - lag], abs=TOL)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_predict_equals_one_device_on_the_first_stage(habits, one_device, name):
    stages, replicas, _ = SCENARIOS[name]
    rows = torch.arange(PREDICT_ROWS)[::replicas]  # Lightning's predict sampler: replica 0 reads rows 0, 2, 4, ...
    reference = torch.cat([batch["log_probs"] for batch in one_device[name]["predict"]])
    predicted = habits[0][name]["predict"]
    assert len(predicted) == -(-len(rows) // 4)
    assert torch.equal(torch.cat([b["label"] for b in predicted]), reference.argmax(-1)[rows])
    assert torch.allclose(torch.cat([b["log_probs"] for b in predicted]), reference[rows], atol=1e-5)
    assert all(rank[name]["predict"] == [None] * len(rank[name]["predict"]) for rank in habits[1:stages])  # (stage 1)


@pytest.mark.slow
def test_spawned_predict_returns_every_prediction_to_the_main_process(habits):
    """The notebooks' path: Lightning refuses to return predictions under a spawning launcher; the pipeline's does."""
    L.seed_everything(0)
    model = Classifier()
    model.load_state_dict(habits[0]["2bw"]["state"])
    trainer = _trainer(AsyncPipelineStrategy(n_microbatches=2, start_method="spawn"), 2)
    predicted = trainer.predict(model, datamodule=Data())
    assert len(predicted) == 3 and torch.equal(torch.cat([b["label"] for b in predicted]),
                                               torch.cat([b["label"] for b in habits[0]["2bw"]["predict"]]))


@pytest.mark.parametrize("name", RESUMED)
def test_a_run_resumed_from_its_model_checkpoint_equals_the_uninterrupted_run(habits, name):
    assert _max_diff(habits[0][f"{name}-resumed"]["state"], habits[0][name]["state"]) < 1e-7


# ---- refused before any rank starts ------------------------------------------------------------------------------
class ManualClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class TwoOptimizers(Classifier):
    def configure_optimizers(self):
        return [torch.optim.AdamW(self.layers[0].parameters()), torch.optim.AdamW(self.layers[4].parameters())]


class TwoOptimizersNeedingTheTrainer(TwoOptimizers):
    def configure_optimizers(self):
        assert self.trainer.max_steps  # (a module is attached to its trainer only after launch)
        return super().configure_optimizers()


def test_optimizers_that_need_the_trainer_are_counted_once_it_is_attached():
    """The launcher cannot count them (the strategy then counts at setup, on every rank, before the split)."""
    module = TwoOptimizersNeedingTheTrainer()
    assert refusals.count_optimizers(module) is None
    module.trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(), logger=False, max_steps=1)
    assert refusals.count_optimizers(module) == 2
    with pytest.raises(ValueError, match="configure_optimizers returned 2 optimizers"):
        refusals.refuse_optimizers(module, refusals.count_optimizers(module))


class LoggingSteps(Classifier):
    pipeline_ignores_steps = False


@pytest.fixture
def no_rank_starts(monkeypatch):
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    def started(self):
        raise AssertionError("other ranks were started before the configuration was checked")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", started)


class OwnClipping(Classifier):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, 0.5, "norm")


@pytest.mark.parametrize("module, trainer_kwargs, message", [
    (ManualClassifier, {}, r"automatic_optimization = False cannot run under a pipeline strategy"),
    (TwoOptimizers, {}, r"configure_optimizers returned 2 optimizers, but the pipeline strategy steps exactly one"),
    (Classifier, {"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2 with a pipeline strategy.*n_microbatches"),
    (Classifier, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, r"gradient_clip_algorithm='value'.*'norm'"),
    (OwnClipping, {}, r"OwnClipping overrides configure_gradient_clipping, which a pipeline strategy cannot honour"),
])
def test_unsupported_training_is_refused_before_any_rank_starts(no_rank_starts, module, trainer_kwargs, message):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(), logger=False, max_steps=1, **trainer_kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module(), datamodule=Data())


def test_steps_the_pipeline_does_not_run_are_named_once(no_rank_starts):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(), logger=False, accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match=r"LoggingSteps overrides training_step, validation_step, test_step, which the pipeline"):
        with pytest.raises(ValueError, match="accumulate_grad_batches"):
            trainer.fit(LoggingSteps(), datamodule=Data())


def test_extra_values_of_the_wrong_kind_are_named():
    from lightning_async.pipeline.metrics import split_loss_result

    loss = torch.tensor(1.0)
    assert split_loss_result(loss) == (loss, {})
    with pytest.raises(TypeError, match=r"extra value 'per_class': Tensor\[4\]. Extra values are named \(str\) scalars"):
        split_loss_result((loss, {"per_class": torch.zeros(4)}))
    with pytest.raises(TypeError, match=r"pipeline_loss returned str; return the mean loss"):
        split_loss_result("loss")
    assert isinstance(split_loss_result((loss, {"acc": MulticlassAccuracy(3)}))[1]["acc"], Metric)


def test_extra_values_on_one_process_are_averaged_as_the_loss_is():
    """Training: the plain mean over micro-batches; evaluation: weighted by their rows; the same names every time."""
    from lightning_async.pipeline.metrics import LossExtras

    extras = LossExtras(lambda outputs, targets: (outputs.mean(), {"mean": outputs.mean(), "rows": float(len(outputs))}))
    for part in (torch.ones(3), torch.zeros(1)):
        assert extras(part, part) == part.mean()
    extras.end_training_call(0)
    assert {k: float(v) for k, v in extras.training_values(0).items()} == {"mean": 0.5, "rows": 2.0}
    for part in (torch.ones(3), torch.zeros(1)):
        extras(part, part)
    values, rows = extras.end_eval_batch("val")
    assert rows == 4 and float(values["mean"]) == 0.75 and float(values["rows"]) == 2.5
    extras(torch.ones(2), torch.ones(2))
    extras.loss_fn = lambda outputs, targets: (outputs.mean(), {"other": outputs.mean()})
    extras(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match=r"extra values \['mean', 'rows'\] for one micro-batch and \['other'\] for another"):
        extras.end_training_call(1)


def test_run_telemetry_logs_the_learning_rate_learning_rate_monitor_logs(tmp_path):
    """Before: at step t ``train/lr/adamw`` (then ``lr/adamw``) showed the rate a per-step scheduler had already set for batch t + 1."""
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[RunTelemetry(), LearningRateMonitor()])
    data = DataLoader(TensorDataset(*_tensors(80, 5)), batch_size=8)
    trainer.fit(Classifier(), data)  # AdamW, a per-step StepLR
    ours, monitor = _logged_steps(str(tmp_path), "train/lr/group0"), _logged_steps(str(tmp_path), "lr-AdamW")
    assert sorted(ours) == sorted(monitor) == list(range(10))
    assert all(ours[step] == pytest.approx(monitor[step], rel=1e-6) for step in ours)  # (self.log keeps float32)
    assert monitor[9] != pytest.approx(monitor[8])  # the schedule moves every step (so a shifted log would differ)
