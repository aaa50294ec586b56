"""The extra values of ``pipeline_loss``: ``(loss, {name: value})`` on the last stage, reduced as the loss is.

``pipeline_loss`` may return the loss alone or ``(loss, extras)`` (Megatron's loss-function convention), where
``extras`` maps names to

* a scalar (tensor or number): averaged exactly as the loss is. Training: the mean over the batch's
  micro-batches, then over the data-parallel replicas. Evaluation: weighted by rows, over micro-batches and
  replicas (so an evaluation epoch's mean is the mean over every row evaluated);
* a torchmetrics ``Metric`` the module updated in ``pipeline_loss`` (once per micro-batch): computed once per
  epoch over every replica's last stage (its states gathered over the last stages' data-parallel group, unless it
  was built with ``sync_on_compute=False``: then replica 0's), then reset.

Only the last stage runs ``pipeline_loss``, so every rank learns the names once (an object gather over the metrics
group at the end of the first training call, and at the first batch of each evaluation epoch: points where no
stage waits for another's next call) and then joins the reductions, so every rank reports the same values.
Training values travel in their own asynchronous all-reduce, posted after the loss's: under 2BW batch ``b``'s
values are collected a step later, with its loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torchmetrics import Metric

from lightning_async.pipeline.boundary import rows
from lightning_async.pipeline.p2p import PeerFailure
from lightning_async.pipeline.collectives import wait_collectives

TRAIN = "train"


def split_loss_result(result) -> tuple[torch.Tensor, dict]:
    """``pipeline_loss``'s result as ``(loss, extras)``; a clear error for anything else."""
    if isinstance(result, torch.Tensor):
        return result, {}
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.Tensor) and isinstance(result[1], dict):
        loss, extras = result
        for name, value in extras.items():
            scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not isinstance(name, str) or not (scalar or isinstance(value, Metric) or (isinstance(value, torch.Tensor) and value.numel() == 1)):
                raise TypeError(
                    f"pipeline_loss returned the extra value {name!r}: {type(value).__name__}"
                    f"{list(value.shape) if isinstance(value, torch.Tensor) else ''}. Extra values are named (str) scalars: "
                    "a one-element tensor, a number or a torchmetrics Metric."
                )
        return loss, extras
    raise TypeError(
        f"pipeline_loss returned {type(result).__name__}; return the mean loss of the micro-batch (a tensor), or "
        "(loss, {name: value}) with extra scalars or torchmetrics Metrics to log."
    )


def _compute_over_replicas(metric: Metric, group, replicas: int) -> torch.Tensor:
    """``metric.compute()`` with its states gathered over ``group`` (the last stages of every replica)."""
    saved = metric.process_group, metric.distributed_available_fn
    metric.process_group, metric.distributed_available_fn = group, (lambda: replicas > 1)
    try:
        value = metric.compute()
    finally:
        metric.process_group, metric.distributed_available_fn = saved
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise TypeError(f"A Metric returned by pipeline_loss must compute a scalar; {type(metric).__name__} computed {value!r}.")
    return value.detach().float().reshape(())


class LossExtras:
    """Wraps ``pipeline_loss`` for the runtime (it returns the loss only) and reduces its extra values.

    Call :meth:`attach` with the rank's runtime once it is built; then on every rank :meth:`end_training_call`
    after each training call and :meth:`training_values` when its loss is reported, :meth:`end_eval_batch` after
    each evaluation batch, :meth:`begin_epoch` / :meth:`compute_epoch` around each epoch.
    """

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn
        self.groups = None
        self.is_last, self.device = True, torch.device("cpu")
        self._micro: list[tuple[dict, int]] = []  # (extras, rows) of each micro-batch since the last take
        self._names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}  # split -> (scalar names, Metric names)
        self._metrics: dict[str, dict[str, Metric]] = {}  # split -> name -> the Metric pipeline_loss returned
        self._train: dict[int, tuple[object, torch.Tensor]] = {}  # batch -> (work, summed values)

    def attach(self, runtime) -> None:
        self.groups, self.is_last, self.device = runtime.groups, runtime.is_last, runtime.device

    def __call__(self, outputs, targets) -> torch.Tensor:
        loss, extras = split_loss_result(self.loss_fn(outputs, targets))
        self._micro.append((extras, rows(targets)))
        return loss

    # ---- names ----------------------------------------------------------------------------------
    def _take(self, split: str) -> dict[str, list[tuple[torch.Tensor, int]]]:
        """The scalar values recorded since the last take, by name; the Metrics are remembered for the epoch."""
        micro, self._micro = self._micro, []
        scalars: dict[str, list[tuple[torch.Tensor, int]]] = {}
        for extras, n in micro:
            if set(extras) != set(micro[0][0]):
                raise ValueError(
                    f"pipeline_loss returned the extra values {sorted(micro[0][0])} for one micro-batch and "
                    f"{sorted(extras)} for another; return the same names every time."
                )
            for name, value in extras.items():
                if isinstance(value, Metric):
                    self._metrics.setdefault(split, {})[name] = value
                else:
                    scalars.setdefault(name, []).append((torch.as_tensor(value, device=self.device).detach().float().reshape(()), n))
        return scalars

    def _agree(self, split: str, scalars: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names of ``split`` on every rank: the last stage's, gathered once (a collective of every rank)."""
        if split not in self._names:
            local = (tuple(sorted(scalars)), tuple(sorted(self._metrics.get(split, {})))) if self.is_last else None
            found = [local]
            if self.groups is not None and self.groups.metrics is not None:
                found = [None] * self.groups.world_size
                try:
                    dist.all_gather_object(found, local, group=self.groups.metrics)
                except RuntimeError as err:  # a dead or silent peer: named like every other wait of the pipeline
                    raise PeerFailure(
                        f"One of global ranks {self.groups.members('metrics')} stopped answering while this rank waited "
                        f"for the names of the {split} values pipeline_loss returns: {err}. Look at the other ranks' logs "
                        "for the original error."
                    ) from err
            self._names[split] = next((names for names in found if names is not None), ((), ()))
        names = self._names[split]
        if self.is_last and tuple(sorted(scalars)) != names[0]:
            raise ValueError(
                f"pipeline_loss returned the extra values {sorted(scalars)} in {split}, but {list(names[0])} before; "
                "return the same names every time."
            )
        return names

    def _all_reduce(self, values: torch.Tensor, what: str, wait: bool):
        g = self.groups
        if g is None or g.metrics is None:
            return None
        work = dist.all_reduce(values, group=g.metrics, async_op=True)
        if wait:
            wait_collectives([work], what, g, "metrics")
        return work

    # ---- training -------------------------------------------------------------------------------
    def end_training_call(self, batch: int) -> None:
        """After training call ``batch`` on every rank: start reducing its scalar values (asynchronously)."""
        scalars = self._take(TRAIN)
        names = self._agree(TRAIN, scalars)[0]
        if not names:
            return
        values = torch.zeros(len(names), device=self.device)
        if self.is_last:
            values = torch.stack([torch.stack([v for v, _ in scalars[name]]).mean() for name in names])
        self._train[batch] = (self._all_reduce(values, f"the extra values of batch {batch}", wait=False), values)

    def training_values(self, batch: int) -> dict[str, torch.Tensor]:
        """Batch ``batch``'s scalar values, averaged over micro-batches and replicas, on every rank."""
        if batch not in self._train:
            return {}
        work, values = self._train.pop(batch)
        if work is not None:
            wait_collectives([work], f"the extra values of batch {batch}", self.groups, "metrics")
        replicas = self.groups.data_parallel_size if self.groups is not None else 1
        return dict(zip(self._names[TRAIN][0], values / replicas))

    # ---- evaluation -----------------------------------------------------------------------------
    def end_eval_batch(self, split: str) -> tuple[dict[str, torch.Tensor], int]:
        """After an evaluation batch on every rank: its scalar values, row-weighted over micro-batches and replicas,
        and the rows they cover (a collective)."""
        scalars = self._take(split)
        names = self._agree(split, scalars)[0]
        if not names:
            return {}, 0
        sums = torch.zeros(len(names) + 1, device=self.device)
        if self.is_last:
            sums = torch.stack([*(sum(v * n for v, n in scalars[name]) for name in names),
                                torch.tensor(float(sum(n for _, n in scalars[names[0]])), device=self.device)])
        self._all_reduce(sums, f"the extra values of a {split} batch", wait=True)
        return dict(zip(names, sums[:-1] / sums[-1])), int(sums[-1])

    # ---- epochs ---------------------------------------------------------------------------------
    def begin_epoch(self, split: str) -> None:
        """An evaluation epoch starts: its names are agreed again at its first batch."""
        if split != TRAIN:
            self._names.pop(split, None)

    def compute_epoch(self, split: str) -> dict[str, torch.Tensor]:
        """The Metrics of ``split`` computed over the epoch on every rank (a collective), then reset."""
        names = self._names.get(split, ((), ()))[1]
        if not names:
            return {}
        g = self.groups
        values = torch.zeros(len(names), device=self.device)
        if self.is_last:
            metrics = self._metrics.get(split, {})
            replicas = g.data_parallel_size if g is not None else 1
            computed = [_compute_over_replicas(metrics[name], g.data_parallel if g is not None else None, replicas) for name in names]
            for metric in metrics.values():
                metric.reset()
            if g is None or g.replica == 0:
                values = torch.stack(computed).to(self.device)
        self._all_reduce(values, f"the {split} metrics of the epoch", wait=True)
        return dict(zip(names, values))
