"""Lightning strategies; importing this registers the names of ``pipeline.schedules.STRATEGY_NAMES``."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_async.strategies.async_pipe import AsyncPipelineStrategy, PipelineStrategy
from lightning_async.strategies.checkpoints import PipelineAwareCheckpointIO

if "async_pipe" not in StrategyRegistry:
    AsyncPipelineStrategy.register_strategies(StrategyRegistry)

__all__ = ["AsyncPipelineStrategy", "PipelineAwareCheckpointIO", "PipelineStrategy"]  # (PipelineStrategy: the same class)
