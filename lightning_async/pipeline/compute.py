"""A rank's compute: its chunks' forwards on a weight version, their backwards (whole or split), and what is in flight.

A forward runs its chunk with the version its batch reads in place of the module's parameters
(:class:`~lightning_async.pipeline.weight_swap.WeightSwap`; under FSDP the version is loaded into the sharded
parameters), so autograd accumulates each micro-batch's weight gradients into that version; the last piece applies
the loss. A split backward (``I``) leaves the linear layers' weight gradients for ``W``
(:mod:`~lightning_async.pipeline.weight_grad`). The runtime dispatches these; this class owns the tensors in flight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_async.pipeline.paci import recomputed_at_backward
from lightning_async.pipeline.boundary import flatten
from lightning_async.pipeline.fsdp import set_gradient_sync
from lightning_async.pipeline.hooks import StepHooks
from lightning_async.pipeline.versions import WeightVersions
from lightning_async.pipeline.weight_grad import DeferredWeightGrads, split_linear_backward
from lightning_async.pipeline.weight_swap import WeightSwap

_NO_COLLECTION = contextlib.nullcontext()  # (reusable: a whole backward collects nothing)


class ChunkCompute:
    """The forwards and backwards of a rank's ``chunks`` (one per piece it holds, ``pieces[c]`` the model piece of
    chunk ``c``, ``last_piece`` the model's last), reading and accumulating into ``versions[c]`` (the weight versions
    of chunk ``c``'s update group: the same for every chunk unless the schedule updates chunks on their own)."""

    def __init__(self, chunks: Sequence[nn.Module], versions: Sequence[WeightVersions], pieces: Sequence[int],
                 last_piece: int, n_microbatches: int, loss_fn: Callable,
                 autocast: Callable = contextlib.nullcontext, context_fn: Callable | None = None,
                 activation_checkpointing: bool = False, split_backward: bool = False, fsdp: bool = False,
                 hooks: StepHooks | None = None, device: torch.device | None = None, stale_forwards: int = 0) -> None:
        self.chunks, self.pieces, self.last_piece, self.versions = list(chunks), list(pieces), last_piece, list(versions)
        self.n_microbatches, self.loss_fn, self.autocast, self.context_fn = n_microbatches, loss_fn, autocast, context_fn
        self.activation_checkpointing, self.fsdp, self.device = bool(activation_checkpointing), fsdp, device
        self.hooks = hooks or StepHooks()
        #: a batch's first ``stale_forwards`` forwards run before the previous batch's update lands on the one version
        #: (``paci``): their backwards recompute the chunk at the updated weights (``pipeline.paci``)
        self.stale_forwards = stale_forwards
        index = [{id(p): i for i, p in enumerate(v.params)} for v in self.versions]
        #: per chunk: its forward with a version's weights in place of its parameters (every name a weight has in
        #: the chunk -> its index in a version; not under FSDP, whose parameters are the storage it gathers from)
        self.swaps = [] if fsdp else [
            WeightSwap(c, {n: index[k][id(p)] for n, p in c.named_parameters(remove_duplicate=False)})
            for k, c in enumerate(self.chunks)
        ]
        #: per chunk: the positions of its weights in a version (what a recomputed backward differentiates)
        self.chunk_weights = [sorted({index[k][id(p)] for p in c.parameters()}) for k, c in enumerate(self.chunks)]
        if split_backward:
            for chunk in self.chunks:
                split_linear_backward(chunk)
        self.inflight: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # (chunk, mb) -> (inputs, outputs)
        self.deferred: dict[tuple[int, int], DeferredWeightGrads] = {}  # (chunk, mb) -> weight gradients I left for W
        self.backwards_begun: set[int] = set()  # batches whose first backward ran (for the hooks)

    @property
    def chunk_order(self) -> list[int]:
        """The chunks in model order (the order a forward-only pass runs them)."""
        return sorted(range(len(self.chunks)), key=lambda c: self.pieces[c])

    def forward(self, chunk: int, mb: int, batch: int, x, inputs, targets, training: bool):
        """Run chunk ``chunk`` on ``x`` (the received value, or the micro-batch ``inputs`` on the first piece)."""
        kwargs = {"recompute": True} if training and self.activation_checkpointing else {}
        first, last = self.pieces[chunk] == 0, self.pieces[chunk] == self.last_piece
        with self.autocast():
            if self.context_fn is not None:  # under autocast, as in the module's own forward
                kwargs["context"] = self.context_fn(inputs)
            if self.fsdp:
                self.versions[chunk].hold_read_by(batch) if training else self.versions[chunk].hold_newest()
                y = self.chunks[chunk](x, **kwargs)  # FSDP gathers the chunk's weights (of the version held)
            elif training and mb % self.n_microbatches < self.stale_forwards:
                y = self._recomputed_at_backward(chunk, batch, x, kwargs)
            elif training:  # autograd accumulates into the batch's version
                with self.swaps[chunk].using(self.versions[chunk].read_by(batch)):
                    y = self.chunks[chunk](x, **kwargs)
            else:  # the module's parameters show the newest weights
                y = self.chunks[chunk](x, **kwargs)
            if last:
                y = self.loss_fn(y, targets)
        if training:
            grad_inputs = [] if first else [t for t in flatten(x)[0] if t.requires_grad]
            grad_outputs = [y] if last else [t for t in flatten(y)[0] if t.requires_grad]
            self.inflight[chunk, mb] = (grad_inputs, grad_outputs)
        return y

    def _recomputed_at_backward(self, chunk: int, batch: int, x, kwargs: dict):
        """The chunk on ``x`` now, with no graph; its backward recomputes it at the weights the version holds then
        (updated in place in between) and accumulates the weight gradients there."""
        version = self.versions[chunk].read_by(batch)
        swap, module = self.swaps[chunk], self.chunks[chunk]

        def run(value, _previous: bool):
            with swap.using(version):
                return module(value, **kwargs)

        return recomputed_at_backward(run, x, [version[i] for i in self.chunk_weights[chunk]])

    def backward(self, chunk: int, mb: int, batch: int, grads: list[torch.Tensor] | None, split: bool = False) -> list[torch.Tensor] | None:
        """Backward of micro-batch ``mb`` of ``batch`` on ``chunk``; the gradients of its received leaves (``None`` on
        the first piece). ``split``: the input gradient only, the linear layers' weight gradients left for
        :meth:`weight_grad`."""
        inputs, outputs = self.inflight.pop((chunk, mb))
        last = self.pieces[chunk] == self.last_piece
        if self.hooks.active and batch not in self.backwards_begun:
            self.backwards_begun.add(batch)
            self.hooks.before_backward(batch, outputs[0] if last else torch.full((), float("nan"), device=self.device))
        if self.fsdp:  # FSDP gathers again: the forward's version; reduce-scatter once per batch, at its last backward
            self.versions[chunk].hold_read_by(batch)
            set_gradient_sync(self.chunks[chunk], mb % self.n_microbatches == self.n_microbatches - 1)
        deferred = DeferredWeightGrads() if split else None
        with deferred.collecting() if split else _NO_COLLECTION:
            if last:
                (outputs[0] / self.n_microbatches).backward()
            elif outputs:
                torch.autograd.backward(outputs, grads)
        if split:
            self.deferred[chunk, mb] = deferred
        if self.pieces[chunk] == 0:
            return None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]

    def weight_grad(self, chunk: int, mb: int) -> None:
        """The weight gradients the input-gradient action of ``mb`` on ``chunk`` deferred."""
        self.deferred.pop((chunk, mb)).compute()
