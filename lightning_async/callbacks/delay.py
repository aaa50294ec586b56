"""Callbacks that turn on the delayed update rule (one device) and the Error-Feedback correction (anywhere).

``DelaySimulation(delay=1)`` wraps the module's optimizer in
:class:`~lightning_async.optim.DelayedOptimizer` with the exact 2BW pairing, so a single device follows
the same update rule, step for step, as the multi-process ``async_pipe`` strategy.
``ErrorFeedback(strength=1.0)`` switches the correction on for whichever delay source the run has:
this callback's wrapper, or the pipeline strategy. Both paths call the same
:class:`~lightning_async.optim.ErrorFeedbackCorrection`.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_async.optim.delay import DelayedOptimizer, validate_delay


def _is_pipeline(trainer: Trainer) -> bool:
    from lightning_async.strategies import AsyncPipelineStrategy

    return isinstance(trainer.strategy, AsyncPipelineStrategy)


def _wrap_configured(result, wrap):
    """Apply ``wrap`` to the optimizer(s) in any ``configure_optimizers`` return format; rebind schedulers."""
    from torch.optim import Optimizer

    def fix_schedulers(schedulers, old, new):
        for s in schedulers:
            sched = s["scheduler"] if isinstance(s, dict) else s
            if getattr(sched, "optimizer", None) is old:
                sched.optimizer = new

    if isinstance(result, Optimizer):
        return wrap(result)
    if isinstance(result, dict):
        old = result["optimizer"]
        result["optimizer"] = wrap(old)
        if "lr_scheduler" in result:
            fix_schedulers([result["lr_scheduler"]], old, result["optimizer"])
        return result
    if isinstance(result, (list, tuple)) and len(result) == 2 and isinstance(result[0], (list, tuple)):
        optimizers, schedulers = result
        new = [wrap(o) for o in optimizers]
        for old, fresh in zip(optimizers, new):
            fix_schedulers(schedulers, old, fresh)
        return new, schedulers
    if isinstance(result, (list, tuple)):
        return [_wrap_configured(r, wrap) for r in result]
    raise TypeError(f"DelaySimulation cannot find the optimizer in configure_optimizers()' result {type(result).__name__}.")


class DelaySimulation(Callback):
    """Simulate an asynchronous pipeline's weight staleness on one device.

    Args:
        delay: ``1`` is PipeDream-2BW (every stage one step stale); ``k > 1`` gives the original
            PipeDream's per-stage staleness for ablations; ``0`` is plain synchronous training.
        pairing: ``"2bw"`` (evaluate batch t at ``x(t-k)``; exact pipeline pairing) or ``"fifo"``.
        start_fraction: share of ``trainer.max_steps`` trained synchronously before the delay starts
            (the paper's "sync start" baseline; 0 = delayed from the first step).
    """

    def __init__(self, delay: int = 1, pairing: str = "2bw", start_fraction: float = 0.0) -> None:
        validate_delay(delay, 0.0)
        if not 0.0 <= start_fraction < 1.0:
            raise ValueError(f"start_fraction must be in [0, 1), got {start_fraction}.")
        self.delay, self.pairing, self.start_fraction = delay, pairing, start_fraction
        self._start_step = 0
        self.error_feedback = 0.0
        self.extrapolate_weight_decay = True
        self.optimizers: list[DelayedOptimizer] = []

    @property
    def active(self) -> bool:
        return self.delay > 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.active or stage != "fit":
            return
        if _is_pipeline(trainer):
            raise ValueError(
                "DelaySimulation simulates the pipeline's delay on one device, but strategy is already a pipeline, "
                "which delays for real. Remove the DelaySimulation callback (or set delay: 0)."
            )
        if self.start_fraction:
            if trainer.max_steps is None or trainer.max_steps < 0:
                raise ValueError("DelaySimulation(start_fraction=...) needs trainer.max_steps to place the switch.")
            self._start_step = int(round(self.start_fraction * trainer.max_steps))
        self.optimizers = []
        original = pl_module.configure_optimizers

        def configure_optimizers():
            return _wrap_configured(original(), self._wrap)

        pl_module.configure_optimizers = configure_optimizers

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Undo the wrapping, so a later fit of the same module starts from its own optimizer."""
        if "configure_optimizers" in vars(pl_module):
            del pl_module.configure_optimizers

    def _wrap(self, optimizer) -> DelayedOptimizer:
        wrapped = DelayedOptimizer(
            optimizer,
            self.delay,
            self.error_feedback,
            self.pairing,
            extrapolate_weight_decay=self.extrapolate_weight_decay,
            start_step=self._start_step,
        )
        self.optimizers.append(wrapped)
        return wrapped

    def _show_newest(self) -> list:
        """Point the parameters at the newest weights; return what they showed before."""
        shown = []
        for opt in self.optimizers:
            shown.append([p.data for p in opt.params])
            for p, w in zip(opt.params, opt.newest_weights()):
                p.data = w
        return shown

    def _restore(self, shown: list) -> None:
        for opt, datas in zip(self.optimizers, shown):
            for p, d in zip(opt.params, datas):
                p.data = d

    # Evaluation and checkpoints use the newest weights x(t), not the stale ones the next forward reads.
    def on_validation_start(self, trainer, pl_module) -> None:
        self._shown = self._show_newest() if trainer.state.fn == "fit" else None

    def on_validation_end(self, trainer, pl_module) -> None:
        if getattr(self, "_shown", None) is not None:
            self._restore(self._shown)
            self._shown = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if not self.optimizers:
            return
        shown = self._show_newest()
        newest_state = pl_module.state_dict()
        self._restore(shown)
        checkpoint["state_dict"] = newest_state

    def on_fit_end(self, trainer, pl_module) -> None:
        self._show_newest()  # after fit the module holds the newest weights

    def state_dict(self) -> dict:
        return {"delay": self.delay, "pairing": self.pairing, "start_fraction": self.start_fraction}


class ErrorFeedback(Callback):
    """Correct the delayed update: applied displacement ``u + strength * (u - u_prev)`` (paper: strength 1).

    Works with a ``DelaySimulation`` callback on one device or with ``strategy="async_pipe"``, through
    the same code. ``extrapolate_weight_decay=False`` removes the decoupled decay ``lr * wd * x`` from
    the extrapolated part (the paper's form, the default, extrapolates everything the step changes).
    """

    def __init__(self, strength: float = 1.0, extrapolate_weight_decay: bool = True) -> None:
        if strength < 0:
            raise ValueError(f"ErrorFeedback strength must be >= 0, got {strength}.")
        self.strength, self.extrapolate_weight_decay = float(strength), extrapolate_weight_decay

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.strength or stage != "fit":
            return
        if _is_pipeline(trainer):
            if trainer.strategy.schedule != "2bw":
                raise ValueError(
                    f"ErrorFeedback corrects the one-step delay, but the pipeline schedule {trainer.strategy.schedule!r} "
                    "is synchronous. Use strategy='async_pipe' or remove ErrorFeedback."
                )
            trainer.strategy.error_feedback = self.strength
            trainer.strategy.extrapolate_weight_decay = self.extrapolate_weight_decay
            return
        sources = [cb for cb in trainer.callbacks if isinstance(cb, DelaySimulation) and cb.active]
        if not sources:
            raise ValueError(
                "ErrorFeedback needs a delay source: add DelaySimulation(delay>=1) (recipes/modes/delayed-ef.yaml) "
                "or train with strategy='async_pipe'."
            )
        for source in sources:
            source.error_feedback = self.strength
            source.extrapolate_weight_decay = self.extrapolate_weight_decay
