"""A mixture of experts' router statistics in TensorBoard, per layer and per pipeline stage.

The module's MoE layers record, in each training forward, their load-balancing loss, z-loss and expert load
(:class:`~lightning_async.models.moe.RouterStatistics`). Every ``log_every_n_steps`` (at the steps Lightning
writes its loggers) :class:`ExpertStatisticsLogger` logs their means since the last log:

* ``experts/layer<i>/aux_loss``, ``experts/layer<i>/z_loss``, ``experts/layer<i>/load`` (the busiest expert's
  tokens over the mean: 1.0 is balanced; ``E / top_k`` means every token went to the same experts);
* ``experts/stage<s>/aux_loss`` (the mean over the stage's MoE layers) and ``experts/stage<s>/max_load``.

Under a pipeline each rank holds only its stage's layers and nothing about them reaches rank 0, so each rank logs
its own: rank 0 through the trainer's loggers, the other stages of replica 0 into event files of their own in the
same run directory (``SummaryWriter``; TensorBoard and ``compare`` read every event file of a directory). On one
device the whole model is stage 0. ``HFCausalLM`` drives it from its own hooks, so an MoE logs these without a
callback (and ``models`` imports nothing from ``callbacks``).
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn


def expert_scalars(means: dict[int, dict[str, float]], stage: int) -> dict[str, float]:
    """TensorBoard tags and values of one stage's per-layer means (``RouterStatistics.read()``)."""
    scalars = {f"experts/layer{layer}/{what}": value for layer, values in means.items() for what, value in values.items()}
    if means:
        scalars[f"experts/stage{stage}/aux_loss"] = sum(v["aux_loss"] for v in means.values()) / len(means)
        scalars[f"experts/stage{stage}/max_load"] = max(v["load"] for v in means.values())
    return scalars


class ExpertStatisticsLogger:
    """Logs the router statistics of a module's MoE layers on every rank that holds some (see the module docstring).

    Called from the module's ``on_train_start``, ``on_train_batch_start`` and ``on_train_batch_end``.
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.stage = 0
        self._writer = None
        self._silent = False  # a data-parallel replica other than 0: reads (so sums do not grow) but does not log
        self._step = 0

    def start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        pipeline = hasattr(strategy, "n_microbatches") and hasattr(strategy, "stage")
        self.stage = strategy.stage if pipeline else 0
        self._silent = (strategy.data_parallel_rank if pipeline else trainer.global_rank) != 0
        statistics = getattr(pl_module, "router_statistics", None)
        if statistics is not None:
            statistics.read()  # start from this fit's first step
        log_dir = trainer.log_dir if trainer.world_size > 1 else None  # (a collective: every rank asks)
        if not pipeline or strategy.pipeline_parallel_size == 1 or not trainer.loggers:
            return
        if not isinstance(trainer.logger, TensorBoardLogger):
            rank_zero_warn("Expert statistics: pipeline stages other than 0 log into TensorBoard event files, but this "
                           "run's logger is not a TensorBoardLogger: only stage 0's layers are logged.")
            return
        if trainer.global_rank == 0 or self._silent:
            return
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir, filename_suffix=f".stage{self.stage}")

    def batch_start(self, trainer: Trainer) -> None:
        self._step = trainer.global_step  # the step Lightning files this batch's metrics under

    def batch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        every = max(1, self.log_every_n_steps or trainer.log_every_n_steps)
        statistics = getattr(pl_module, "router_statistics", None)
        if statistics is None or (self._step + 1) % every:  # the steps Lightning writes its loggers at
            return
        scalars = expert_scalars(statistics.read(), self.stage)
        if self._silent or not scalars:
            return
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, self._step)
        elif trainer.global_rank == 0:
            for tag, value in scalars.items():
                pl_module.log(tag, value)

    def end(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
