"""lightning-async: asynchronous (PipeDream-2BW) pipeline-parallel pretraining for PyTorch Lightning.

Importing the package registers the strategies ``"async_pipe"``, ``"sync_pipe"`` and ``"gpipe_pipe"``.
"""

__version__ = "0.1.0"

from lightning_async.optim import DelayedOptimizer, ErrorFeedbackCorrection, build_optimizer  # noqa: E402
from lightning_async.strategies import AsyncPipelineStrategy  # noqa: E402  (registers the strategies)

__all__ = ["AsyncPipelineStrategy", "DelayedOptimizer", "ErrorFeedbackCorrection", "__version__", "build_optimizer"]
