"""Staleness corrections, one family: each is one class, applied by ``delayed_step`` for every delay source
(``DelayedOptimizer``/``DelaySimulation`` on one device, the pipeline runtime under ``async_pipe``).

``build_correction(method, strength, **options)`` makes one by the name recipes use (``docs/delay.md`` has the
formulas and references).
"""

from __future__ import annotations


from lightning_async.identity import KNOWN_CORRECTIONS, NO_CORRECTION
from lightning_async.optim.corrections.base import FORWARD, GRADIENT, UPDATE, Correction, ParameterBuffers
from lightning_async.optim.corrections.delay_compensation import DelayCompensation
from lightning_async.optim.corrections.error_feedback import (
    AdaptiveErrorFeedback,
    ErrorFeedbackCorrection,
    NesterovLookahead,
    UpdateCorrection,
)
from lightning_async.optim.corrections.weight_prediction import WeightPrediction

#: method name -> class (the names of ``recipes/corrections/*.yaml`` and of ``correction.method``). The names and
#: their default strengths are registered once, framework-free, in :data:`lightning_async.identity.DEFAULT_STRENGTHS`
#: (what run directories record and the tools read); each class takes its default from there.
CORRECTIONS: dict[str, type[Correction]] = {
    cls.method: cls for cls in (ErrorFeedbackCorrection, AdaptiveErrorFeedback, NesterovLookahead, DelayCompensation, WeightPrediction)
}
if tuple(CORRECTIONS) != KNOWN_CORRECTIONS:  # (a class added here must be registered there, in the same order)
    raise ImportError(f"corrections {tuple(CORRECTIONS)} do not match identity.KNOWN_CORRECTIONS {KNOWN_CORRECTIONS}")


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


def as_correction(setting) -> Correction | None:
    """A correction from any of the ways to name one: ``None``, a method name (``"ef"``), ``build_correction``'s
    keyword arguments (``{"method": "ef", "strength": 0.5}``) or a :class:`Correction`."""
    if setting is None or isinstance(setting, Correction):
        return setting
    if isinstance(setting, str):
        return build_correction(setting)
    if isinstance(setting, dict):
        return build_correction(**setting)
    raise ValueError(
        f"A correction is a method name ({', '.join(CORRECTIONS)}), a dict of build_correction arguments or a "
        f"Correction, got {type(setting).__name__}."
    )


def check_applicable(correction: Correction | None, schedule=None, delay_sources: int = 0, name: str | None = None) -> None:
    """Raise ``ValueError``, naming the fix, when ``correction`` cannot apply to the run: the one check every
    entry point calls (the callbacks, the strategy before any rank starts, the pipeline runtime).

    ``schedule``: the pipeline's schedule spec (``None`` off a pipeline); ``delay_sources``: the delay simulations
    of a single-device run; ``name``: what the user set (a callback's name) for the message without a delay source.
    """
    if correction is None or not correction.enabled:
        return
    method = correction.method
    if schedule is not None:
        schedule.require_delay(f"The {method!r} correction")
        if not correction.pipeline_supported:
            raise ValueError(
                f"The {method!r} correction changes the weights the forward reads; the 2BW pipeline keeps two "
                "weight versions per stage and cannot. Study it on one device with DelaySimulation "
                f"(recipes modes/delayed + corrections/{method})."
            )
    elif delay_sources == 0:
        raise ValueError(
            f"{name or f'The {method!r} correction'} needs a delay source: add DelaySimulation(delay>=1) (recipe modes/delayed) "
            "or train with strategy='async_pipe'."
        )


__all__ = [
    "AdaptiveErrorFeedback", "CORRECTIONS", "Correction", "DelayCompensation", "ErrorFeedbackCorrection", "FORWARD", "GRADIENT",
    "NO_CORRECTION", "NesterovLookahead", "ParameterBuffers", "UPDATE", "UpdateCorrection", "WeightPrediction",
    "as_correction", "build_correction", "check_applicable",
]
