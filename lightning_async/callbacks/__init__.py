"""Callbacks: the delay simulation, the staleness corrections, run telemetry, progress lines and the divergence guard."""

from lightning_async.callbacks.delay import DelayCorrection, DelaySimulation, ErrorFeedback
from lightning_async.callbacks.divergence import Diverged, DivergenceGuard
from lightning_async.callbacks.progress import StepProgress
from lightning_async.callbacks.telemetry import RunTelemetry, run_identity

__all__ = ["DelayCorrection", "DelaySimulation", "Diverged", "DivergenceGuard", "ErrorFeedback", "RunTelemetry", "StepProgress",
           "run_identity"]
