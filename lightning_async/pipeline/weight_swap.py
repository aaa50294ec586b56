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

from collections.abc import Callable, Sequence
from operator import itemgetter

import torch
from torch import nn


class WeightSwap:
    """``module``'s parameters resolved once to their owning module and attribute.

    Every name of every parameter (``named_parameters(remove_duplicate=False)``: a weight registered under two
    names is swapped under both) must be in ``index``, which maps it to its position in the weight lists that
    :meth:`using` takes.
    """

    def __init__(self, module: nn.Module, index: dict[str, int]) -> None:
        owners: dict[int, tuple[dict, list[str], list[int]]] = {}  # per owner: its _parameters, attributes, positions
        for name, _ in module.named_parameters(remove_duplicate=False):
            owner_name, _, attribute = name.rpartition(".")
            table = module.get_submodule(owner_name)._parameters
            entry = owners.setdefault(id(table), (table, [], []))
            entry[1].append(attribute)
            entry[2].append(index[name])
        #: per owner: (its _parameters, its attributes, their tensors in a weight list, their current tensors): the
        #: reads and writes run in C
        self._owners: list[tuple[dict, tuple[str, ...], Callable, Callable]] = [
            (table, tuple(attributes), _getter(positions), _getter(attributes))
            for table, attributes, positions in owners.values()
        ]

    def using(self, weights: Sequence[torch.Tensor]) -> "_Using":
        """Inside the block (``with swap.using(weights):``) the module computes with ``weights`` (by position)
        instead of its parameters."""
        return _Using(self._owners, weights)


def _getter(items: Sequence) -> Callable:
    """``seq -> tuple(seq[i] for i in items)`` (``operator.itemgetter``, a tuple for one item too)."""
    if len(items) == 1:
        (item,) = items
        return lambda seq: (seq[item],)
    return itemgetter(*items)


class _Using:
    """:meth:`WeightSwap.using`'s context (a class, not a generator: it runs on every forward)."""

    __slots__ = ("owners", "weights", "originals")

    def __init__(self, owners: list, weights: Sequence[torch.Tensor]) -> None:
        self.owners, self.weights = owners, weights

    def __enter__(self) -> None:
        self.originals = [current(table) for table, _, _, current in self.owners]
        weights = self.weights
        try:
            for table, attributes, take, _ in self.owners:
                table.update(zip(attributes, take(weights)))
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc) -> bool:
        self._restore()
        return False

    def _restore(self) -> None:
        for (table, attributes, _, _), originals in zip(self.owners, self.originals):
            table.update(zip(attributes, originals))
