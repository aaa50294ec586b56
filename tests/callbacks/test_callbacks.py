"""``DelaySimulation``, ``ErrorFeedback`` and ``RunTelemetry`` in a real ``lightning.Trainer`` (one CPU device).

The fits are compared with the independent reference loop of ``tests/optim/test_delay.py`` driven by the same
warmup-cosine ``LambdaLR`` and gradient clipping Lightning applies, so the callbacks are checked against
the rule itself, not against ``DelayedOptimizer``.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, Sampler

from lightning_async.callbacks import DelayCorrection, DelaySimulation, ErrorFeedback, RunTelemetry
from lightning_async.lm import CausalLM
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import DelayedOptimizer, build_correction, build_optimizer
from lightning_async.pipeline.profiles import parameter_delays, unit_delays
from lightning_async.optim.lr_schedules import warmup_cosine
from test_delay import reference_delayed
from workload import LRS, SHAPE, STEPS, WEIGHT_DECAY, make_batches

VOCAB = SHAPE["vocab_size"]
OVERRIDES = {k: v for k, v in SHAPE.items() if k != "vocab_size"}
KWARGS = {"muon": {"ns_dtype": "float32"}}  # fp32 Newton-Schulz for exact comparisons (as the CLI spells it)
CLIP = 0.5  # below the tiny model's gradient norm (~1), so clipping really acts
VAL_EVERY = 5  # one batch per epoch, so validation after steps 5, 10, 15, 20
TOL = 1e-6

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:.*but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    # torch's LRScheduler warns once the wrapper replaces the optimizer it had patched (cosmetic, see docs/delay.md)
    pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden"),
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),  # FIFO warm-up step
    pytest.mark.usefixtures("one_thread"),
]


# ---- data: one batch per epoch, chosen by the epoch, so a resumed fit sees the same batches -------
TRAIN = make_batches(STEPS, seed=1)
VAL = make_batches(2, seed=2)


class EpochSampler(Sampler):
    """Yields the index of the current epoch: batch t is the t-th epoch's only batch, resume or not."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        yield self.epoch % self.n

    def __len__(self) -> int:
        return 1


def train_loader() -> DataLoader:
    return DataLoader(TRAIN, batch_size=None, sampler=EpochSampler(len(TRAIN)))


def val_loader() -> DataLoader:
    return DataLoader(VAL, batch_size=None)


def make_module(optimizer: str = "adamw", seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(
        vocab_size=VOCAB, model_overrides=OVERRIDES, optimizer=optimizer, lr=LRS[optimizer],
        weight_decay=WEIGHT_DECAY, optimizer_kwargs=KWARGS.get(optimizer),
    )


def make_trainer(callbacks: list, max_steps: int = STEPS, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=CLIP, num_sanity_val_steps=0,
        check_val_every_n_epoch=VAL_EVERY, log_every_n_steps=1,
    )
    options.update(kwargs)
    return Trainer(callbacks=callbacks, **options)


def reference(optimizer: str, delay: int, lam: float, pairing: str = "2bw", **kwargs) -> list[dict[str, torch.Tensor]]:
    """x(0..STEPS) by parameter name, from the independent loop (same schedule, same clipping)."""
    stepper = make_module(optimizer)
    opt = build_optimizer(
        optimizer, stepper.named_parameters(), lr=LRS[optimizer], weight_decay=WEIGHT_DECAY, **KWARGS.get(optimizer, {})
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, STEPS, 0.1, 0.1))
    return reference_delayed(make_module(optimizer), stepper, opt, TRAIN, delay, lam, pairing, sched, clip=CLIP, **kwargs)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def hand_loss(module, batches) -> float:
    with torch.no_grad():
        losses = [next_token_loss(module(i), t) for i, t in map(split_next_token, batches)]
    return float(torch.stack(losses).mean())


class ValidationProbe(Callback):
    """Placed after DelaySimulation: records what the parameters hold when validation starts."""

    def __init__(self) -> None:
        self.shown: list[dict[str, torch.Tensor]] = []
        self.hand: list[float] = []
        self.logged: list[float] = []
        self.newest_is_shown: list[bool] = []
        self.stale_differs: list[bool] = []
        self.restored: list[bool] = []

    def on_validation_start(self, trainer, pl_module) -> None:
        opt = trainer.optimizers[0]
        assert isinstance(opt, DelayedOptimizer)
        self.newest_is_shown.append(all(torch.equal(p, w) for p, w in zip(opt.params, opt.newest_weights())))
        stale = opt.forward_weights()
        self.stale_differs.append(any(not torch.equal(p, s) for p, s in zip(opt.params, stale)))
        self._forward = [s.detach().clone() for s in stale]
        self.shown.append(weights(pl_module))
        self.hand.append(hand_loss(pl_module, VAL))

    def on_validation_end(self, trainer, pl_module) -> None:
        self.logged.append(float(trainer.callback_metrics["val/loss"]))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if getattr(self, "_forward", None) is not None:  # training resumes at the stale (forward) weights
            opt = trainer.optimizers[0]
            self.restored.append(all(torch.equal(p, f) for p, f in zip(opt.params, self._forward)))
            self._forward = None


# ---- parity with the reference -------------------------------------------------------------------
PARITY = [
    dict(optimizer="adamw", lam=1.0, pairing="2bw"),
    dict(optimizer="muon", lam=1.0, pairing="2bw"),
    dict(optimizer="adamw", lam=0.0, pairing="2bw"),
    dict(optimizer="adamw", lam=1.0, pairing="fifo"),
    dict(optimizer="muon", lam=0.5, pairing="2bw", ef_first=True),  # callback order does not matter
    dict(optimizer="adamw", lam=1.0, pairing="2bw", extrapolate_weight_decay=False),
]


@pytest.mark.parametrize("case", PARITY, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_fit_follows_the_delayed_rule(case: dict) -> None:
    optimizer, lam, pairing = case["optimizer"], case["lam"], case["pairing"]
    decay = case.get("extrapolate_weight_decay", True)
    expected = reference(optimizer, 1, lam, pairing, extrapolate_weight_decay=decay)
    module = make_module(optimizer)
    probe = ValidationProbe()
    ef = [ErrorFeedback(lam, extrapolate_weight_decay=decay)] if lam else []
    delay = [DelaySimulation(1, pairing=pairing)]
    callbacks = (ef + delay if case.get("ef_first") else delay + ef) + [probe]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(callbacks).fit(module, train_loader(), val_loader())
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)]
    assert not scheduler_warnings  # the scheduler, rebound to the wrapper, sees its steps

    # after fit the module holds the newest weights x(STEPS)
    assert max_diff(weights(module), expected[-1]) <= TOL
    # validation ran at the newest weights x(t), t = 5, 10, 15, 20, and its logged loss is theirs
    assert len(probe.shown) == STEPS // VAL_EVERY
    assert all(probe.newest_is_shown)
    for i, shown in enumerate(probe.shown):
        assert max_diff(shown, expected[(i + 1) * VAL_EVERY]) <= TOL
    for hand, logged in zip(probe.hand, probe.logged):
        assert math.isclose(hand, logged, rel_tol=0, abs_tol=1e-6)
    # ...and training went on at the stale weights afterwards (2BW: they differ from the newest)
    assert probe.restored and all(probe.restored)
    if pairing == "2bw":
        assert all(probe.stale_differs)


def plain_delayed_loop(optimizer: str, delays: dict[str, int] | None = None, **delayed) -> dict[str, torch.Tensor]:
    """The same fit as a plain loop around ``DelayedOptimizer`` (same schedule and clipping as the trainer);
    ``delays``: per-parameter delays by name."""
    module = make_module(optimizer)
    named = dict(module.named_parameters())
    opt = build_optimizer(optimizer, module.named_parameters(), lr=LRS[optimizer], weight_decay=WEIGHT_DECAY,
                          **KWARGS.get(optimizer, {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, STEPS, 0.1, 0.1))
    if delays is not None:
        delayed.update(delay=0, parameter_delays={named[n]: k for n, k in delays.items()})
    wrapped = DelayedOptimizer(opt, pairing="2bw", **delayed)
    for batch in TRAIN:
        inputs, targets = split_next_token(batch)
        next_token_loss(module(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        wrapped.step()
        wrapped.zero_grad()
        sched.step()
    newest = {id(p): w for p, w in zip(wrapped.params, wrapped.newest_weights())}
    return {n: newest[id(p)].detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("method", ["nesterov", "dc-asgd", "weight-prediction"])
def test_delay_correction_callback_applies_the_correction(method: str) -> None:
    """The callback hands the correction to the wrapper (its rule: tests/optim/test_corrections.py)."""
    module = make_module("adamw")
    make_trainer([DelayCorrection(method), DelaySimulation(1)]).fit(module, train_loader())
    expected = plain_delayed_loop("adamw", delay=1, correction=build_correction(method))
    assert max_diff(weights(module), expected) <= TOL
    assert max_diff(weights(module), plain_delayed_loop("adamw", delay=1)) > 1e-6  # it is not the plain delay


def test_pipedream_profile_reaches_the_wrapper() -> None:
    module = make_module("muon")
    make_trainer([DelaySimulation(profile="pipedream", stages=4)]).fit(module, train_loader())
    reference_module = make_module("muon")
    units = [(n, u) for n, u in reference_module.pipeline_units()]
    by_name = {id(p): n for n, p in reference_module.named_parameters()}
    by_unit = unit_delays(units, "pipedream", 4, delay=1)
    delays = {by_name[id(p)]: k for p, k in parameter_delays(units, by_unit).items()}
    assert sorted(set(delays.values())) == [0, 1, 2, 3]
    expected = plain_delayed_loop("muon", delays)
    assert max_diff(weights(module), expected) <= TOL


def test_sync_fit_is_the_plain_loop_and_differs_from_delayed() -> None:
    expected = reference("adamw", 0, 0.0)
    module = make_module("adamw")
    make_trainer([DelaySimulation(0)]).fit(module, train_loader())
    got = weights(module)
    assert max_diff(got, expected[-1]) <= TOL
    assert max_diff(got, reference("adamw", 1, 0.0)[-1]) > 1e-4  # negative control: the delay matters


# ---- checkpoint and resume -----------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_from_checkpoint_is_exact(optimizer: str, tmp_path) -> None:
    def callbacks():
        return [DelaySimulation(1), ErrorFeedback(1.0)]

    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1, filename="{step}")
    module = make_module(optimizer)
    make_trainer(callbacks() + [checkpoint], enable_checkpointing=True).fit(module, train_loader(), val_loader())
    uninterrupted = weights(module)
    path = tmp_path / "step=7.ckpt"
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())

    # the checkpoint holds the newest weights x(7), not the stale ones the next forward reads
    saved = torch.load(path, weights_only=False)["state_dict"]
    expected = reference(optimizer, 1, 1.0)
    assert max_diff({n: saved[n] for n in expected[7]}, expected[7]) <= TOL

    resumed = make_module(optimizer, seed=123)  # other initial weights: everything must come from the checkpoint
    make_trainer(callbacks()).fit(resumed, train_loader(), val_loader(), ckpt_path=str(path))
    for n, w in weights(resumed).items():
        assert torch.equal(w, uninterrupted[n]), n


# ---- fitting the same module again ---------------------------------------------------------------
# (DelaySimulation once kept its wrapper on the module for good; teardown now undoes it.)


def test_second_fit_without_delay_simulation_is_synchronous() -> None:
    module = make_module()
    make_trainer([DelaySimulation(1)], max_steps=3).fit(module, train_loader())
    trainer = make_trainer([], max_steps=3)
    trainer.fit(module, train_loader())
    assert not isinstance(trainer.optimizers[0], DelayedOptimizer)  # actual: still DelayedOptimizer(delay=1)


def test_second_fit_uses_the_new_callbacks_settings() -> None:
    module = make_module()
    make_trainer([DelaySimulation(1)], max_steps=3).fit(module, train_loader())
    callback = DelaySimulation(2)
    trainer = make_trainer([callback, ErrorFeedback(1.0)], max_steps=3)
    trainer.fit(module, train_loader())
    opt = trainer.optimizers[0]
    # actual: delay 1, error_feedback 0.0, and callback.optimizers == [] (so no newest weights after fit)
    assert (opt.delay, opt.error_feedback) == (2, 1.0)
    assert callback.optimizers == [opt]


# ---- bad configurations --------------------------------------------------------------------------
@pytest.mark.parametrize("sources", [[], [DelaySimulation(0)]], ids=["none", "delay0"])
def test_error_feedback_without_delay_source(sources: list) -> None:
    trainer = make_trainer(sources + [ErrorFeedback(1.0)], max_steps=1)
    with pytest.raises(ValueError, match="ErrorFeedback needs a delay source") as info:
        trainer.fit(make_module(), train_loader())
    assert "DelaySimulation" in str(info.value) and "async_pipe" in str(info.value)


def test_error_feedback_zero_needs_no_source() -> None:
    module = make_module()
    make_trainer([ErrorFeedback(0.0)], max_steps=2).fit(module, train_loader())  # the sync recipe's setting


@pytest.mark.parametrize("delay", [-1, 0.5, "1"])
def test_delay_simulation_rejects_bad_delay(delay) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        DelaySimulation(delay=delay)


def test_error_feedback_rejects_negative_strength() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        ErrorFeedback(-1.0)


# ---- telemetry -----------------------------------------------------------------------------------
from lightning_async.identity import IDENTITY_KEYS, RunIdentity  # noqa: E402


@pytest.mark.parametrize(
    "callbacks,identity",
    [
        (lambda: [DelaySimulation(1), ErrorFeedback(1.0)], dict(mode="delayed", ef_strength=1.0, delay=1)),
        (lambda: [DelaySimulation(0), ErrorFeedback(0.0)], dict(mode="sync", ef_strength=0.0, delay=0)),
        (lambda: [DelaySimulation(1), DelayCorrection("nesterov", 0.5)],
         dict(mode="delayed", ef_strength=0.0, correction="nesterov", correction_strength=0.5, delay=1)),
    ],
    ids=["delayed-ef", "sync", "delayed-nesterov"],
)
def test_run_telemetry_logs_identity_and_done(callbacks, identity: dict, tmp_path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = make_trainer(callbacks() + [RunTelemetry(log_every_n_steps=1)], max_steps=3, logger=logger)
    trainer.fit(make_module(), train_loader())
    log_dir = tmp_path / "run" / "version_0"
    assert trainer.log_dir == str(log_dir)

    done = json.loads((log_dir / "DONE").read_text())
    assert done["global_step"] == 3
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    for key, value in {"optimizer": "adamw", **identity}.items():
        assert done[key] == value, key
        assert hparams[key] == value, key
    assert set(IDENTITY_KEYS) <= set(hparams)
    assert RunIdentity.from_mapping(hparams).as_record() == {k: done[k] for k in IDENTITY_KEYS}  # one schema
    assert "train/lr/adamw" in trainer.logged_metrics and "train/grad_norm" in trainer.logged_metrics


def test_run_identity_of_the_pipeline_strategy_error_feedback() -> None:
    """A pipeline whose runtime applies EF (however it was set) is recorded as the ef correction under the one schema."""
    from types import SimpleNamespace

    from lightning_async.callbacks import run_identity
    from lightning_async.optim import build_correction
    from lightning_async.strategies import AsyncPipelineStrategy

    model = CausalLM(vocab_size=VOCAB, model_overrides=OVERRIDES)
    for applied, correction, strength in ((build_correction("ef", 1.0), "ef", 1.0), (None, "none", 0.0)):
        strategy = AsyncPipelineStrategy()
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
        strategy.runtime = SimpleNamespace(correction=applied)
        record = run_identity(trainer, model)
        assert (record["mode"], record["correction"], record["correction_strength"]) == (
            "async_pipe", correction, strength)
        assert record["ef_strength"] == strength and tuple(record) == IDENTITY_KEYS
        assert RunIdentity.from_mapping(record).category == ("async+EF" if strength else "async")

def test_a_sanity_check_over_the_whole_validation_set_is_the_loss_at_step_0(tmp_path, capsys):
    """The quick start's curve starts before training: a sanity check that ran every validation batch is logged as
    val/loss at step 0 (and printed); a partial one (Lightning's default 2 batches of 4) is not."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_async.callbacks import RunTelemetry, StepProgress
    from lightning_async.data import TextDataModule
    from lightning_async.lm import CausalLM

    def fit(sanity: int, name: str) -> list[dict]:
        logger = CSVLogger(tmp_path, name=name)
        trainer = L.Trainer(accelerator="cpu", max_steps=2, limit_val_batches=4, num_sanity_val_steps=sanity,
                            val_check_interval=2, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[RunTelemetry(label_log_dir=False), StepProgress()])
        trainer.fit(CausalLM(model="tiny", vocab_size=257),
                    TextDataModule(source="stdlib", tokenizer="byte", seq_len=32, batch_size=4,
                                   cache_dir=str(tmp_path / "cache")))
        import csv

        with open(Path(logger.log_dir) / "metrics.csv") as f:
            return [row for row in csv.DictReader(f) if row.get("val/loss")]

    rows = fit(4, "whole")
    assert [int(r["step"]) for r in rows] == [0, 1] and float(rows[0]["val/loss"]) > 5.0  # ln 257 = 5.55, untrained
    assert "validation at step 0: val/loss" in capsys.readouterr().out
    assert [int(r["step"]) for r in fit(2, "partial")] == [1]
