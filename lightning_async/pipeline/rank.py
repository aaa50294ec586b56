"""One entry that builds a pipeline rank: its stage (one or more chunks), its process groups and its runtime.

The strategy, the test harness and every benchmark call :func:`build_rank`, so they cannot drift apart (the
harness once skipped the initial weight synchronisation the strategy does).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch import nn

from lightning_async.pipeline import schedules
from lightning_async.pipeline.groups import make_pipeline_groups, synchronize_initial_weights
from lightning_async.pipeline.mesh import PipelineGroups
from lightning_async.pipeline.runtime import PipelineRuntime
from lightning_async.pipeline.stage import RankStage, build_rank_stage


@dataclass
class Rank:
    """What :func:`build_rank` made for one process."""

    stage: RankStage
    groups: PipelineGroups
    runtime: PipelineRuntime


def build_rank(
    units: Sequence[tuple[str, nn.Module]],
    schedule: "str | schedules.ScheduleSpec",
    n_microbatches: int,
    split_batch: Callable,
    loss_fn: Callable,
    make_optimizer: Callable[[RankStage], object],
    rank: int = 0,
    world_size: int = 1,
    pipeline_parallel_size: int | None = None,
    stage_units: Sequence[Sequence[str]] | None = None,
    partition: str | Sequence[str] = "uniform",
    tied: Sequence[str] | None = None,
    timeout: timedelta | None = None,
    **runtime_options,
) -> Rank:
    """Build rank ``rank`` of a ``world_size``-process pipeline (``pipeline_parallel_size`` stages per replica).

    Every rank must call it, in the same order (it makes the process groups and synchronises the initial
    weights: tied copies equal stage 0's, replicas equal replica 0's). ``stage_units`` (the units of every piece,
    in model order) or ``partition`` decide the split. ``make_optimizer(stage)`` returns the rank's optimizer; it
    is called after the stage is built and before the weights are synchronised, so it may also move or prune the
    module (the strategy does). ``tied`` overrides the tied weights the split finds (a module whose other stages
    are placeholders already). ``runtime_options`` go to :class:`PipelineRuntime` (clipping, correction,
    autocast, device, context, activation checkpointing).
    """
    spec = schedules.spec(schedule)
    groups = make_pipeline_groups(rank, world_size, pipeline_parallel_size or world_size, timeout=timeout)
    stage = build_rank_stage(units, groups.stage, stage_units, num_stages=groups.num_stages, partition=partition, schedule=spec)
    if tied is not None:
        stage.tied = list(tied)
    optimizer = make_optimizer(stage)
    synchronize_initial_weights(groups, stage.module, stage.tied)
    runtime = PipelineRuntime(
        stage.module, optimizer, spec, n_microbatches, split_batch, loss_fn, groups,
        tied_parameters=stage.tied, count_tied_in_norm=groups.stage == 0, **runtime_options,
    )
    return Rank(stage, groups, runtime)
