"""Callbacks: the delay simulation, Error Feedback, run telemetry and the divergence guard."""

from lightning_async.callbacks.delay import DelaySimulation, ErrorFeedback
from lightning_async.callbacks.divergence import Diverged, DivergenceGuard
from lightning_async.callbacks.telemetry import RunTelemetry, run_identity

__all__ = ["DelaySimulation", "Diverged", "DivergenceGuard", "ErrorFeedback", "RunTelemetry", "run_identity"]
