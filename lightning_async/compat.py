"""Every place the package reaches into Lightning's, jsonargparse's or torch's private internals, one function each.

Written against Lightning 2.6 (:data:`LIGHTNING_TARGET`) and torch 2.9-2.14. ``tests/test_compat.py`` checks that
each internal still exists with the shape used here, so an upgrade that moves one fails there, by name, instead of
hanging a pipeline. Nothing else in the package touches these attributes. (It sits at the top of the package, not
under ``strategies/``: the callbacks, the data sampler and the CLI need it too, and ``strategies`` imports the
callbacks.)

Why each one is needed:

* the distributed sampler: with one pipeline replica every stage must read the same batches as a single-device
  run (Lightning would shard a training loader across the pipeline's ranks);
* the SIGTERM hooks: Lightning 2.6 broadcasts a SIGTERM flag from rank 0 before every training batch and from its
  signal handler; under a pipeline both hang (see ``AsyncPipelineStrategy``), so the signalled rank stops alone;
* the launchers: the configuration must be checked before other ranks start, and the spawn launcher must hand the
  whole model's state dict (not rank 0's stage) and ``predict``'s results back to the main process;
* torch's LRScheduler marker: the batch's update is applied later (under 2BW) with the lr recorded now, so the
  scheduler may step first; it warns unless the optimizer looks stepped. A scheduler rebound to the delay
  simulation's optimizer wrapper gets the same step tracking torch gives the optimizer it was built on;
* the loop counters: the step the loggers record a batch under (``DivergenceGuard``'s marker) and the batches of
  the epoch already started (the resumable sampler's position);
* jsonargparse's instantiator registry: the CLI wraps every instantiator to report constructor errors as one line;
* Lightning's reading of ``configure_optimizers``' result: the pipeline counts the optimizers before any rank starts.
* a logger's name and version: the run's label goes under the name before the log folder is first asked for.
* the sanity check's results: Lightning validates before training and drops what that logged; when it covered the
  whole validation set, ``RunTelemetry`` logs it as the loss at step 0 (the curve starts where training starts).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable

import torch

from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn

#: the Lightning minor version these patches are written for
LIGHTNING_TARGET = "2.6"

ScriptLauncher = _SubprocessScriptLauncher  # re-runs the script: CLI, torchrun, SLURM
SpawnLauncher = _MultiProcessingLauncher  # spawn: notebooks, tests


def keep_training_sampler(trainer) -> None:
    """Stop Lightning from inserting a shuffling ``DistributedSampler`` into the training loaders."""
    trainer._accelerator_connector.use_distributed_sampler = False


def install_sigterm_hooks(trainer, on_signal: Callable[[int, object], None], at_batch: Callable[[], None]) -> None:
    """``on_signal(signum, frame)`` runs in Lightning's SIGTERM handler instead of its rank-0 broadcast (registered
    after setup); ``at_batch()`` replaces the per-batch SIGTERM broadcast of the fit loop."""
    trainer._signal_connector._sigterm_notifier_fn = on_signal
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = at_batch


def started_processes(launcher) -> list:
    """The processes a script launcher started (empty for other launchers)."""
    return list(getattr(launcher, "procs", None) or [])


def kill_started(launcher, signum: int | None = None) -> None:
    """Send ``signum`` (default SIGKILL) to the processes ``launcher`` started."""
    if started_processes(launcher):
        launcher.kill(_get_sigkill_signal() if signum is None else signum)


def call_step_hook(trainer, name: str, *args) -> None:
    """Lightning's hook ``name`` on the callbacks, then the LightningModule, as its training loop calls it
    (``trainer.call._call_callback_hooks`` and ``_call_lightning_module_hook``; Lightning 2.6)."""
    from lightning.pytorch.trainer import call

    call._call_callback_hooks(trainer, name, *args)
    call._call_lightning_module_hook(trainer, name, *args)


def skip_closure_zero_grad(closure) -> None:
    """Lightning's training closure without its ``zero_grad`` (and so without its ``on_before_zero_grad``): under the
    pipeline the runtime owns the gradients and calls that hook before each update (``Closure._zero_grad_fn``)."""
    if hasattr(closure, "_zero_grad_fn"):
        closure._zero_grad_fn = None


def mark_optimizer_stepped(optimizer) -> None:
    """What torch's ``LRScheduler`` records on the optimizers it patches when they step."""
    getattr(optimizer, "optimizer", optimizer)._opt_called = True


def rebind_lr_scheduler(scheduler, optimizer) -> None:
    """Point ``scheduler`` at ``optimizer`` (a wrapper of the one it was built on) and track ``optimizer.step`` the
    way torch's ``LRScheduler`` tracks the optimizer it is built on (so it neither warns that ``step`` was replaced
    nor that the scheduler stepped first)."""
    scheduler.optimizer = optimizer
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def tracked(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    optimizer.step = tracked


def logged_step(trainer) -> int:
    """The step the loggers record this batch's metrics under (the ``step`` column of ``metrics.csv``)."""
    stepped = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", None)
    return int(stepped) if stepped is not None else max(0, trainer.global_step - 1)


def sanity_check_metrics(trainer) -> dict[str, float]:
    """At ``on_sanity_check_end``: the finite epoch-level values the sanity check's validation logged (``val/loss``),
    which Lightning keeps from the loggers."""
    import math

    results = getattr(trainer, "_results", None)
    found: dict[str, float] = {}
    for result in (results or {}).values():
        meta = getattr(result, "meta", None)
        if meta is None or not (meta.logger and meta.on_epoch) or not getattr(result, "update_called", True):
            continue
        try:
            value = float(result.compute())
        except Exception:  # noqa: BLE001 - a value that cannot be read is simply not logged
            continue
        if math.isfinite(value):
            found[meta.name] = value
    return found


def batches_started_this_epoch(trainer) -> int:
    """Batches of the current epoch the fit loop has started (restored from a checkpoint's loop state)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def add_to_logger_name(logger, part: str) -> bool:
    """Put ``part`` under the name of a logger whose version is still to be numbered (Lightning's TensorBoard and
    CSV loggers keep the name in ``_name`` and read it lazily); False for a logger given a version or of another kind."""
    name = getattr(logger, "_name", None)
    if getattr(logger, "_version", "") is not None or not isinstance(name, str):
        return False
    if os.path.basename(name) != part:
        logger._name = os.path.join(name, part) if name else part
    return True


def wrap_instantiators(parser, wrap: Callable) -> None:
    """Wrap every instantiator jsonargparse's parser holds (``ArgumentParser._instantiators``, 4.53) with ``wrap``."""
    registry = getattr(parser, "_instantiators", None) or {}
    for key, instantiator in list(registry.items()):
        registry[key] = wrap(instantiator)


def configured_optimizers(optim_conf) -> list:
    """The optimizers of a ``configure_optimizers`` result, in any of the forms Lightning accepts."""
    return list(_configure_optimizers(optim_conf)[0])


class ValidatingLauncher:
    """Checks the configuration in the launching process before the other ranks start: a refused configuration must
    not leave ranks running on (each would re-run the whole script, data and model included, first)."""

    def launch(self, function, *args, trainer=None, **kwargs):
        if trainer is not None:
            trainer.strategy.validate_launch(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class PipelineScriptLauncher(ValidatingLauncher, ScriptLauncher):
    """Lightning's script re-running launcher (CLI), validating first."""


class PipelineSpawnLauncher(ValidatingLauncher, SpawnLauncher):
    """Lightning's spawn launcher hands rank 0's ``state_dict`` back to the main process; under a pipeline rank 0
    holds only stage 0, so every stage's weights are gathered first. ``predict`` returns rank 0's predictions to the
    main process too: Lightning refuses ``return_predictions`` under every spawning launcher (under DDP rank 0 holds
    only its shard), so a spawned rank runs ``predict`` as if no launcher had started it."""

    def _wrapping_function(self, process_idx, trainer, function, args, kwargs, *rest):
        if trainer is not None and trainer.state.fn == TrainerFn.PREDICTING:
            function = _as_unlaunched(function, trainer.strategy)
        return super()._wrapping_function(process_idx, trainer, function, args, kwargs, *rest)

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        full = self._strategy.gather_full_state_dict()
        module.state_dict = lambda *args, **kwargs: full
        try:
            output = super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
        if output is not None and trainer.state.fn == TrainerFn.PREDICTING:
            output = output._replace(trainer_results=_AsBytes(output.trainer_results))
        return output


def _loaded(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


class _AsBytes:
    """Pickled as ``torch.save``'s bytes and unpickled as the value itself: no shared-memory tensor goes through the
    spawn launcher's queue (the rank that put it there may have exited before the main process reads it)."""

    def __init__(self, value) -> None:
        self.value = value

    def __reduce__(self):
        buffer = io.BytesIO()
        torch.save(self.value, buffer)
        return _loaded, (buffer.getvalue(),)


def _as_unlaunched(function: Callable, strategy) -> Callable:
    """``function`` run with the strategy's launcher unset: the predict loop's ``return_predictions`` setter (which
    checks for a spawning launcher) then honours ``None`` as ``True``, and an explicit ``False`` still."""

    def run(*args, **kwargs):
        launcher, strategy._launcher = strategy._launcher, None
        try:
            return function(*args, **kwargs)
        finally:
            strategy._launcher = launcher

    return run


def pipeline_launcher(launcher, strategy):
    """The validating variant of the launcher Lightning chose (``launcher`` itself if it is neither)."""
    if isinstance(launcher, SpawnLauncher):
        return PipelineSpawnLauncher(strategy, start_method=strategy._start_method)
    if isinstance(launcher, ScriptLauncher):
        return PipelineScriptLauncher(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
    return launcher
