"""Guards for the private Lightning, jsonargparse and torch internals ``lightning_async.compat`` relies on.

Each test fails, by name, when an upgrade moves or renames the internal a patch needs (instead of a pipeline that
hangs or trains with a wrong sampler).
"""

from __future__ import annotations

import inspect
import signal
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_async import compat
from lightning_async.strategies import AsyncPipelineStrategy


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **kwargs)


def test_targets_the_installed_lightning_minor_version() -> None:
    assert L.__version__.startswith(compat.LIGHTNING_TARGET + "."), (
        f"compat.py is written for Lightning {compat.LIGHTNING_TARGET}, this is {L.__version__}: re-check every patch"
    )


def test_the_training_sampler_switch_exists() -> None:
    trainer = _trainer()
    assert trainer._accelerator_connector.use_distributed_sampler is True
    compat.keep_training_sampler(trainer)
    assert trainer._accelerator_connector.use_distributed_sampler is False


def test_the_sigterm_hooks_are_the_ones_lightning_calls() -> None:
    trainer = _trainer()
    calls = []
    compat.install_sigterm_hooks(trainer, lambda signum, frame: calls.append(signum), lambda: calls.append("batch"))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        trainer._signal_connector.register_signal_handlers()  # what fit does after setup
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        trainer._signal_connector.teardown()
        signal.signal(signal.SIGTERM, previous)
    assert calls == [signal.SIGTERM]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls[-1] == "batch"
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop)  # still called every batch


def test_the_launchers_keep_their_shape() -> None:
    strategy = AsyncPipelineStrategy()
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(strategy.launcher, compat.PipelineScriptLauncher)
    assert compat.started_processes(strategy.launcher) == [] and callable(strategy.launcher.kill)
    assert callable(getattr(compat.SpawnLauncher, "_collect_rank_zero_results", None))
    spawn = AsyncPipelineStrategy(start_method="spawn")
    L.Trainer(accelerator="cpu", devices=2, strategy=spawn, logger=False)
    assert isinstance(spawn.launcher, compat.PipelineSpawnLauncher)
    wrapping = list(inspect.signature(compat.SpawnLauncher._wrapping_function).parameters)
    assert wrapping[:6] == ["self", "process_idx", "trainer", "function", "args", "kwargs"]
    assert isinstance(spawn._launcher, compat.SpawnLauncher)  # what a predict in a spawned rank unsets


def test_the_scheduler_marker_silences_torchs_order_warning() -> None:
    def step_scheduler(mark: bool) -> list[str]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        if mark:
            compat.mark_optimizer_stepped(optimizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scheduler.step()
        return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]

    assert step_scheduler(mark=False), "torch no longer warns: the marker may be obsolete"
    assert step_scheduler(mark=True) == []


@pytest.mark.parametrize("signum", [None, signal.SIGTERM])
def test_kill_started_reaches_the_launched_processes(signum) -> None:
    import subprocess
    import sys

    strategy = AsyncPipelineStrategy()
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    strategy.launcher.procs = [child]
    compat.kill_started(strategy.launcher, signum)
    assert child.wait(timeout=10) != 0


def test_a_rebound_scheduler_neither_warns_nor_loses_step_tracking() -> None:
    class Wrapper:
        def __init__(self, inner):
            self.inner, self.param_groups, self.calls = inner, inner.param_groups, 0

        def step(self):
            self.calls += 1
            self.inner.step()

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    wrapper = Wrapper(optimizer)
    compat.rebind_lr_scheduler(scheduler, wrapper)
    compat.rebind_lr_scheduler(scheduler, wrapper)  # idempotent: one tracking layer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapper.step()
        scheduler.step()
    assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)] == []
    assert scheduler.optimizer is wrapper and wrapper.calls == 1


def test_the_loop_counters_the_callbacks_read_exist() -> None:
    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append((compat.logged_step(self.trainer), compat.batches_started_this_epoch(self.trainer)))
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(3, 2)), batch_size=1)
    module = Tiny()
    _trainer(max_steps=3, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    assert module.seen == [(0, 1), (1, 2), (2, 3)]
    assert hasattr(_trainer().fit_loop.epoch_loop, "_batches_that_stepped")


def test_the_cli_instantiator_registry_is_wrapped() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_instantiator(lambda cls, *args, **kwargs: cls(*args, **kwargs), torch.nn.Module)
    assert parser._instantiators, "jsonargparse moved its instantiator registry"
    wrapped = []
    compat.wrap_instantiators(parser, lambda inner: wrapped.append(inner) or inner)
    assert len(wrapped) == len(parser._instantiators)


def test_every_form_of_configure_optimizers_is_counted() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    first, second = torch.optim.SGD([weight], lr=0.1), torch.optim.SGD([weight], lr=0.2)
    scheduler = torch.optim.lr_scheduler.StepLR(first, 1)
    forms = {1: [first, [first], ([first], [scheduler]), {"optimizer": first, "lr_scheduler": scheduler}],
             2: [[first, second], ([first, second], []), [{"optimizer": first}, {"optimizer": second}]]}
    for expected, results in forms.items():
        for result in results:
            assert len(compat.configured_optimizers(result)) == expected


def test_the_loggers_read_their_name_lazily(tmp_path) -> None:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    for logger in (TensorBoardLogger(tmp_path, name="quick"), CSVLogger(tmp_path, name="quick")):
        assert compat.add_to_logger_name(logger, "2bw-async-adamw")
        assert compat.add_to_logger_name(logger, "2bw-async-adamw")  # once only
        assert logger.log_dir == str(tmp_path / "quick" / "2bw-async-adamw" / "version_0")
    named = TensorBoardLogger(tmp_path, name="runs", version="adamw-sync-s0")
    assert not compat.add_to_logger_name(named, "sync-adamw") and named.log_dir == str(tmp_path / "runs" / "adamw-sync-s0")
