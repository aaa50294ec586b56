"""Process groups of a pipeline x data-parallel mesh. Rank ``r`` is stage ``r % pp`` of replica ``r // pp``."""

from __future__ import annotations

import torch.distributed as dist

from lightning_async.pipeline.runtime import PipelineGroups


def make_pipeline_groups(rank: int, world_size: int, pipeline_parallel_size: int) -> PipelineGroups:
    """Create every group (all ranks must call this, in the same order) and return this rank's."""
    pp = pipeline_parallel_size
    dp = world_size // pp
    groups = PipelineGroups(
        stage=rank % pp, num_stages=pp, data_parallel_size=dp, stage_of_rank=lambda r: r % pp, rank=rank, world_size=world_size
    )
    if world_size == 1 or not dist.is_initialized():
        return groups
    for replica in range(dp):
        ranks = [replica * pp + s for s in range(pp)]
        p2p, pipeline = dist.new_group(ranks), dist.new_group(ranks)
        tied = dist.new_group([ranks[0], ranks[-1]]) if pp > 1 else None
        if rank in ranks:
            groups.p2p, groups.pipeline, groups.tied = p2p, pipeline, tied
    for stage in range(pp):
        ranks = [replica * pp + stage for replica in range(dp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            groups.data_parallel = group
    groups.metrics = dist.new_group(list(range(world_size)))
    if groups.stage > 0:
        groups.prev_rank = rank - 1
    if groups.stage < pp - 1:
        groups.next_rank = rank + 1
    return groups
