"""``DivergenceGuard``: stop (or flag) a run whose training loss or gradient norm is not finite.

On the first non-finite value it writes ``DIVERGED`` (JSON: ``step`` as in ``metrics.csv``, ``metric``,
``value`` as a string such as ``"nan"``) into the logger's ``log_dir`` on rank 0, which ``study`` and ``compare`` read. With
``stop=True`` (the default) every rank raises :class:`Diverged` naming the step, so the fit exits non-zero.

Every rank decides alike. Under data parallelism (DDP, FSDP, ...) each rank's loss is its own shard's, so
the watched values are summed over the ranks (``strategy.reduce``, one small all-reduce per step) and a
non-finite value on any rank stops every rank at the same step. Under a pipeline strategy the guard watches
the loss only: it reaches every rank through the runtime's reduction at the same step (one step late under
2BW), so no reduction is needed (a world collective per step would also hold the stages in lockstep). The
gradient norm is not watched there, because each stage applies (and logs) a batch's update at its own
moment; a non-finite norm makes the next loss non-finite anyway.
"""

from __future__ import annotations

import json
import math
import os

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_warn

from lightning_async import compat
from lightning_async.callbacks.delay import pipeline_schedule
from lightning_async.identity import DIVERGED_FILE

MARKER = DIVERGED_FILE
LOSS, GRAD_NORM = "train/loss", "train/grad_norm"


class Diverged(RuntimeError):
    """Training produced a non-finite loss or gradient norm."""


def _training_loss(outputs) -> torch.Tensor | None:
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    return outputs if isinstance(outputs, torch.Tensor) else None


def _as_float(value) -> float:
    return float(value.detach().float().cpu()) if isinstance(value, torch.Tensor) else float(value)


def _summed_over_ranks(strategy, watched: dict[str, float], metrics: list[str]) -> dict[str, float]:
    """Each of ``metrics`` summed over the ranks that watch it (a collective: every rank passes the same
    ``metrics``); a non-finite value on any rank makes the sum non-finite."""
    values = [[watched.get(m, 0.0) for m in metrics], [float(m in watched) for m in metrics]]
    summed = strategy.reduce(torch.tensor(values, device=strategy.root_device), reduce_op="sum").cpu()
    return {m: float(summed[0, i]) for i, m in enumerate(metrics) if summed[1, i] > 0}



class DivergenceGuard(Callback):
    """Stop at the first non-finite training loss (or gradient norm) with a message naming the step.

    Args:
        stop: raise :class:`Diverged` on every rank (the fit exits non-zero); ``False``: only write
            ``DIVERGED`` and warn once, and keep training.
    """

    def __init__(self, stop: bool = True) -> None:
        self.stop = stop
        self.diverged: dict | None = None  # {"step", "metric", "value"} of the first non-finite value

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.diverged = None

    def _watched(self, trainer: Trainer, outputs) -> dict[str, float]:
        """The watched values of this step: this rank's, or (data parallel) their sums over the ranks."""
        metrics = trainer.callback_metrics
        pipeline = pipeline_schedule(trainer) is not None
        found = {LOSS: metrics.get(LOSS, _training_loss(outputs))}
        if not pipeline:
            found[GRAD_NORM] = metrics.get(GRAD_NORM)
        watched = {metric: _as_float(value) for metric, value in found.items() if value is not None}
        if trainer.world_size > 1 and not pipeline:
            watched = _summed_over_ranks(trainer.strategy, watched, list(found))
        return watched

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.diverged is not None and not self.stop:
            return  # recorded once; keep going
        for metric, value in self._watched(trainer, outputs).items():
            if math.isfinite(value):
                continue
            step = compat.logged_step(trainer)
            self.diverged = {"step": step, "metric": metric, "value": str(value)}
            where = self._record(trainer)
            message = (
                f"Training diverged: {metric} = {value} at step {step}.{where} Lower the learning rate "
                "(or clip gradients); to keep training anyway, use DivergenceGuard(stop=False) (CLI: --divergence.stop false)."
            )
            if self.stop:
                raise Diverged(message)
            rank_zero_warn(message)
            return

    def _record(self, trainer: Trainer) -> str:
        """Write ``DIVERGED`` into the run's log directory (rank 0); returns a sentence saying where."""
        log_dir = getattr(trainer.logger, "log_dir", None)
        if not log_dir:
            return ""
        if trainer.is_global_zero:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, MARKER), "w") as f:
                json.dump(self.diverged, f)
        return f" The run is marked {os.path.join(log_dir, MARKER)}."


def ensure_divergence_guard(trainer: Trainer) -> None:
    """A pipeline never trains on silently after a non-finite loss: without a ``DivergenceGuard`` of the user's,
    one with ``stop=True`` is added (before the checkpoint callbacks, so the diverged step is not saved)."""
    if any(isinstance(cb, DivergenceGuard) for cb in trainer.callbacks):
        return
    first_checkpoint = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks))
    trainer.callbacks.insert(first_checkpoint, DivergenceGuard(stop=True))
