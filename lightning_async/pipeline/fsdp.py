"""FSDP2 inside a pipeline stage: each unit's weights sharded over the stage's data-parallel replicas.

The way torchtitan composes pipeline and data parallelism: ``torch.distributed.fsdp.fully_shard`` on every unit of
a chunk, then on the chunk, over the replicas of the stage (a group of their own, so FSDP's collectives never
interleave with ours). A forward gathers a unit's weights and frees them after it; a backward gathers them again
and reduce-scatters the gradient, averaged over the replicas, into the shard; each replica steps the optimizer on
its shard (the optimizer state is sharded with it). Gradients accumulate unreduced over the micro-batches of a
batch and are reduce-scattered once, at the chunk's last backward (``set_requires_gradient_sync``), as torch's
``PipelineStage`` does.

Supported: the schedules whose backward is one action (``gpipe``, ``1f1b``, ``interleaved`` and ``2bw``). Under 2BW
each of the two weight versions is a sharded copy (``1/dp`` of the stage's weights each); before an action the
runtime loads its batch's version into the parameters' shards, which FSDP then gathers (every unit, the chunk's own
parameters included, is resharded after its forward, so a backward gathers its forward's version again). The
optimizer steps the parameters, ``V(b + 1)`` on entry, and the result ``V(b + 2)`` is copied into the slot of ``V(b)``.
Refused, with the reason: the split backward (``zbh1``, ``zbv``, ``2bw-split``: FSDP reduces in the input-gradient
action, before the deferred weight gradients exist), optimizers that need whole matrices (Muon, NorMuon, SOAP),
activation checkpointing, a weight shared by two units of one rank, and ``shard_optimizer`` (FSDP already shards
the optimizer state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

WHOLE_MATRIX_OPTIMIZERS = ("muon", "normuon", "soap")


def check_fsdp_applicable(spec, data_parallel_size: int, shard_optimizer: bool = False,
                          activation_checkpointing: bool = False) -> None:
    """Refuse, with the fix, what FSDP inside a stage cannot run (before any rank makes a group)."""
    problem = None
    if data_parallel_size < 2:
        problem = (f"it shards each stage's weights over its data-parallel replicas, but this run has {data_parallel_size}. "
                   "Add replicas (processes = stages x replicas) or set fsdp=False")
    elif not spec.stash:
        problem = (f"schedule {spec.name!r} updates its one weight version in the middle of a call, which FSDP's "
                   "sharded copies do not support yet. Use fsdp=False or schedule='2bw'")
    elif spec.update_per_chunk:
        problem = (f"schedule {spec.name!r} updates each chunk of a stage on its own, which FSDP's one sharded copy "
                   "per version does not support yet. Use shard_optimizer=True (ZeRO-1) or schedule='2bw'")
    elif spec.split_backward:
        problem = (f"schedule {spec.name!r} splits the backward, and FSDP reduce-scatters the weight gradients in the "
                   "input-gradient action, before the deferred ones exist. Use gpipe, 1f1b, interleaved or 2bw")
    elif shard_optimizer:
        problem = "FSDP already shards the optimizer state; set shard_optimizer=False"
    elif activation_checkpointing:
        problem = "activation checkpointing under FSDP inside a stage is not supported yet; set activation_checkpointing=False"
    if problem:
        raise ValueError(f"fsdp=True: {problem}.")


def check_optimizer(optimizer) -> None:
    """Muon, NorMuon and SOAP orthogonalise or rotate whole matrices; FSDP gives each replica a slice of one."""
    for part in getattr(optimizer, "optimizers", None) or [optimizer]:
        name = type(part).__name__
        if any(key in name.lower() for key in WHOLE_MATRIX_OPTIMIZERS):
            raise ValueError(
                f"fsdp=True: {name} needs whole weight matrices, and FSDP gives each replica a slice of each. Use "
                "shard_optimizer=True (ZeRO-1 shards by whole parameter) or an element-wise optimizer (AdamW, Adan, "
                "Lion, MARS)."
            )


def shard_chunks(chunks: Sequence[nn.Module], group, device: torch.device, versions: int = 1) -> dict[int, nn.Parameter]:
    """``fully_shard`` every unit of each chunk, then the chunk, over ``group``; returns the new parameter of every
    old one (FSDP replaces each parameter by a sharded ``DTensor`` parameter), by the old one's id. With two weight
    ``versions`` the chunk's own parameters are resharded after the forward too (FSDP keeps a root's gathered), so
    that a backward gathers the version the runtime loaded for it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    for chunk in chunks:
        _refuse_shared_weights(chunk)
    mesh = DeviceMesh.from_group(group, device.type)
    before = [list(chunk.named_parameters()) for chunk in chunks]
    for chunk in chunks:
        units = [unit for unit in getattr(chunk, "units", [chunk]) if any(True for _ in unit.parameters())]
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(chunk, mesh=mesh, **({"reshard_after_forward": True} if versions > 1 else {}))
        _prefetch_within_the_backward(units)
    new = {}
    for chunk, named in zip(chunks, before):
        now = dict(chunk.named_parameters())
        new.update({id(p): now[name] for name, p in named})
    return new


def _prefetch_within_the_backward(units: Sequence[nn.Module]) -> None:
    """A unit's backward prefetches the unit before it, and the first unit nothing (it names itself, already gathered).

    FSDP's default prefetches the module before it in the order of the forwards since the last "last backward", which
    with several micro-batches in flight can be a unit of another micro-batch's forward: its weights would then be
    gathered now and used later, by an action of another weight version."""
    for i, unit in enumerate(units):
        unit.set_modules_to_backward_prefetch([units[i - 1] if i else unit])


def _refuse_shared_weights(chunk: nn.Module) -> None:
    seen: dict[int, str] = {}
    for name, p in chunk.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise ValueError(
                f"fsdp=True: the weight {seen[id(p)]!r} is also {name!r} on this rank; FSDP cannot shard a weight two "
                "units share. Untie it, or split so that the two units sit on different stages."
            )
        seen[id(p)] = name


def rebind_optimizer(optimizer, new: dict[int, nn.Parameter]) -> None:
    """Point a fresh optimizer's parameter groups at the sharded parameters (its state is still empty).

    pytorch_optimizer's multi-tensor paths (Adan's, MARS's) call ``torch._foreach_copy_``, which ``DTensor`` has no
    sharding rule for in torch 2.13: their groups step per tensor instead (same arithmetic)."""
    if getattr(optimizer, "state", None):
        raise ValueError("fsdp=True needs a fresh optimizer (no state yet) when the rank is built.")
    for group in optimizer.param_groups:
        group["params"][:] = [new.get(id(p), p) for p in group["params"]]
    for part in getattr(optimizer, "optimizers", None) or [optimizer]:
        if type(part).__module__.startswith("pytorch_optimizer"):
            for group in part.param_groups:
                if "foreach" in group:
                    group["foreach"] = False


def set_gradient_sync(chunk: nn.Module, last_backward: bool) -> None:
    """Reduce-scatter the chunk's gradients at this backward only when it is the batch's last on the chunk."""
    chunk.set_requires_gradient_sync(last_backward)
    chunk.set_is_last_backward(last_backward)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a ``DTensor``)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``'s whole value (all-gathered over the replicas when FSDP shards it: a collective)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
