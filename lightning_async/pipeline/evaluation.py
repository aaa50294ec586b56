"""Evaluation through the stages: a forward-only run at the newest weights, the loss on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_async.pipeline.boundary import rows, signature, split_rows
from lightning_async.pipeline.collectives import wait_collectives


def evaluate_batch(runtime, batch_data) -> torch.Tensor:
    """The mean loss over the rows of every replica's ``batch_data``, on every rank (the pipeline drained first).

    Evaluation batches may have any size: micro-batches are cut with ``tensor_split`` (sizes may differ; a header
    announces each new size, one per run of equal sizes) and the loss is weighted by micro-batch size.
    """
    runtime.drain()
    inputs, targets = runtime.split_batch(batch_data)
    rows(inputs), rows(targets)  # every leaf has the batch dimension first
    pieces = zip(split_rows(inputs, runtime.n_microbatches, even=False), split_rows(targets, runtime.n_microbatches, even=False))
    runs: list[list[tuple[int, object, object]]] = []  # micro-batches of one shape, in order
    for i, (x, target) in enumerate((x, y) for x, y in pieces if rows(x)):
        if not runs or signature(x) != signature(runs[-1][0][1]):
            runs.append([])
        runs[-1].append((i, x, target))
    device = runtime.device
    total, count = torch.zeros((), device=device), 0
    with torch.no_grad():
        for run in runs:  # every rank holds the batch, so all agree where a new shape (and header) comes
            runtime.transport.reset()
            items = {i: (x, target) for i, x, target in run}
            for step in runtime.forward_program([(c, i) for c in runtime.chunk_order for i in items]):
                y = runtime.run_forward(step, *items[step.microbatch])
                if y is not None:
                    total += y.float() * rows(items[step.microbatch][1])
                    count += rows(items[step.microbatch][1])
    runtime.transport.reset()
    # (sum of row losses, rows) over every replica's last stage: the mean over all rows evaluated, exact even when
    # the replicas' batches differ in size
    stats = torch.stack([total, torch.tensor(float(count), device=device)]) if runtime.is_last else torch.zeros(2, device=device)
    groups = runtime.groups
    if groups.metrics is not None:
        wait_collectives([dist.all_reduce(stats, group=groups.metrics, async_op=True)], "the evaluation loss", groups, "metrics")
    return stats[0] / stats[1]
