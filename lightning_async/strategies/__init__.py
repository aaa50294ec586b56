"""Lightning strategies; importing this registers ``async_pipe``, ``sync_pipe`` and ``gpipe_pipe``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_async.strategies.async_pipe import AsyncPipelineStrategy
from lightning_async.strategies.checkpoints import PipelineAwareCheckpointIO

if "async_pipe" not in StrategyRegistry:
    AsyncPipelineStrategy.register_strategies(StrategyRegistry)

__all__ = ["AsyncPipelineStrategy", "PipelineAwareCheckpointIO"]
