"""Update rules: the optimizer zoo, the delayed step and the Error-Feedback correction (plain torch)."""

from lightning_async.optim.delay import DelayedOptimizer, OptimizerWrapper, validate_delay
from lightning_async.optim.delayed_step import delayed_step
from lightning_async.optim.error_feedback import ErrorFeedbackCorrection
from lightning_async.optim.zoo import OPTIMIZER_NAMES, build_optimizer

__all__ = [
    "DelayedOptimizer",
    "ErrorFeedbackCorrection",
    "OPTIMIZER_NAMES",
    "OptimizerWrapper",
    "build_optimizer",
    "delayed_step",
    "validate_delay",
]
