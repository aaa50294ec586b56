"""Callbacks: the delay simulation, Error Feedback and run telemetry."""

from lightning_async.callbacks.delay import DelaySimulation, ErrorFeedback
from lightning_async.callbacks.telemetry import RunTelemetry, run_identity

__all__ = ["DelaySimulation", "ErrorFeedback", "RunTelemetry", "run_identity"]
