"""A rank's training losses: the last piece's micro-batch losses, reduced to every rank asynchronously."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_async.pipeline.collectives import wait_collectives
from lightning_async.pipeline.mesh import PipelineGroups


class LossReduction:
    """Each batch's mean training loss, sent from the last stage to every rank (asynchronously) and averaged over
    the replicas; a rank without the last piece joins each batch's reduction with nothing."""

    def __init__(self, groups: PipelineGroups, device: torch.device, n_microbatches: int) -> None:
        self.groups, self.device, self.n_microbatches = groups, device, n_microbatches
        self._losses: list[torch.Tensor] = []
        self._works: dict[int, tuple[object, torch.Tensor]] = {}
        self.reported: dict[int, torch.Tensor] = {}  # batch -> mean loss (after the metrics reduce)

    def record(self, batch: int, loss: torch.Tensor) -> None:
        """One micro-batch's loss on the last piece; the batch's reduction starts with its last one."""
        self._losses.append(loss.detach().float())
        if len(self._losses) == self.n_microbatches:
            self.reduce(batch, torch.stack(self._losses).mean())
            self._losses = []

    def reduce(self, batch: int, value: torch.Tensor | None) -> None:
        """Start sending batch ``batch``'s mean loss from the last stage to every rank (``None``: not the last)."""
        g = self.groups
        if g.metrics is None:
            self.reported[batch] = value
            return
        buf = torch.zeros((), device=self.device) if value is None else value.clone()
        self._works[batch] = (dist.all_reduce(buf, group=g.metrics, async_op=True), buf)

    def collect(self, batch: int, wait: bool = True) -> torch.Tensor | None:
        """Mean training loss of ``batch`` on every rank (``None`` if not reduced yet and ``wait=False``)."""
        if batch in self._works:
            work, buf = self._works[batch]
            if not wait and not work.is_completed():
                return None
            wait_collectives([work], f"the loss of batch {batch}", self.groups, "metrics")
            del self._works[batch]
            self.reported[batch] = buf / self.groups.data_parallel_size
        return self.reported.pop(batch, None)
