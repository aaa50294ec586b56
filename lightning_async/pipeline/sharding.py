"""ZeRO-1 over the data-parallel replicas ("distributed optimizer"): each replica of a stage updates a share of
the stage's parameters, and holds the optimizer state and the correction's buffers of that share only.

Every replica still averages the whole gradient (so the global norm for clipping is computed as without sharding,
bit for bit), steps the optimizer on the parameters it *owns*, and sends their new values to the other replicas,
which write them into the same weight slot. The shares are whole parameters, balanced by size (largest first onto
the least loaded replica): Muon, NorMuon and SOAP need whole matrices, and a parameter-level share makes a
checkpoint's optimizer state a function of global parameter names alone, whatever the layout. An optimizer whose
step couples parameters (a global gradient norm inside the optimizer, e.g. Adan's ``max_grad_norm``) is not exact
under sharding; every optimizer of the zoo at its defaults steps each parameter from its own gradient and state.

The new weights travel on a process group of their own (the same ranks as the gradient average): a replica may
apply an update a few actions earlier than another (as soon as its reductions finished), so these broadcasts start
at moments that differ between replicas, and on their own group their order is still the same everywhere (updates
are applied in batch order). Under 2BW the weights of ``V(b + 2)`` travel while batch ``b + 1`` computes;
:meth:`OptimizerShards.finish` waits for them at the start of call ``b + 2``, before anything reads the slot. An
update never needs another replica's weights (it reads and writes only the parameters this replica owns), so none
waits for a transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def balanced_owners(sizes: Sequence[int], replicas: int) -> list[int]:
    """The replica that owns each parameter: largest first onto the least loaded replica (ties: the lower index),
    so every replica of a stage computes the same assignment from the sizes alone."""
    load = [0] * replicas
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        replica = min(range(replicas), key=lambda r: (load[r], r))
        owners[i] = replica
        load[replica] += sizes[i]
    return owners


@dataclass
class _Transfer:
    batch: int  # the update whose new weights travel
    works: list
    #: per broadcast: the flat buffer and the slot tensors it fills (empty for the replica that sent it)
    parts: list[tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)


class OptimizerShards:
    """One rank's share of its stage's parameters and the transfers of the new weights to the other replicas.

    Args:
        params: the stage's parameters, in the runtime's order.
        replica: this rank's replica index; ``replicas``: how many.
        group: the process group of this stage's replicas reserved for the weights (``PipelineGroups.weight_gather``).
        source_rank: ``replica -> global rank`` of this stage in that replica (the broadcast's source).
    """

    def __init__(self, params: Sequence[torch.Tensor], replica: int, replicas: int, group, source_rank) -> None:
        self.owners = balanced_owners([p.numel() for p in params], replicas)
        self.owned = [owner == replica for owner in self.owners]
        self.replica, self.replicas, self.group, self.source_rank = replica, replicas, group, source_rank
        self._transfers: list[_Transfer] = []

    def owned_only(self, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads`` with ``None`` for the parameters another replica updates (the optimizer then skips them and
        never creates their state)."""
        return [g if mine else None for g, mine in zip(grads, self.owned)]

    def share(self, replica: int) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == replica]

    @torch.no_grad()
    def start(self, batch: int, slot: Sequence[torch.Tensor]) -> None:
        """Send this replica's parameters of ``slot`` updated from batch ``batch`` to the others and receive theirs
        (asynchronously)."""
        transfer = _Transfer(batch, works=[])
        for replica in range(self.replicas):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for i in self.share(replica):
                by_dtype.setdefault(slot[i].dtype, []).append(slot[i])
            for dtype, tensors in by_dtype.items():
                mine = replica == self.replica
                if mine:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
                work = dist.broadcast(flat, src=self.source_rank(replica), group=self.group, async_op=True)
                transfer.works.append(work)
                transfer.parts.append((flat, [] if mine else tensors))
        self._transfers.append(transfer)

    @property
    def in_flight(self) -> bool:
        return bool(self._transfers)

    def works(self) -> list:
        return [work for transfer in self._transfers for work in transfer.works]

    @torch.no_grad()
    def finish(self, wait, through: int | None = None) -> None:
        """Wait for the transfers of the updates of batches ``<= through`` (all: ``None``), oldest first, and write
        the received weights into their slots (``wait(works, what)`` turns a dead peer into a clear error).

        Only wait where every replica has started those transfers whatever its timing (the runtime: at the start of
        a call, after the updates it must apply there, and at the end of a drain): a replica that waited mid-call
        for a broadcast its peer had not started yet, while the peer waited for a pipeline message, would close a
        cycle of waits across the two pipelines."""
        while self._transfers and (through is None or self._transfers[0].batch <= through):
            transfer = self._transfers.pop(0)
            wait(transfer.works, "the new weights of the other replicas (sharded optimizer)")
            for flat, tensors in transfer.parts:
                if not tensors:  # (what this replica sent)
                    continue
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(part.view_as(t))
