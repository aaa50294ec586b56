"""The backward split in two: the input gradient now, the weight gradient later (zero-bubble schedules).

A zero-bubble schedule runs a micro-batch's backward as ``I`` (the gradient with respect to the stage's inputs,
which the previous stage waits for) and ``W`` (the gradient with respect to the weights, which nobody waits for,
so it can fill a bubble). Autograd computes both in one pass; computing them in two passes would repeat the
input-gradient chain. So, as Megatron-LM's zero-bubble implementation does, the split happens inside the linear
layers, where nearly all the weight-gradient work is: a linear layer's backward returns its input gradient at once
and, while a :class:`DeferredWeightGrads` is collecting, defers ``dW = dY^T X``, a product of tensors it already
holds. Between ``I`` and ``W`` a micro-batch therefore keeps, per linear layer, its input ``X`` and its output
gradient ``dY`` (and nothing else of its activations: autograd frees the rest of the graph in ``I``);
:meth:`DeferredWeightGrads.held_bytes` counts them. ``W`` then computes the deferred products and accumulates them into the weights' ``.grad``, exactly
as autograd would have (the same products, summed in another order). Every other weight (norms, biases,
embeddings) gets its gradient in ``I`` as usual. Outside a collection the linear layers behave like
``nn.Linear``.

:func:`split_linear_backward` turns a module's ``nn.Linear`` layers into :class:`SplitBackwardLinear` (same
class but for ``forward``: parameters, ``state_dict`` and ``isinstance`` are unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

_collecting: list["DeferredWeightGrads"] = []  # the collection a backward in progress defers into (one at a time)


class DeferredWeightGrads:
    """The weight gradients one ``I`` deferred, computed by :meth:`compute` (the ``W`` action)."""

    def __init__(self) -> None:
        self.deferred: list[Callable[[], None]] = []
        self.held: list[torch.Tensor] = []  # the tensors the deferred products keep alive until compute()

    @contextlib.contextmanager
    def collecting(self) -> Iterator["DeferredWeightGrads"]:
        """Within this block, weight gradients that can wait (linear layers') are deferred into this collection."""
        _collecting.append(self)
        try:
            yield self
        finally:
            _collecting.pop()

    def defer(self, fn: Callable[[], None], *holds: torch.Tensor) -> None:
        """Run ``fn`` (which accumulates a weight gradient into ``.grad``) in :meth:`compute` instead of now.
        ``holds``: the tensors ``fn`` keeps alive until then (a linear layer's input and output gradient), for
        :meth:`held_bytes`."""
        self.deferred.append(fn)
        self.held += holds

    def held_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the storages the deferred products hold (each storage once; ``exclude``: the weights): what a
        micro-batch keeps between its ``I`` and its ``W``."""
        return storage_bytes(self.held, exclude)

    def compute(self) -> None:
        """Run every deferred weight gradient (frees the tensors they hold)."""
        deferred, self.deferred, self.held = self.deferred, [], []
        for fn in deferred:
            fn()

    def __len__(self) -> int:
        return len(self.deferred)


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, less those behind ``exclude``."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in sizes.items() if ptr not in skip)


def collecting_now() -> DeferredWeightGrads | None:
    """The collection a backward in progress defers weight gradients into, if any (for custom autograd functions
    that want to split their backward like :class:`SplitBackwardLinear`)."""
    return _collecting[-1] if _collecting else None


def _linear_weight_grad(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(weight.dtype)


def accumulate_grad(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """``weight.grad += grad`` (or ``= grad``), as autograd accumulates."""
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        y = nn.functional.linear(x, weight, bias)  # (under autocast: in its dtype, as nn.Linear)
        ctx.save_for_backward(x, weight)
        # The weight itself (a leaf), where a deferred gradient accumulates: the saved one, once unpacked, may be a
        # copy (torch.autograd.graph.save_on_cpu and any saved_tensors_hooks), and its .grad would be lost.
        ctx.weight = weight
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            collection = collecting_now()
            if collection is not None:
                x, dy_, target = x.detach(), dy.detach(), ctx.weight
                collection.defer(lambda: accumulate_grad(target, _linear_weight_grad(target, x, dy_)), x, dy_)
            else:
                dw = _linear_weight_grad(weight, x, dy)
        db = dy.reshape(-1, dy.shape[-1]).sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db


class SplitBackwardLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred (see :class:`DeferredWeightGrads`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias)


def split_linear_backward(module: nn.Module) -> int:
    """Make every plain ``nn.Linear`` in ``module`` a :class:`SplitBackwardLinear` (in place); returns how many."""
    count = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = SplitBackwardLinear
            count += 1
    return count
