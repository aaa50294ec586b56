"""Boundary values: what pipeline units take and return, and what crosses a stage boundary.

A boundary value is a Tensor or a small pytree of tensors: tuples, lists and ``str``-keyed dicts of
tensors, nested. A unit is called with the previous unit's value spread as arguments (``unit(x)``,
``unit(*value)``, ``unit(**value)``), plus ``context=`` when the module defines ``pipeline_context`` and
the unit's forward has a ``context`` parameter. See docs/pipeline.md, "The module contract".
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

#: ``PieceModule.forward``'s default: the module defines no ``pipeline_context`` (nothing is passed)
NO_CONTEXT = object()

_ALLOWED = "a Tensor, a tuple/list of tensors or a dict str -> tensor (nesting allowed)"


def flatten(value, where: str = "a boundary value") -> tuple[list[torch.Tensor], object]:
    """The tensor leaves of ``value`` (depth first) and its structure (``"T"``, or nested JSON-able lists).

    Raises ``TypeError`` naming ``where`` and the offending type for anything that is not a boundary value.
    """
    if isinstance(value, torch.Tensor):
        return [value], "T"
    leaves: list[torch.Tensor] = []
    return leaves, _flatten_into(value, leaves, where, "")


def _flatten_into(value, leaves: list[torch.Tensor], where: str, path: str):
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return "T"
    if isinstance(value, (tuple, list)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return [kind, [_flatten_into(v, leaves, where, f"{path}[{i}]") for i, v in enumerate(value)]]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        keys = list(value)
        return ["dict", keys, [_flatten_into(value[k], leaves, where, f"{path}[{k!r}]") for k in keys]]
    at = f" at output{path}" if path else ""
    raise TypeError(
        f"{where} returned {type(value).__name__}{at}; pipeline units must return {_ALLOWED}. "
        "Return tensors only: side inputs every stage can compute from the batch (position ids, masks, RoPE "
        "tables) belong in the module's pipeline_context(inputs) (see docs/pipeline.md)."
    )


def unflatten(leaves: Sequence[torch.Tensor], structure) -> object:
    """Inverse of :func:`flatten`."""
    if structure == "T":
        return leaves[0]
    it = iter(leaves)
    return _build(structure, it)


def _build(structure, it):
    if structure == "T":
        return next(it)
    if structure[0] == "dict":
        return {k: _build(s, it) for k, s in zip(structure[1], structure[2])}
    items = [_build(s, it) for s in structure[1]]
    return tuple(items) if structure[0] == "tuple" else items


def rows(value) -> int:
    """Size of dim 0 (the batch dimension) of a boundary value's leaves; they must all agree."""
    leaves, _ = flatten(value, "pipeline_split_batch")
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"Every tensor of a batch's inputs and targets is split on dim 0 into micro-batches, so they need the "
            f"same size there; got shapes {[tuple(leaf.shape) for leaf in leaves]}. Return (inputs, targets) from "
            "pipeline_split_batch whose tensors all have the batch dimension first."
        )
    return sizes.pop()


def split_rows(value, parts: int, even: bool = True) -> list:
    """``value`` cut into ``parts`` pieces along dim 0 of every leaf (``even``: ``chunk``, else ``tensor_split``)."""
    leaves, structure = flatten(value, "pipeline_split_batch")
    pieces = [leaf.chunk(parts) if even else leaf.tensor_split(parts) for leaf in leaves]
    return [unflatten([p[i] for p in pieces], structure) for i in range(len(pieces[0]))]


def signature(value) -> tuple:
    """Structure, dtypes and shapes of ``value``: equal signatures cross a boundary with the same header."""
    leaves, structure = flatten(value)
    return repr(structure), tuple((leaf.dtype, leaf.shape) for leaf in leaves)


def takes_context(unit: nn.Module) -> bool:
    """Whether ``unit``'s forward has a ``context`` parameter (a torch.compile'd unit: its original module's)."""
    forward = getattr(unit, "_orig_mod", unit).forward
    try:
        return "context" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a builtin or C++ forward without a Python signature
        return False


def unit_arguments(value, context=NO_CONTEXT) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for calling a unit with ``value``: ``x``, ``*value`` or ``**value``, and ``context=``
    unless it is :data:`NO_CONTEXT`."""
    kwargs = {} if context is NO_CONTEXT else {"context": context}
    if isinstance(value, torch.Tensor):
        return (value,), kwargs
    if isinstance(value, dict):
        return (), {**value, **kwargs}
    return tuple(value), kwargs


def call_unit(unit: Callable, value, context=NO_CONTEXT):
    """``unit`` applied to ``value`` spread as arguments (see :func:`unit_arguments`)."""
    args, kwargs = unit_arguments(value, context)
    return unit(*args, **kwargs)
