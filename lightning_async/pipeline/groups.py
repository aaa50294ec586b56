"""Process groups of a pipeline x data-parallel mesh. Rank ``r`` is stage ``r % pp`` of replica ``r // pp``."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist

from lightning_async.pipeline.runtime import PipelineGroups

# Groups made under the current default process group, by (rank, world size, stages). Every fit, validate or
# test sets the strategy up again; on NCCL each ``new_group`` is a communicator (memory, and a collective
# split across the whole world), so they are made once per default group and reused.
_MADE: dict = {}


def make_pipeline_groups(
    rank: int, world_size: int, pipeline_parallel_size: int, timeout: timedelta | None = None
) -> PipelineGroups:
    """Create every group (all ranks must call this, in the same order) and return this rank's.

    ``timeout`` bounds every wait on these groups (sends, receives, reductions): a stage that stops answering
    without dying (SIGSTOP, a stuck kernel) makes its peers raise ``PeerFailure`` after it. ``None``: torch's
    default (30 minutes), not the default group's timeout.
    """
    if world_size == 1 or not dist.is_initialized():
        return _empty(rank, world_size, pipeline_parallel_size)
    if _MADE.get("world") is not dist.group.WORLD:  # a new default group: the old groups died with it
        _MADE.clear()
        _MADE["world"] = dist.group.WORLD
    key = (rank, world_size, pipeline_parallel_size, timeout)
    if key not in _MADE:
        _MADE[key] = _make(rank, world_size, pipeline_parallel_size, timeout)
    return dataclasses.replace(_MADE[key])


def _empty(rank: int, world_size: int, pp: int) -> PipelineGroups:
    return PipelineGroups(
        stage=rank % pp, num_stages=pp, data_parallel_size=world_size // pp, stage_of_rank=lambda r: r % pp,
        rank=rank, world_size=world_size,
    )


def _make(rank: int, world_size: int, pp: int, timeout: timedelta | None) -> PipelineGroups:
    groups = _empty(rank, world_size, pp)
    dp = world_size // pp

    def new_group(ranks: list[int]):
        return dist.new_group(ranks, timeout=timeout)

    for replica in range(dp):
        ranks = [replica * pp + s for s in range(pp)]
        p2p, pipeline = new_group(ranks), new_group(ranks)
        tied = new_group([ranks[0], ranks[-1]]) if pp > 1 else None
        if rank in ranks:
            groups.p2p, groups.pipeline, groups.tied = p2p, pipeline, tied
    if dp > 1:  # (with one replica there is nothing to average; every rank skips alike)
        for stage in range(pp):
            ranks = [replica * pp + stage for replica in range(dp)]
            group = new_group(ranks)
            if rank in ranks:
                groups.data_parallel = group
    groups.metrics = new_group(list(range(world_size)))
    if groups.stage > 0:
        groups.prev_rank = rank - 1
    if groups.stage < pp - 1:
        groups.next_rank = rank + 1
    return groups
