"""The process groups of a :class:`~lightning_async.pipeline.mesh.PipelineMesh`, made once per default group."""

from __future__ import annotations

import dataclasses
import gc
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_async.pipeline.mesh import PipelineGroups, PipelineMesh

# Groups made under the current default process group, by (rank, mesh, timeout). Every fit, validate or test
# sets the strategy up again; on NCCL each ``new_group`` is a communicator (memory, and a collective split across
# the whole world), so they are made once per default group and reused.
_MADE: dict = {}


def make_pipeline_groups(
    rank: int, world_size: int, pipeline_parallel_size: int, timeout: timedelta | None = None
) -> PipelineGroups:
    """Create every group (all ranks must call this, in the same order) and return this rank's.

    ``timeout`` bounds every wait on these groups (sends, receives, reductions): a stage that stops answering
    without dying (SIGSTOP, a stuck kernel) makes its peers raise ``PeerFailure`` after it. ``None``: torch's
    default (30 minutes), not the default group's timeout.
    """
    mesh = PipelineMesh.from_world(world_size, pipeline_parallel_size)
    if world_size == 1 or not dist.is_initialized():
        return PipelineGroups(mesh, rank)
    if _MADE.get("world") is not dist.group.WORLD:  # a new default group: the old groups died with it
        _MADE.clear()
        _MADE["world"] = dist.group.WORLD
    key = (rank, mesh, timeout)
    if key not in _MADE:
        _MADE[key] = _make(mesh, rank, timeout)
    return dataclasses.replace(_MADE[key])


def release_process_groups() -> None:
    """Destroy every process group and free it now, gloo's threads joined while the interpreter is whole.

    ``destroy_process_group`` only shuts the groups down; a group object stays alive (and its threads with it)
    while anything references it, this module's cache included. Left to interpreter finalization, gloo's threads
    may free finished works whose tensors need the GIL, and the process aborts after a successful run ("terminate
    called without an active exception", SIGABRT). Callers drop their own references first (the strategy's
    ``teardown``)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _MADE.clear()
    gc.collect()  # (groups held in reference cycles)


def _make(mesh: PipelineMesh, rank: int, timeout: timedelta | None) -> PipelineGroups:
    groups = PipelineGroups(mesh, rank)

    def new_group(ranks: list[int]):
        return dist.new_group(ranks, timeout=timeout)

    for replica in range(mesh.data_parallel_size):
        ranks = mesh.pipeline_ranks(replica)
        p2p, pipeline = new_group(ranks), new_group(ranks)
        tied = new_group(mesh.tied_ranks(replica)) if mesh.pipeline_parallel_size > 1 else None
        if rank in ranks:
            groups.p2p, groups.pipeline, groups.tied = p2p, pipeline, tied
    if mesh.data_parallel_size > 1:  # (with one replica there is nothing to average; every rank skips alike)
        for stage in range(mesh.pipeline_parallel_size):
            ranks = mesh.data_parallel_ranks(stage)
            group, gather = new_group(ranks), new_group(ranks)
            if rank in ranks:
                groups.data_parallel, groups.weight_gather = group, gather
    groups.metrics = new_group(list(range(mesh.world_size)))
    return groups


def synchronize_initial_weights(groups: PipelineGroups, module, tied: list[str]) -> None:
    """Tied copies start equal to the first stage's, replicas to replica 0's (a collective of the mesh)."""
    if groups.metrics is None:  # a single process
        return
    mesh, named = groups.mesh, dict(module.named_parameters())
    with torch.no_grad():
        if groups.tied is not None and tied:
            for name in tied:
                dist.broadcast(named[name].data, src=mesh.rank_of(0, groups.replica), group=groups.tied)
        if groups.data_parallel is not None:
            for p in module.parameters():
                dist.broadcast(p.data, src=mesh.rank_of(groups.stage, 0), group=groups.data_parallel)
