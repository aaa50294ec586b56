"""Run a module with another set of weights in place of its parameters, cheaply (the runtime's weight versions).

``torch.func.functional_call`` does this generically: it parses every dotted name, walks the module tree and sets
and restores each tensor through ``setattr`` on every call, about 2.5 us per tensor on a CPU (as much again as the
module's own Python forward; ``benchmarks/pipeline_throughput.py``'s per-action column). A pipeline stage runs the
same module with one of two fixed weight lists thousands of times, so :class:`WeightSwap` resolves each name to
its owning module and attribute once, and a call only writes the owners' ``_parameters`` entries and writes the
originals back afterwards (two dictionary writes per tensor). What the forward sees is what ``functional_call``
gives it: the given tensors as the module's parameters (autograd accumulates into them), buffers untouched, every
name of a weight shared within the module pointing at the same tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


class WeightSwap:
    """``module``'s parameters resolved once to their owning module and attribute.

    Every name of every parameter (``named_parameters(remove_duplicate=False)``: a weight registered under two
    names is swapped under both) must be in ``index``, which maps it to its position in the weight lists that
    :meth:`using` takes.
    """

    def __init__(self, module: nn.Module, index: dict[str, int]) -> None:
        self._entries: list[tuple[dict, str, int]] = []  # (owner's _parameters, attribute, position in the weights)
        for name, _ in module.named_parameters(remove_duplicate=False):
            owner_name, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            self._entries.append((owner._parameters, attribute, index[name]))

    @contextmanager
    def using(self, weights: Sequence[torch.Tensor]) -> Iterator[None]:
        """Inside the block the module computes with ``weights`` (by position) instead of its parameters."""
        originals = [(table, attribute, table[attribute]) for table, attribute, _ in self._entries]
        try:
            for table, attribute, position in self._entries:
                table[attribute] = weights[position]
            yield
        finally:
            for table, attribute, original in originals:
                table[attribute] = original
