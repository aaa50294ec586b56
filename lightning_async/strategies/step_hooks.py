"""Lightning's step hooks under the pipeline, run where they have a meaning on each rank.

The runtime (:mod:`~lightning_async.pipeline.hooks`) calls these around the rank's own backwards and updates:

* ``on_before_backward(loss)`` before the rank's first backward of a batch: ``loss`` is the first micro-batch's
  loss on the rank holding the last piece; the other ranks have no loss and get a NaN scalar;
* ``on_after_backward()`` after the rank's last backward of a batch, its gradients (summed over the batch's
  micro-batches, before the replica average; a weight tied across stages: this rank's own use of it) on the
  parameters' ``.grad``;
* ``on_before_optimizer_step(optimizer)`` before the stage's update, with the gradients the update applies (averaged
  over replicas, tied weights summed, not yet clipped) on ``.grad``, as Lightning calls it before clipping;
* ``on_before_zero_grad(optimizer)`` after that update, before its gradients are dropped.

Under a delayed schedule a batch's backwards and its update may run during a later training step (2BW: batch ``b``'s
last backward on stage ``s < p - 1`` runs in step ``b + 1``); :attr:`AsyncPipelineStrategy.hook_batch
<lightning_async.strategies.AsyncPipelineStrategy>` says which batch the running hook belongs to. Lightning's
``grad_norm(module, norm_type)`` in ``on_before_optimizer_step`` logs the stage's gradient norms.
"""

from __future__ import annotations

from lightning_async import compat
from lightning_async.pipeline.hooks import StepHooks


class LightningStepHooks(StepHooks):
    """The runtime's hooks as Lightning's, for ``strategy``'s trainer, module and optimizer."""

    active = True

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    def _call(self, batch: int, name: str, *args) -> None:
        strategy = self.strategy
        trainer = strategy.lightning_module.trainer
        strategy.hook_batch = batch
        try:
            compat.call_step_hook(trainer, name, *args)
        finally:
            strategy.hook_batch = None

    def before_backward(self, batch: int, loss) -> None:
        self._call(batch, "on_before_backward", loss)

    def after_backward(self, batch: int) -> None:
        self._call(batch, "on_after_backward")

    def before_optimizer_step(self, batch: int) -> None:
        self._call(batch, "on_before_optimizer_step", self.strategy.optimizers[0])

    def before_zero_grad(self, batch: int) -> None:
        self._call(batch, "on_before_zero_grad", self.strategy.optimizers[0])
