"""Update rules: the optimizer zoo, the delayed step and the staleness corrections (plain torch)."""

from lightning_async.optim.corrections import (
    CORRECTIONS,
    AdaptiveErrorFeedback,
    Correction,
    DelayCompensation,
    ErrorFeedbackCorrection,
    NesterovLookahead,
    WeightPrediction,
    build_correction,
)
from lightning_async.optim.delay import DelayedOptimizer, OptimizerWrapper, validate_delay
from lightning_async.optim.delayed_step import delayed_step
from lightning_async.optim.zoo import OPTIMIZER_NAMES, build_optimizer, check_optimizer_settings

__all__ = [
    "AdaptiveErrorFeedback",
    "CORRECTIONS",
    "Correction",
    "DelayCompensation",
    "DelayedOptimizer",
    "ErrorFeedbackCorrection",
    "NesterovLookahead",
    "WeightPrediction",
    "build_correction",
    "OPTIMIZER_NAMES",
    "OptimizerWrapper",
    "build_optimizer",
    "check_optimizer_settings",
    "delayed_step",
    "validate_delay",
]
