"""Staleness corrections, one family: each is one class, applied by ``delayed_step`` for every delay source
(``DelayedOptimizer``/``DelaySimulation`` on one device, the pipeline runtime under ``async_pipe``).

``build_correction(method, strength, **options)`` makes one by the name recipes use (``docs/delay.md`` has the
formulas and references).
"""

from __future__ import annotations

from lightning_async.optim.corrections.base import FORWARD, GRADIENT, UPDATE, Correction, ParameterBuffers
from lightning_async.optim.corrections.delay_compensation import DelayCompensation
from lightning_async.optim.corrections.error_feedback import (
    AdaptiveErrorFeedback,
    ErrorFeedback,
    NesterovLookahead,
    UpdateCorrection,
)
from lightning_async.optim.corrections.weight_prediction import WeightPrediction

#: method name -> class (the names of ``recipes/corrections/*.yaml`` and of ``correction.method``)
CORRECTIONS: dict[str, type[Correction]] = {
    cls.method: cls for cls in (ErrorFeedback, AdaptiveErrorFeedback, NesterovLookahead, DelayCompensation, WeightPrediction)
}
NO_CORRECTION = "none"


def build_correction(method: str, strength: float | None = None, **options) -> Correction | None:
    """The correction called ``method`` (``None`` for ``"none"``); ``strength`` ``None`` keeps its default.

    Unknown names and options raise ``ValueError`` naming the valid ones.
    """
    if method in (None, NO_CORRECTION):
        return None
    cls = CORRECTIONS.get(method)
    if cls is None:
        raise ValueError(f"Unknown correction {method!r}. Choose one of: {', '.join([NO_CORRECTION, *CORRECTIONS])}.")
    if strength is not None:
        options["strength"] = strength
    try:
        return cls(**options)
    except TypeError as err:
        import inspect

        valid = [n for n in inspect.signature(cls).parameters if n != "self"]
        raise ValueError(f"Correction {method!r}: {err}. Its options are: {', '.join(valid)}.") from None


__all__ = [
    "AdaptiveErrorFeedback", "CORRECTIONS", "Correction", "DelayCompensation", "ErrorFeedback", "FORWARD", "GRADIENT",
    "NO_CORRECTION", "NesterovLookahead", "ParameterBuffers", "UPDATE", "UpdateCorrection", "WeightPrediction",
    "build_correction",
]
