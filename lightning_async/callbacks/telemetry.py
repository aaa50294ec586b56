"""``RunTelemetry``: the run's identity as hyperparameters, per-group learning rates, gradient norm,
throughput, and a ``DONE`` marker when fit finishes (what ``compare`` and ``study`` read); and
:func:`label_log_dirs`, which puts the run's label (``2bw-async-adamw``, ``sync-adamw``) into its log folder."""

from __future__ import annotations

import json
import os
import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.core.saving import save_hparams_to_yaml
from lightning.pytorch.utilities import rank_zero_only

from lightning_async import compat
from lightning_async.callbacks.delay import DelayCorrection, DelaySimulation, pipeline_schedule
from lightning_async.identity import (
    DONE_FILE, MODE_ASYNC_PIPE, MODE_DELAYED, MODE_SYNC, MODE_SYNC_PIPE, NO_CORRECTION, UNIFORM_PROFILE, RunIdentity,
    run_label,
)
from lightning_async.optim.corrections import as_correction


def run_identity(trainer: Trainer, pl_module: LightningModule) -> dict:
    """This run's :class:`~lightning_async.identity.RunIdentity` record (``optimizer``, ``mode``, ``schedule``,
    ``ef_strength``, ``correction``, ``correction_strength``, ``delay``, ``delay_profile``, ``seed``, ``lr``), from the settings in
    effect: the delay source (``DelaySimulation``, or the pipeline's schedule) and the correction its updates apply
    (read from the runtime or the simulation's optimizer wrappers, however it was set)."""
    hparams = dict(getattr(pl_module, "hparams", {}) or {})
    sources = [cb for cb in trainer.callbacks if isinstance(cb, DelaySimulation) and cb.active]
    delay = max((cb.max_delay for cb in sources), default=0)
    profile = sources[0].profile_label() if sources else UNIFORM_PROFILE
    schedule = pipeline_schedule(trainer)
    if schedule is not None:
        mode = MODE_ASYNC_PIPE if schedule.delayed else MODE_SYNC_PIPE
        delay, profile = schedule.recorded_delay(trainer.strategy.pipeline_parallel_size,
                                                 getattr(trainer.strategy, "data_parallel_size", 1))
    else:
        mode = MODE_DELAYED if delay else MODE_SYNC
    # what the runtime or the simulation's wrappers apply, however it was set; before fit, what is configured to
    corrections = live_corrections(trainer) or configured_corrections(trainer)
    correction = corrections[0] if corrections else None
    return RunIdentity.from_mapping({  # raw values (a module's lr may be anything): read as compare reads them
        "optimizer": hparams.get("optimizer") or "custom",
        "mode": mode,
        "schedule": schedule.name if schedule is not None else None,
        "correction": correction.method if correction is not None else NO_CORRECTION,
        "correction_strength": correction.strength if correction is not None else 0.0,
        "delay": delay,
        "delay_profile": profile,
        "seed": os.environ.get("PL_GLOBAL_SEED"),
        "lr": hparams.get("lr"),
    }).as_record()


def live_corrections(trainer: Trainer) -> list:
    """The correction objects applying updates in this run (the simulation's wrappers', or the pipeline runtime's)."""
    found = [getattr(opt, "correction", None) for opt in trainer.optimizers]
    runtime = getattr(trainer.strategy, "runtime", None)
    found.append(getattr(runtime, "correction", None))
    return [c for c in found if c is not None and c.enabled]


def configured_corrections(trainer: Trainer) -> list:
    """The corrections this run is set up to apply (active correction callbacks, the pipeline strategy's
    ``correction=``), before fit builds them into the optimizers or the runtime."""
    found = [cb.correction for cb in trainer.callbacks if isinstance(cb, DelayCorrection) and cb.active]
    if pipeline_schedule(trainer) is not None:
        found.append(as_correction(getattr(trainer.strategy, "correction", None)))
    return [c for c in found if c is not None and c.enabled]


def label_log_dirs(trainer: Trainer, pl_module: LightningModule) -> str:
    """Put this run's label (:func:`~lightning_async.identity.run_label`) under the name of each logger whose
    version Lightning numbers itself, before anything asks for the log folder:
    ``runs/quickstart/version_0`` becomes ``runs/quickstart/2bw-async-adamw/version_0``. A logger given an explicit
    version (``study`` names its runs) keeps its folder. Returns the label."""
    identity = RunIdentity.from_mapping(run_identity(trainer, pl_module))
    schedule = pipeline_schedule(trainer)
    label = run_label(identity, schedule.name if schedule is not None else None)
    for logger in trainer.loggers:
        compat.add_to_logger_name(logger, label)
    return label


def _group_name(group: dict, index: int) -> str:
    return str(group.get("name", f"group{index}"))


#: the learning rate of a parameter group: under ``train/`` and after ``train/loss``, so that TensorBoard's first screen
#: shows the loss (as ``lr/<group>``, a group of its own, its charts came first: one per group, seven for Muon)
LR_TAG = "train/lr/{}"


def sanity_check_covers_validation(trainer: Trainer) -> bool:
    """Whether the sanity check before training ran every batch a validation runs (``num_sanity_val_steps`` at least
    ``limit_val_batches``): then its loss is the validation loss at step 0."""
    sanity, full = list(trainer.num_sanity_val_batches or []), list(trainer.num_val_batches or [])
    return bool(full) and sanity == full and all(n > 0 for n in full)


def initial_validation(trainer: Trainer) -> dict[str, float]:
    """At ``on_sanity_check_end`` of a fit from step 0: the validation metrics of the untrained model, when the sanity
    check covered the whole validation set (else ``{}``)."""
    if trainer.global_step != 0 or not sanity_check_covers_validation(trainer):
        return {}
    return {k: v for k, v in compat.sanity_check_metrics(trainer).items() if k.startswith("val/")}


class RunTelemetry(Callback):
    """Logs ``train/lr/<group>``, ``train/grad_norm`` (before clipping), ``train/tokens_per_sec``, the correction's
    statistics (``correction/strength`` for adaptive EF), the validation loss at step 0 when the sanity check ran the
    whole validation set (``num_sanity_val_steps`` >= ``limit_val_batches``, as the quick start sets it); writes
    ``DONE``."""

    def __init__(self, log_every_n_steps: int | None = None, label_log_dir: bool = True) -> None:
        """``label_log_dir``: the CLI puts the run's label into its log folder (:func:`label_log_dirs`)."""
        self.log_every_n_steps = log_every_n_steps
        self.label_log_dir = label_log_dir
        self._last_time: float | None = None
        self._rates: dict = {}
        self.identity: dict = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning logged the module's and data module's hyperparameters: the identity must win
        # over same-named keys there (the data module's shuffle ``seed`` is not the run's seed).
        self.identity = run_identity(trainer, pl_module)
        for logger in trainer.loggers:
            logger.log_hyperparams(self.identity)
            hparams_file = getattr(logger, "NAME_HPARAMS_FILE", None)
            if trainer.is_global_zero and hparams_file and getattr(logger, "log_dir", None):
                # Lightning wrote hparams.yaml before this hook and never rewrites it
                save_hparams_to_yaml(os.path.join(logger.log_dir, hparams_file), logger.hparams)
        self._last_time = None

    def _every(self, trainer: Trainer) -> bool:
        n = self.log_every_n_steps or trainer.log_every_n_steps
        return trainer.global_step % max(1, n) == 0

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if not self._every(trainer) or pipeline_schedule(trainer) is not None:
            return  # (a pipeline rank sees its stage's gradients only: the strategy logs the global norm it clips by)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            pl_module.log("train/grad_norm", norm)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        """Read the learning rates this batch trains with: by its end a per-step scheduler has already set the next
        batch's (``train/lr/<group>`` at step ``t`` is batch ``t``'s, as ``LearningRateMonitor`` logs it)."""
        self._rates = self._learning_rates(trainer) if trainer.optimizers else {}

    @staticmethod
    def _learning_rates(trainer: Trainer) -> dict:
        try:
            from lightning_async.optim.zoo import effective_learning_rates

            return effective_learning_rates(trainer.optimizers[0])
        except Exception:  # a user's optimizer the zoo does not know
            return {_group_name(g, i): g["lr"] for i, g in enumerate(trainer.optimizers[0].param_groups)}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_time is not None and isinstance(batch, torch.Tensor) and self._every(trainer):
            replicas = getattr(trainer.strategy, "data_parallel_size", trainer.world_size)
            tokens = batch.shape[0] * max(1, batch.shape[-1] - 1) * replicas
            pl_module.log("train/tokens_per_sec", tokens / max(now - self._last_time, 1e-9))
        self._last_time = now
        if self._every(trainer) and trainer.optimizers:
            for name, lr in self._rates.items():
                pl_module.log(LR_TAG.format(name), float(lr))
            for correction in live_corrections(trainer):  # e.g. the strength adaptive EF chose
                for name, value in correction.statistics().items():
                    pl_module.log(f"correction/{name}", float(value))

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_time = None  # do not count validation time as training throughput

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log the untrained model's validation loss at step 0 (Lightning drops what the sanity check logged)."""
        metrics = initial_validation(trainer)
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=0)

    @rank_zero_only
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        log_dir = trainer.logger.log_dir if trainer.logger is not None else None  # no logger, no run directory
        if log_dir and not trainer.interrupted:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, DONE_FILE), "w") as f:
                json.dump({**self.identity, "global_step": trainer.global_step}, f)
