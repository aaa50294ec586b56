"""Callbacks: the delay simulation, the staleness corrections, run telemetry, progress lines, the divergence guard and
the update-correlation measurement."""

from lightning_async.callbacks.delay import DelayCorrection, DelaySimulation, ErrorFeedback
from lightning_async.callbacks.divergence import Diverged, DivergenceGuard
from lightning_async.callbacks.progress import StepProgress
from lightning_async.callbacks.telemetry import RunTelemetry, run_identity
from lightning_async.callbacks.update_correlation import UpdateCorrelation

__all__ = ["DelayCorrection", "DelaySimulation", "Diverged", "DivergenceGuard", "ErrorFeedback", "RunTelemetry", "StepProgress",
           "UpdateCorrelation", "run_identity"]
