"""A rank's weight versions: the slots its update clock names, and which of them the module's parameters show.

The clock (:mod:`~lightning_async.pipeline.clock`) says which slot a batch reads and which one an update writes;
this class holds the tensors. Without FSDP each slot is a list of leaf tensors (autograd accumulates a micro-batch's
weight gradients into the slot its forward read) and the module's parameters always show the newest slot. Under
FSDP the parameters are the sharded storage FSDP gathers from: with one version they are the slot; with several,
each version is a sharded copy beside them, loaded into the parameters' shards before an action of its batch
(:meth:`hold`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_async.optim.clock import PieceClock
from lightning_async.pipeline.fsdp import local


class WeightVersions:
    """The weight slots of one rank (``clock.versions`` of them) over the parameter list ``params``."""

    def __init__(self, params: Sequence[torch.Tensor], clock: PieceClock, fsdp: bool = False) -> None:
        self.params, self.clock, self.fsdp = list(params), clock, fsdp
        n = clock.versions
        if fsdp:
            self.slots = [list(self.params)] if n == 1 else [[p.detach().clone() for p in self.params] for _ in range(n)]
            self._held: int | None = n - 1  # the slot the parameters' shards hold
        else:
            self.slots = [[p.detach().clone().requires_grad_(True) for p in self.params] for _ in range(n)]
            for p, t in zip(self.params, self.slots[-1]):
                p.data = t.data  # the module's parameters always show the newest weights
        self._newest = n - 1

    @property
    def sharded_copies(self) -> bool:
        """FSDP with several versions: the versions are sharded copies beside the parameters."""
        return self.fsdp and self.clock.versions > 1

    def read_by(self, batch: int) -> list[torch.Tensor]:
        """The version batch ``batch``'s forward and backward read (without FSDP: where its gradients accumulate)."""
        return self.slots[self.clock.read_slot(batch)]

    def gradient_holders(self, batch: int) -> list[torch.Tensor]:
        """Where batch ``batch``'s weight gradients are once its backwards are done (FSDP reduce-scatters into the
        parameters)."""
        return self.params if self.fsdp else self.read_by(batch)

    def newest(self) -> list[torch.Tensor]:
        """The newest weights: the slot the parameters show (FSDP with several versions: the newest sharded copy)."""
        return self.slots[self._newest]

    def written_by(self, update: int) -> list[torch.Tensor]:
        """The slot the update of batch ``update`` writes (free once that batch's gradient exists)."""
        return self.slots[self.clock.write_slot(update)]

    @torch.no_grad()
    def hold(self, slot: int) -> None:
        """FSDP with several versions: load slot ``slot`` into the parameters' shards (the ones FSDP gathers)."""
        if self.sharded_copies and slot != self._held:
            torch._foreach_copy_([local(p) for p in self.params], [local(t) for t in self.slots[slot]])
            self._held = slot

    def hold_read_by(self, batch: int) -> None:
        self.hold(self.clock.read_slot(batch))

    def hold_newest(self) -> None:
        self.hold(self._newest)

    def update_target(self, update: int) -> list[torch.Tensor]:
        """Where the optimizer step of ``update`` writes: the slot itself, or (sharded copies) the parameters."""
        return self.params if self.sharded_copies else self.written_by(update)

    @torch.no_grad()
    def landed(self, update: int) -> None:
        """The update of batch ``update`` has been written (by :meth:`update_target`): its slot is the newest."""
        slot = self.clock.write_slot(update)
        if self.sharded_copies:
            torch._foreach_copy_([local(t) for t in self.slots[slot]], [local(p) for p in self.params])
            self._held = slot
        self._newest = slot

    def nbytes(self) -> int:
        """Bytes of every copy of the weights (sharded copies: and the parameters' shards FSDP gathers from)."""
        return sum(tensor_bytes(slot) for slot in self.slots) + (tensor_bytes(self.params) if self.sharded_copies else 0)

    def state_dict(self) -> dict:
        """Every slot (on the CPU; FSDP: the sharded tensors, for torch.distributed.checkpoint) and the newest."""
        if self.fsdp:
            return {"slots": [[t.detach().clone() for t in slot] for slot in self.slots], "newest_slot": self._newest}
        slots = [[t.detach().to("cpu", copy=True) for t in slot] for slot in self.slots]  # no GPU spike
        return {"slots": slots, "newest_slot": self._newest}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for slot, saved in zip(self.slots, state["slots"]):
            for t, s in zip(slot, saved):
                t.copy_(s)
        self._newest = state["newest_slot"]
        if self.fsdp:
            self._held = None
            self.hold_newest()
        else:
            for p, t in zip(self.params, self.newest()):
                p.data = t.data


def tensor_bytes(tensors) -> int:
    """Bytes of ``tensors`` (this rank's shard of an FSDP weight)."""
    return sum(local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
