"""A rank's update pipeline: from the end of a batch's backwards to its new weights.

``begin`` (the batch's last backward on this rank is done): take the gradients from the version that holds them,
average them over the data-parallel replicas, and start the cross-stage reductions (the tied weights' gradient sum,
the global norm for clipping) asynchronously. ``apply``: wait for them, clip by the global norm, and step with
:func:`~lightning_async.optim.delayed_step.delayed_step` (the code the one-device simulation runs) into the slot
the rank's update clock names. Between the two, updates of a delayed schedule are applied as soon as their
reductions have finished (``apply_ready``, between actions), and at the latest before the call that reads the
version they write, so clipping and tied sums never make one stage wait for another in steady state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_async.optim.corrections import GRADIENT, Correction
from lightning_async.optim.delayed_step import delayed_step, scheduled_values
from lightning_async.pipeline.collectives import average_over_replicas, wait_collectives
from lightning_async.pipeline.fsdp import local
from lightning_async.pipeline.hooks import StepHooks
from lightning_async.pipeline.mesh import PipelineGroups
from lightning_async.pipeline.sharding import OptimizerShards
from lightning_async.pipeline.versions import WeightVersions


@dataclass
class _PendingUpdate:
    batch: int
    grads: list[torch.Tensor | None]
    hyperparameters: list[dict]
    works: list = field(default_factory=list)
    norm_sq: torch.Tensor | None = None
    launch: Callable[[], None] | None = None  # cross-stage reductions not started yet (``defer_reductions``)


class UpdatePipeline:
    """The updates of one rank.

    Args:
        optimizer: the rank's optimizer (over ``versions.params``).
        versions: the rank's weight versions (the clock lives there).
        groups: ranks and process groups.
        device: where the norms live.
        clip: global-norm clipping over all stages (``None``: off).
        correction: a staleness correction (delayed schedules).
        tied: indices of weights shared with another rank; ``count_tied_in_norm``: this rank counts them;
            ``wait_tied_sum``: this rank waits for their sum before its norm (the first piece's: the other end
            posted long ago).
        defer_reductions: hold the cross-stage reductions back until the next call (the clock's
            ``defers_reductions``: another rank joins them only then).
        shards: the sharded optimizer's state (``None``: not sharded).
        hooks: what runs before each update (Lightning's ``on_before_optimizer_step`` / ``on_before_zero_grad``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, versions: WeightVersions, groups: PipelineGroups,
                 device: torch.device, clip: float | None = None, correction: Correction | None = None,
                 tied: Sequence[int] = (), count_tied_in_norm: bool = True, wait_tied_sum: bool = False,
                 defer_reductions: bool = False,
                 shards: OptimizerShards | None = None, hooks: StepHooks | None = None) -> None:
        self.optimizer, self.versions, self.groups, self.device = optimizer, versions, groups, device
        self.clip, self.correction = clip or None, correction
        self.tied, self.count_tied_in_norm, self.wait_tied_sum = list(tied), count_tied_in_norm, wait_tied_sum
        self.defer_reductions, self.shards, self.hooks = defer_reductions, shards, hooks or StepHooks()
        self.pending: dict[int, _PendingUpdate] = {}
        self._hyper: dict[int, list[dict]] = {}
        self._grad_norms: dict[int, torch.Tensor] = {}  # batch -> its global gradient norm (before clipping)

    @property
    def params(self) -> list[torch.Tensor]:
        return self.versions.params

    def record_hyperparameters(self, batch: int) -> None:
        """The update of ``batch`` uses the lr, momentum... scheduled when its call starts."""
        self._hyper[batch] = scheduled_values(self.optimizer)

    def held_back(self) -> tuple[int, ...]:
        """Batches whose cross-stage reductions have not started yet."""
        return tuple(b for b, pending in sorted(self.pending.items()) if pending.launch is not None)

    def start_reductions(self, batch: int) -> None:
        pending = self.pending.get(batch)
        if pending is not None and pending.launch is not None:
            pending.launch()

    def begin(self, batch: int) -> None:
        """The last backward of ``batch`` is done: take its gradients and start their reductions."""
        holders = self.versions.gradient_holders(batch)
        grads = [t.grad for t in holders]
        for t in holders:
            t.grad = None
        pending = _PendingUpdate(batch, grads, self._hyper.pop(batch))
        g = self.groups
        present = [x for x in grads if x is not None]
        if g.data_parallel is not None and g.data_parallel_size > 1 and not self.versions.fsdp:  # (FSDP averaged them)
            average_over_replicas(present, g)

        def launch() -> None:
            pending.launch = None
            if g.tied is not None and self.tied:
                pending.works += [dist.all_reduce(local(grads[i]), group=g.tied, async_op=True) for i in self.tied if grads[i] is not None]
                if self.wait_tied_sum:
                    wait_collectives(pending.works, "the tied-weight gradient sum", g, "tied")
            if self.clip:
                skip = set() if self.count_tied_in_norm else set(self.tied)
                sq = sum((local(x).float().pow(2).sum() for i, x in enumerate(grads) if x is not None and i not in skip),
                         torch.zeros((), device=self.device))
                if self.versions.fsdp:  # each replica holds a shard of every gradient: sum the stage's shards first
                    wait_collectives([dist.all_reduce(sq, group=g.data_parallel, async_op=True)], "the gradient norm", g, "data_parallel")
                pending.norm_sq = sq
                if g.pipeline is not None:
                    pending.works.append(dist.all_reduce(sq, group=g.pipeline, async_op=True))

        self.pending[batch] = pending
        if self.defer_reductions:
            # Under 2BW the last stage finishes batch b inside call b, but the first stage joins these reductions
            # only in call b+1. Started now, an NCCL reduction would sit on this GPU across the step boundary, and
            # any device-wide sync there (torch.cuda.synchronize, empty_cache, an allocator retry) would wait for
            # this rank's own next call: a deadlock. So they start with the next call (or the drain).
            pending.launch = launch
        else:
            launch()

    def apply_ready(self) -> None:
        """Apply pending updates whose reductions have finished (frees their gradient buffers early)."""
        for batch in list(self.pending):
            pending = self.pending[batch]
            if pending.launch is not None or not all(work.is_completed() for work in pending.works):
                return  # updates are applied in batch order
            self.apply(batch)

    def apply_if_pending(self, batch: int) -> None:
        if batch in self.pending:
            self.apply(batch)

    def apply(self, batch: int) -> None:
        """Wait for ``batch``'s reductions, clip, and step into the slot the clock names."""
        pending = self.pending.pop(batch)  # (sharded: reads and writes only this replica's parameters, all local)
        if pending.launch is not None:
            pending.launch()
        wait_collectives(pending.works, f"the gradient reductions of batch {batch}", self.groups, "pipeline")
        with self.hooks.gradients_shown(self.params, pending.grads):
            self.hooks.before_optimizer_step(batch)
        if self.clip and pending.norm_sq is not None:
            norm = pending.norm_sq.sqrt()
            self._grad_norms[batch] = norm  # global norm before clipping, for logging
            coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            for x in pending.grads:
                if x is not None:
                    local(x).mul_(coef.to(x.dtype))
        versions = self.versions
        if versions.sharded_copies and self.correction is not None and self.correction.level == GRADIENT:
            versions.hold_read_by(batch)  # the gradient's own weights V(b), which such a correction reads
        delayed_step(
            self.optimizer, self.params, pending.grads,
            newest=versions.newest(), out=versions.update_target(batch), correction=self.correction,
            hyperparameters=pending.hyperparameters, updated=None if self.shards is None else self.shards.owned,
        )
        versions.landed(batch)
        if self.shards is not None:
            self.shards.start(batch, versions.written_by(batch))  # waited for before the call that reads the slot
        with self.hooks.gradients_shown(self.params, pending.grads):
            self.hooks.before_zero_grad(batch)

    def finish_weight_transfers(self, through: int | None = None) -> None:
        """Sharded optimizer: the other replicas' new weights from the updates of batches ``<= through`` (all:
        ``None``) are in the slots (a no-op otherwise). See :meth:`OptimizerShards.finish` for where it may wait."""
        if self.shards is not None and self.shards.in_flight:
            self.shards.finish(lambda works, what: wait_collectives(works, what, self.groups, "data_parallel"), through)

    def settled_grad_norm(self, calls_done: int) -> torch.Tensor | None:
        """The global gradient norm (before clipping, with clipping on) of the newest batch whose update has landed
        on every rank whatever the timing (the clock's ``settled_update``)."""
        settled = self.versions.clock.settled_update(calls_done)
        for done in [k for k in self._grad_norms if k < settled]:
            del self._grad_norms[done]
        return self._grad_norms.get(settled)
