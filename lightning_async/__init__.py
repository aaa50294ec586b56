"""lightning-async: asynchronous (PipeDream-2BW) pipeline-parallel pretraining for PyTorch Lightning.

Importing the package registers the strategies of ``pipeline.schedules.STRATEGY_NAMES``: ``"async_pipe"`` (2BW),
``"sync_pipe"`` (1F1B), ``"gpipe_pipe"`` (GPipe) and ``"zb_pipe"`` (ZB-V).
"""

__version__ = "0.2.0"

import importlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

_EXPORTS = {"AsyncPipelineStrategy": "lightning_async.strategies", "PipelineStrategy": "lightning_async.strategies",
            "DelayedOptimizer": "lightning_async.optim",
            "ErrorFeedbackCorrection": "lightning_async.optim", "build_optimizer": "lightning_async.optim"}


def _console_help_only() -> bool:
    """The ``lightning-async`` console script was started for its top-level help, which needs no torch (it stays fast)."""
    name = os.path.splitext(os.path.basename(sys.argv[0] if sys.argv else ""))[0]
    return name == "lightning-async" and sys.argv[1:2] in ([], ["-h"], ["--help"])


def __getattr__(name: str):
    """The exports, imported on first use when the package was imported for the console script's help."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not _console_help_only():
    from lightning_async.optim import DelayedOptimizer, ErrorFeedbackCorrection, build_optimizer  # noqa: F401
    from lightning_async.strategies import AsyncPipelineStrategy, PipelineStrategy  # noqa: F401  (registers the strategies)

__all__ = ["AsyncPipelineStrategy", "DelayedOptimizer", "ErrorFeedbackCorrection", "PipelineStrategy", "__version__",
           "build_optimizer"]
