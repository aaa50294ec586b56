"""``UpdateCorrelation``: how consecutive optimizer updates relate, measured in a training run.

Error Feedback applies ``u_t + lam (u_t - u_(t-1))``: it bets that the next update differs from this one as this one
differed from the last. :class:`UpdateSeries` keeps the statistics of a sequence of full updates ``u_t`` (every
parameter, flattened), averaged over the steps it is given:

* ``diff_correlation``: corr(d_t, d_(t-1)) of consecutive differences ``d_t = u_t - u_(t-1)``. Near +1 the
  differences trend (EF's extrapolation is right); 0 is unpredictable; -0.5 is what independent noise gives.
* ``lambda_star``: the least-squares extrapolation coefficient ``<d_t, d_(t-1)> / |d_(t-1)|^2``.
* ``diff_size``: ``|d_t| / |u_t|``, the size of EF's added term relative to the update.
* ``cosine``: cos(u_t, u_(t-1)), the alignment of consecutive updates.

The callback records ``u_t`` as the change the module's optimizer makes in its own ``step()`` (step hooks on the
innermost optimizer, under any wrapper of :mod:`lightning_async.optim`): the optimizer's full update, weight decay
included, before any staleness correction; under the delay simulation, the update computed from the stale gradient.
It averages over the last ``1 - start_fraction`` of the run and logs the means as ``update/<statistic>`` at the end
of fit (and ``update/steps``, how many steps they average). It holds three fp64 copies of the parameters; it measures
one device's optimizer, so a pipeline strategy is refused.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_async.optim.delay import OptimizerWrapper

STATISTICS = ("diff_correlation", "lambda_star", "diff_size", "cosine")


class UpdateSeries:
    """Running means of :data:`STATISTICS` over a sequence of flattened updates (three updates give the first)."""

    def __init__(self) -> None:
        self.previous: list[torch.Tensor] = []  # u_(t-2), u_(t-1)
        self.sums = dict.fromkeys(STATISTICS, 0.0)
        self.count = 0

    def add(self, update: torch.Tensor) -> None:
        """Record ``u_t`` (a flat fp64 tensor); the statistics need ``u_(t-1)`` and ``u_(t-2)``."""
        if len(self.previous) == 2:
            older, last = self.previous
            d, d1 = update - last, last - older
            d_norm, d1_norm, u_norm = float(d.norm()), float(d1.norm()), float(update.norm())
            dot = float(d @ d1)
            values = {
                "diff_correlation": dot / (d_norm * d1_norm),
                "lambda_star": dot / (d1_norm * d1_norm),
                "diff_size": d_norm / u_norm,
                "cosine": float(update @ last) / (u_norm * float(last.norm())),
            }
            if all(math.isfinite(v) for v in values.values()):  # (a zero update, e.g. a skipped step, is left out)
                for key, value in values.items():
                    self.sums[key] += value
                self.count += 1
            self.previous = [last, update]
        else:
            self.previous.append(update)

    def means(self) -> dict[str, float]:
        """The mean of each statistic (NaN before any step was measured)."""
        return {key: (total / self.count if self.count else math.nan) for key, total in self.sums.items()}


def innermost_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer under every wrapper of :mod:`lightning_async.optim` (the one that computes the update)."""
    while isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.optimizer
    return optimizer


class RecordedUpdates:
    """Step hooks on ``optimizer`` that pass each step's full update (the parameters' change, flat fp64) to ``sink``."""

    def __init__(self, optimizer: torch.optim.Optimizer, sink) -> None:
        self.sink = sink
        self.before: list[torch.Tensor] = []
        self.handles = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    @staticmethod
    def _params(optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _before(self, optimizer, *_) -> None:
        self.before = [p.detach().clone() for p in self._params(optimizer)]

    def _after(self, optimizer, *_) -> None:
        change = [(b - p.detach()).reshape(-1).double() for b, p in zip(self.before, self._params(optimizer))]
        self.before = []
        self.sink(torch.cat(change))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class UpdateCorrelation(Callback):
    """Measure how consecutive updates of the module's optimizer relate (what Error Feedback extrapolates).

    Args:
        start_fraction: the share of ``max_steps`` to skip before averaging (0.5: the second half of the run).
    """

    def __init__(self, start_fraction: float = 0.5) -> None:
        if not 0.0 <= start_fraction < 1.0:
            raise ValueError(f"UpdateCorrelation(start_fraction={start_fraction}): give a fraction in [0, 1).")
        self.start_fraction = start_fraction
        self.series = UpdateSeries()
        self._recorder: RecordedUpdates | None = None
        self._start_step = 0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if getattr(trainer.strategy, "schedule_spec", None) is not None:
            raise ValueError("UpdateCorrelation measures one device's optimizer; a pipeline strategy updates each stage "
                             "on its own rank. Measure on one device with the delay simulation (--delay.delay 1).")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"UpdateCorrelation measures one optimizer; this module has {len(trainer.optimizers)}.")
        if trainer.max_steps is None or trainer.max_steps < 0:
            raise ValueError("UpdateCorrelation needs trainer.max_steps (it averages over the run's last part).")
        self._start_step = int(self.start_fraction * trainer.max_steps)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # (after the delay simulation wrapped the optimizer in its setup)
        self._recorder = RecordedUpdates(innermost_optimizer(trainer.optimizers[0]), self._record)
        self._trainer = trainer

    def _record(self, update: torch.Tensor) -> None:
        if self._trainer.global_step >= self._start_step:
            self.series.add(update)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        metrics = {f"update/{key}": value for key, value in self.series.means().items()}
        metrics["update/steps"] = float(self.series.count)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
