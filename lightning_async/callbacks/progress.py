"""``StepProgress``: one plain line every N optimizer steps, readable in a terminal, a log file or a CI job.

::

    step 40/300 | train/loss 3.2120 | 1,234 tokens/s | val/loss 3.0502 (step 0) | 0:00:52 elapsed, ~0:05:38 left

Only the global rank 0 prints (every pipeline stage runs the callbacks). The ``lightning-async`` CLI puts it in place
of Lightning's default bar (Rich or TQDM, whichever is installed: a bar shows nothing useful when stdout is not a
terminal, and a pipeline's bar showed ``Epoch 0/-2`` and ``v_num``); ``--progress.enabled false`` keeps the bar, a
progress bar of your own in ``trainer.callbacks`` or ``--trainer.enable_progress_bar false`` switches the lines off.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

TRAIN_LOSS, VAL_LOSS = "train/loss", "val/loss"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


def _metric(trainer: Trainer, name: str) -> float | None:
    value = trainer.callback_metrics.get(name)
    if value is None:
        return None
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


def total_steps(trainer: Trainer) -> int | None:
    """The optimizer steps this fit will make (``max_steps``, else Lightning's estimate); ``None`` when unbounded."""
    if trainer.max_steps and trainer.max_steps > 0:
        return int(trainer.max_steps)
    try:
        estimate = trainer.estimated_stepping_batches
    except Exception:  # a loader without a length and no max_steps
        return None
    return int(estimate) if estimate != float("inf") else None


class StepProgress(Callback):
    """Print the step, the training loss, tokens per second, the latest validation loss, and the time elapsed and left.

    Args:
        every_n_steps: a line every this many optimizer steps (``None``: the trainer's ``log_every_n_steps``).
        enabled: print at all.
    """

    def __init__(self, every_n_steps: int | None = None, enabled: bool = True) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"StepProgress every_n_steps must be >= 1, got {every_n_steps}.")
        self.every_n_steps, self.enabled = every_n_steps, enabled
        self._started = self._window_start = 0.0
        self._window_tokens = 0
        self._printed_step = self._start_step = 0
        self._val: tuple[int, float] | None = None

    def _print(self, trainer: Trainer, line: str) -> None:
        if self.enabled and trainer.is_global_zero:
            print(line, file=sys.stdout, flush=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = self._window_start = time.perf_counter()
        self._window_tokens, self._printed_step = 0, trainer.global_step
        self._start_step = trainer.global_step
        total = total_steps(trainer)
        every = self.every_n_steps or trainer.log_every_n_steps
        self._print(trainer, f"training {total if total is not None else 'unbounded'} steps from step "
                             f"{trainer.global_step}; a line every {every} steps")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if isinstance(batch, torch.Tensor) and batch.dim() >= 2:
            replicas = getattr(trainer.strategy, "data_parallel_size", trainer.world_size)
            self._window_tokens += batch.shape[0] * max(1, batch.shape[-1] - 1) * replicas
        step = trainer.global_step
        if step == self._printed_step or step % (self.every_n_steps or trainer.log_every_n_steps) != 0:
            return
        now = time.perf_counter()
        self._print(trainer, self.line(trainer, now))
        self._printed_step, self._window_start, self._window_tokens = step, now, 0

    def line(self, trainer: Trainer, now: float) -> str:
        """The progress line at ``now`` (``time.perf_counter()``)."""
        step, total = trainer.global_step, total_steps(trainer)
        parts = [f"step {step}/{total}" if total is not None else f"step {step}"]
        loss = _metric(trainer, TRAIN_LOSS)
        parts.append(f"train/loss {loss:.4f}" if loss is not None else "train/loss -")
        window = now - self._window_start
        if self._window_tokens and window > 0:
            parts.append(f"{self._window_tokens / window:,.0f} tokens/s")
        parts.append(f"val/loss {self._val[1]:.4f} (step {self._val[0]})" if self._val else "val/loss -")
        elapsed, done = now - self._started, step - self._start_step
        timing = f"{_clock(elapsed)} elapsed"
        if total is not None and done > 0:
            timing += f", ~{_clock(elapsed / done * (total - step))} left"
        parts.append(timing)
        return " | ".join(parts)

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_async.callbacks.telemetry import initial_validation

        loss = initial_validation(trainer).get(VAL_LOSS)
        if loss is not None:  # the sanity check ran the whole validation set: the loss before training
            self._val = (0, loss)
            self._print(trainer, f"validation at step 0: val/loss {loss:.4f}")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        loss = _metric(trainer, VAL_LOSS)
        if loss is not None:
            self._val = (trainer.global_step, loss)
            self._print(trainer, f"validation at step {trainer.global_step}: val/loss {loss:.4f}")
        self._window_start, self._window_tokens = time.perf_counter(), 0  # validation is not training throughput

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._print(trainer, f"trained {trainer.global_step} steps in {_clock(time.perf_counter() - self._started)}")


def replace_default_bar(trainer: Trainer, progress: StepProgress, configured: list) -> bool:
    """Put ``progress``'s lines in place of the bar Lightning added by default; returns whether it did. A bar among
    the ``configured`` callbacks (the user's own) or none at all (``enable_progress_bar=False``) switches the lines off;
    so does ``progress.enabled = False``, which leaves Lightning's bar as it is."""
    bar = trainer.progress_bar_callback
    if not progress.enabled:
        return False
    if bar is None or any(bar is callback for callback in configured):
        progress.enabled = False
        return False
    trainer.callbacks.remove(bar)
    return True
