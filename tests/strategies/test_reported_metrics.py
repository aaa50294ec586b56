"""What a pipeline *reports* equals the single-device evaluation of the same weights.

One spawn of four processes runs every pipeline scenario in turn, each on the first ``pp x dp`` ranks (started as
torchrun would start them, with a fresh default group per scenario), so later scenarios also run in processes that
ran earlier ones: 1f1b and 2bw on 2 and 3 stages, 2bw on 2 stages x 2 replicas, and a pipeline ``validate``/``test``
of a module that the same process had just validated on one device. The test process then evaluates the weights
each scenario returned on one device, on the same batches, and replays the training on one device (plain training
for 1f1b, ``DelaySimulation`` for 2bw): logged ``val/loss``, ``test/loss``, ``train/loss`` and ``train/tokens``
must agree to float tolerance.

What ``train/loss`` means under 2BW (docs/pipeline.md): at step ``t`` the pipeline logs the loss of batch
``t - 1``, computed on the weights that batch's forward used (one update behind, as in ``DelaySimulation``), so
it equals the single-device simulation's ``train/loss`` of step ``t - 1``; nothing is logged at step 0.
``train/tokens`` at step ``t`` counts batches ``0..t`` on both.
"""

from __future__ import annotations

import csv
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from _pipeline_harness import SHAPE as HARNESS_SHAPE
from _pipeline_harness import in_world as _in_world
from _pipeline_harness import spawn
from lightning_async.callbacks import DelaySimulation
from lightning_async.data.sampler import ResumableShuffleSampler
from lightning_async.lm import CausalLM
from lightning_async.strategies import AsyncPipelineStrategy

pytestmark = pytest.mark.slow

SHAPE = {k: v for k, v in HARNESS_SHAPE.items() if k != "vocab_size"}  # four blocks: 6 units, up to 3 stages
STEPS, BATCH, VAL_ROWS, TEST_ROWS = 5, 8, 20, 12  # evaluation sets whose last batch is smaller (8, 8, 4 and 8, 4)
TOL = 1e-6

# name -> (pipeline stages, replicas, schedule)
SCENARIOS = {
    "1f1b-p2": (2, 1, "1f1b"),
    "2bw-p2": (2, 1, "2bw"),
    "1f1b-p3": (3, 1, "1f1b"),
    "2bw-p3": (3, 1, "2bw"),
    "2bw-p2-dp2": (2, 2, "2bw"),
}


class HookRecorder(L.Callback):
    """Lightning's step hooks as they fire: per hook, the batch each call belongs to (the pipeline strategy's
    ``hook_batch``, else the step) and the squared norm of every parameter's ``.grad`` by name."""

    HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[int, dict[str, float]]]] = {h: [] for h in self.HOOKS}

    def _record(self, hook: str, trainer, pl_module) -> None:
        batch = getattr(trainer.strategy, "hook_batch", None)
        grads = {n: float(p.grad.float().pow(2).sum())
                 for n, p in pl_module.named_parameters(remove_duplicate=False) if p.grad is not None}
        self.calls[hook].append((trainer.global_step if batch is None else batch, grads))

    def on_before_backward(self, trainer, pl_module, loss):
        self._record("on_before_backward", trainer, pl_module)

    def on_after_backward(self, trainer, pl_module):
        self._record("on_after_backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._record("on_before_optimizer_step", trainer, pl_module)

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self._record("on_before_zero_grad", trainer, pl_module)


def _rows(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (17,), generator=g) for _ in range(n)]


class Data(L.LightningDataModule):
    """Training batches through the resumable sampler (a data-parallel run's replicas together read the rows of
    a single device's batch of twice the size), and evaluation sets whose last batch is smaller than the others."""

    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        data = _rows(16 * STEPS, 1)
        shards = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        sampler = ResumableShuffleSampler(data, self.batch_size, seed=0, **shards)
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler, drop_last=True)

    def val_dataloader(self):
        return DataLoader(_rows(VAL_ROWS, 2), batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(_rows(TEST_ROWS, 3), batch_size=self.batch_size)


def _model() -> CausalLM:
    L.seed_everything(0)
    return CausalLM(vocab_size=257, model_overrides=SHAPE, lr=3e-3)


def _trainer(strategy, devices: int, log_dir: str | None = None, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=CSVLogger(log_dir) if log_dir else False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        num_sanity_val_steps=0, **kwargs,
    )


def _logged_training(log_dir: str) -> dict[int, dict[str, float]]:
    """``step -> {train/loss, train/tokens}`` from the CSV logger's ``metrics.csv``."""
    path = next(os.path.join(root, f) for root, _, files in os.walk(log_dir) for f in files if f == "metrics.csv")
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = {"train/loss": float(row["train/loss"]), "train/tokens": float(row["train/tokens"])}
    return out


def _pipeline_fit(name: str, tmp: str) -> dict:
    stages, replicas, schedule = SCENARIOS[name]
    model = _model()
    log_dir = os.path.join(tmp, name)
    hooks = HookRecorder()
    trainer = _trainer(AsyncPipelineStrategy(schedule=schedule, n_microbatches=4, pipeline_parallel_size=stages),
                       stages * replicas, log_dir, max_steps=STEPS, val_check_interval=STEPS, callbacks=[hooks])
    trainer.fit(model, datamodule=Data())
    val = float(trainer.callback_metrics["val/loss"])
    test = trainer.test(model, datamodule=Data(), verbose=False)[0]["test/loss"]
    state = trainer.strategy.gather_full_state_dict()
    return {"val": val, "test": test, "state": state if dist.get_rank() == 0 else None,
            "train": _logged_training(log_dir) if dist.get_rank() == 0 else None, "hooks": hooks.calls}


def _validate_on_one_device() -> tuple[CausalLM, float]:
    """A fresh module and its single-device validation loss (the module keeps the metric state it left)."""
    model = _model()
    return model, _trainer("auto", 1).validate(model, datamodule=Data(), verbose=False)[0]["val/loss"]


def _pipeline_validate(model: CausalLM) -> dict:
    """The same module object, now by a 2-stage pipeline in the same process."""
    trainer = _trainer(AsyncPipelineStrategy(schedule="2bw", n_microbatches=2), 2)
    val = trainer.validate(model, datamodule=Data(), verbose=False)[0]["val/loss"]
    test = trainer.test(model, datamodule=Data(), verbose=False)[0]["test/loss"]
    return {"val": val, "test": test}


def _all_scenarios(tmp: str) -> dict:
    os.environ["SPAWN_RANK"] = str(dist.get_rank())
    dist.destroy_process_group()  # each scenario gets its own default group
    validated = _validate_on_one_device() if int(os.environ["SPAWN_RANK"]) < 2 else None
    out = {"before": None if validated is None else {"single": validated[1], "state": {k: v.clone() for k, v in validated[0].state_dict().items()}}}
    for name, (stages, replicas, _) in SCENARIOS.items():
        out[name] = _in_world(stages * replicas, _pipeline_fit, name, tmp)
    # (every rank joins the same sequence of groups: the ones outside a world skip it)
    joined = _in_world(2, _pipeline_validate, validated[0]) if validated is not None else _in_world(2, lambda: None)
    if validated is not None:
        out["after_single_device"] = joined
    return out


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reported"))
    return spawn(4, _all_scenarios, tmp, timeout=600)


def _single_device_eval(state: dict) -> tuple[float, float]:
    model = _model()
    model.load_state_dict(state)
    trainer = _trainer("auto", 1)
    val = trainer.validate(model, datamodule=Data(), verbose=False)[0]["val/loss"]
    test = trainer.test(model, datamodule=Data(), verbose=False)[0]["test/loss"]
    return val, test


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_logged_val_and_test_loss_equal_single_device_evaluation(reported, name):
    stages, replicas, _ = SCENARIOS[name]
    ranks = [r[name] for r in reported[: stages * replicas]]
    val, test = _single_device_eval(ranks[0]["state"])
    for rank in ranks:  # every rank logs the same value
        assert rank["val"] == pytest.approx(val, abs=TOL)
        assert rank["test"] == pytest.approx(test, abs=TOL)


def test_pipeline_validate_after_a_single_device_validate_in_the_same_process(reported):
    before = reported[0]["before"]
    val, test = _single_device_eval(before["state"])
    assert before["single"] == pytest.approx(val, abs=TOL)
    for rank in reported[:2]:
        assert rank["after_single_device"]["val"] == pytest.approx(val, abs=TOL)
        assert rank["after_single_device"]["test"] == pytest.approx(test, abs=TOL)


def test_spawned_pipeline_validate_after_a_single_device_validate():
    """The user's path: validate on one device, then the same module object through Lightning's spawn launcher."""
    model, single = _validate_on_one_device()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(AsyncPipelineStrategy(schedule="2bw", n_microbatches=2, start_method="spawn"), 2)
    val = trainer.validate(model, datamodule=Data(), verbose=False)[0]["val/loss"]
    assert val == pytest.approx(single, abs=TOL)
    assert val == pytest.approx(_single_device_eval(state)[0], abs=TOL)


def test_validate_then_fit_on_one_device():
    """A module validated (under inference mode) trains and validates again: its metric state is ordinary tensors."""
    model = _model()
    first = _trainer("auto", 1).validate(model, datamodule=Data(), verbose=False)[0]["val/loss"]
    trainer = _trainer("auto", 1, max_steps=2, val_check_interval=2, limit_val_batches=1)
    trainer.fit(model, datamodule=Data())  # raised "Inplace update to inference tensor" before
    assert 3.0 < first < 7.0 and trainer.global_step == 2


def _single_device_training(tmp: str, delayed: bool, batch_size: int, hooks: HookRecorder | None = None) -> dict[int, dict[str, float]]:
    log_dir = os.path.join(tmp, f"single-{delayed}-{batch_size}")
    callbacks = ([DelaySimulation(1)] if delayed else []) + ([hooks] if hooks is not None else [])
    trainer = _trainer("auto", 1, log_dir, max_steps=STEPS, limit_val_batches=0, callbacks=callbacks)
    trainer.fit(_model(), datamodule=Data(batch_size))
    return _logged_training(log_dir)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_logged_training_loss_and_tokens(reported, name, tmp_path):
    stages, replicas, schedule = SCENARIOS[name]
    logged = reported[0][name]["train"]
    reference = _single_device_training(str(tmp_path), schedule == "2bw", BATCH * replicas)
    lag = 1 if schedule == "2bw" else 0
    assert sorted(logged) == list(range(lag, STEPS))  # 2BW: nothing at step 0, the last batch's loss never
    for step, values in logged.items():
        assert values["train/loss"] == pytest.approx(reference[step - lag]["train/loss"], abs=2e-5)
        assert values["train/tokens"] == reference[step]["train/tokens"]


@pytest.mark.parametrize("name", [n for n, (_, replicas, _) in SCENARIOS.items() if replicas == 1])
def test_lightning_step_hooks_fire_per_batch_with_that_batchs_gradients(reported, name, tmp_path):
    """Under the pipeline Lightning's step hooks fire on every rank once per batch, around the rank's own backwards
    and before its update, with its stage's gradients of that batch (2BW: the batch may be the step before): every
    parameter's gradient norm equals the one-device run's (plain training for 1f1b, DelaySimulation for 2bw) at
    the same batch, in on_before_optimizer_step, and in on_after_backward but for a tied weight (there a rank
    holds its own use's gradient; the other stage's is summed in before the update)."""
    stages, _, schedule = SCENARIOS[name]
    single = HookRecorder()
    _single_device_training(str(tmp_path), schedule == "2bw", BATCH, single)
    for hook in HookRecorder.HOOKS:
        assert [b for b, _ in single.calls[hook]] == list(range(STEPS)), hook
    held = [set().union(*(g for _, g in reported[r][name]["hooks"]["on_before_optimizer_step"])) for r in range(stages)]
    names: dict[int, list[str]] = {}
    for n, p in _model().named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    tied = {n for same in names.values() if len(same) > 1 for n in same}  # (the embedding and the head)
    assert tied, "the test model ties its embedding and head"
    for rank in range(stages):
        calls = reported[rank][name]["hooks"]
        for hook in HookRecorder.HOOKS:  # once per batch and rank (the drain at the end of fit runs the rest)
            assert sorted(b for b, _ in calls[hook]) == list(range(STEPS)), (rank, hook)
        for hook in ("on_after_backward", "on_before_optimizer_step"):
            for batch, grads in calls[hook]:
                reference = dict(single.calls[hook])[batch]
                assert grads and set(grads) <= set(reference), (rank, hook)
                for param, value in grads.items():
                    if hook == "on_after_backward" and param in tied:
                        continue  # (a rank's own use of a tied weight: the other stage's part is summed in later)
                    assert value == pytest.approx(reference[param], rel=1e-4, abs=1e-9), (rank, hook, batch, param)
    assert set().union(*held) <= set(dict(single.calls["on_before_optimizer_step"])[0])
    assert {n for same in names.values() for n in same[:1]} <= set().union(*held)  # every parameter on some stage
