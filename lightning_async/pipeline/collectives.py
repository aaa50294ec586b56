"""Waiting on collectives with a dead peer named, and the data-parallel gradient average."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_async.pipeline.mesh import PipelineGroups
from lightning_async.pipeline.p2p import PeerFailure


def average_over_replicas(grads: list[torch.Tensor], groups: PipelineGroups) -> None:
    """Average ``grads`` in place over the data-parallel replicas: one reduction per dtype, not per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for x in grads:
        by_dtype.setdefault(x.dtype, []).append(x)
    flats, works = [], []
    for same in by_dtype.values():
        flat = torch.cat([x.reshape(-1) for x in same]).div_(groups.data_parallel_size)
        flats.append((flat, same))
        works.append(dist.all_reduce(flat, group=groups.data_parallel, async_op=True))
    wait_collectives(works, "the data-parallel gradient average", groups, "data_parallel")  # replicas run in lockstep
    for flat, same in flats:
        for x, part in zip(same, flat.split([x.numel() for x in same])):
            x.copy_(part.view_as(x))


def wait_collectives(works, what: str, groups: PipelineGroups | None = None, kind: str = "metrics") -> None:
    """Wait for collective operations; a dead peer becomes a :class:`PeerFailure` naming the suspects."""
    try:
        for work in works:
            work.wait()
    except Exception as err:
        suspects = "a pipeline rank"
        if groups is not None:
            others = [r for r in groups.members(kind) if r != groups.rank]
            if len(others) == 1:
                suspects = f"Pipeline stage {groups.stage_of_rank(others[0])} (global rank {others[0]})"
            else:
                suspects = f"One of global ranks {others}"
        raise PeerFailure(
            f"{suspects} stopped answering while this rank waited for {what}: {err}. "
            "Look at the other ranks' logs for the original error."
        ) from err
