"""``predict`` through the stages: a forward-only run at the newest weights, the last unit's outputs returned.

Each batch is the first unit's input (as Lightning's default ``predict_step`` calls ``self(batch)``), cut into
micro-batches of any size (``tensor_split``); no weight version, gradient or optimizer state is touched. The last
stage concatenates the micro-batches' outputs, applies the module's ``pipeline_predict(outputs)`` when it defines
one (an argmax, the last token's logits: so whole vocabularies need not travel), and sends the result to the first
stage of its pipeline, where it is returned; the other stages return ``None``. Only the ranks of one pipeline take
part, so replicas may predict different numbers of batches (Lightning shards predictions without repeating rows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_async.pipeline.boundary import flatten, rows, signature, split_rows, unflatten


def concat_rows(parts: list):
    """Micro-batch outputs (tensors or pytrees of tensors) joined along dim 0."""
    leaves = [flatten(part, "the last unit's output")[0] for part in parts]
    return unflatten([torch.cat(same) for same in zip(*leaves)], flatten(parts[0])[1])


def _forward_only(runtime, inputs) -> list:
    """Every non-empty micro-batch of ``inputs`` through this rank's chunks; the last piece's outputs (in order)."""
    outputs = []
    shape = None
    for i, x in enumerate(part for part in split_rows(inputs, runtime.n_microbatches, even=False) if rows(part)):
        if signature(x) != shape:  # every rank of the pipeline holds the batch: all agree where a header comes
            runtime.transport.reset()
            shape = signature(x)
        for step in runtime.forward_program([(c, i) for c in runtime.chunk_order]):
            y = runtime.run_forward(step, x, None)
            if y is not None:
                outputs.append(y)
    runtime.transport.reset()
    return outputs


def predict_batch(runtime, batch, predict_fn: Callable | None = None):
    """The predictions of ``batch`` on the first stage of this rank's pipeline (``None`` on the other stages)."""
    runtime.drain()  # (a no-op after fit, which ends drained)
    loss_fn = runtime.loss_fn
    runtime.loss_fn = lambda outputs, targets: outputs  # the last piece returns the last unit's outputs
    try:
        with torch.no_grad():
            outputs = _forward_only(runtime, batch)
    finally:
        runtime.loss_fn = loss_fn
    result = None
    if runtime.is_last:
        result = concat_rows(outputs)
        if predict_fn is not None:
            result = predict_fn(result)
    g = runtime.groups
    if g.pipeline is None or g.num_stages == 1:
        return result
    first = g.mesh.rank_of(0, g.replica)
    gathered = [None] * g.num_stages if g.rank == first else None
    dist.gather_object(result if runtime.is_last else None, gathered, dst=first, group=g.pipeline)
    return next((x for x in gathered if x is not None), None) if gathered is not None else None
