"""The pipeline contract: what a module must offer to be split into stages (see docs/models.md).

Duck-typed, so any LightningModule (or ``nn.Module``) qualifies by defining the three methods of
:class:`PipelineModule`; ``pipeline_context``, ``log_loss`` and ``pipeline_predict`` are optional
(:class:`PipelineContextModule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

REQUIRED = ("pipeline_units", "pipeline_split_batch", "pipeline_loss")


@runtime_checkable
class PipelineModule(Protocol):
    """The three methods every pipelined module defines."""

    def pipeline_units(self) -> Sequence[tuple[str, nn.Module]]:
        """Ordered ``(name, module)`` pairs whose composition is the forward pass (names: attribute paths)."""

    def pipeline_split_batch(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)``, both split along dim 0 into micro-batches."""

    def pipeline_loss(self, outputs: Any, targets: Any) -> Any:
        """Scalar mean loss of one micro-batch (runs on the last stage), or ``(loss, {name: value})`` with extra
        scalars or torchmetrics Metrics to log (:mod:`lightning_async.pipeline.metrics`)."""


class PipelineContextModule(PipelineModule, Protocol):
    """Optional extras: side inputs every stage computes itself, how the pipeline's loss is logged, what ``predict``
    returns."""

    def pipeline_context(self, inputs: Any) -> Any:
        """Side inputs (RoPE tables, masks) passed as ``context=`` to the units whose forward takes it."""

    def log_loss(self, split: str, loss: Any, batch: Any) -> None:
        """Log the loss the pipeline computed (otherwise ``<split>/loss`` is logged)."""

    def pipeline_predict(self, outputs: Any) -> Any:
        """``predict``'s result for a batch from the last unit's outputs, on the last stage (e.g. an argmax)."""


def check_pipeline_contract(module: object) -> None:
    """Raise ``TypeError`` naming the missing methods and how to define them."""
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} cannot be split into pipeline stages: it lacks {', '.join(missing)}. "
            "Define pipeline_units() -> [(name, module), ...], pipeline_split_batch(batch) -> (inputs, targets) and "
            "pipeline_loss(outputs, targets) -> loss (see docs/pipeline.md)."
        )
