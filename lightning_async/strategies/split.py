"""Which units each pipeline piece holds, decided once per module and remembered for later trainer calls.

A module that a pipeline strategy has pruned to its rank's stage cannot be split again: a later ``validate``,
``test`` or ``fit`` on it must reuse the split. The record lives here, keyed weakly by the module (nothing is
stored on the user's module), in the process that pruned it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from lightning_async.pipeline.partition import partition_units


@dataclass(frozen=True)
class SplitRecord:
    """A module's split: the units of every piece and the weights shared across pieces (tied embeddings)."""

    stage_units: list[list[str]]
    tied: object


_SPLITS: "weakref.WeakKeyDictionary[object, SplitRecord]" = weakref.WeakKeyDictionary()


def recorded_split(module) -> SplitRecord | None:
    """The split this process made of ``module`` (``None``: not split yet)."""
    return _SPLITS.get(module)


def record_split(module, stage_units: list[list[str]], tied) -> None:
    """Remember that ``module`` was pruned to this split."""
    _SPLITS[module] = SplitRecord(stage_units, tied)


def decide_stage_units(module, units, pieces: int, partition, broadcast) -> list[list[str]]:
    """The units of every piece: the recorded split of ``module``, or a new one that rank 0 decides and
    ``broadcast`` (the strategy's) sends to every rank (measured unit times differ per rank)."""
    before = recorded_split(module)
    if before is not None:  # validate/test/fit again on a module already split
        if len(before.stage_units) != pieces:
            raise ValueError(
                f"This module was already split into {len(before.stage_units)} pipeline pieces; it cannot "
                f"be re-split into {pieces}. Build a fresh module (or load the consolidated checkpoint)."
            )
        return before.stage_units
    example = getattr(module, "example_input_array", None)
    if partition == "time" and example is None:
        raise ValueError("partition='time' measures each unit on module.example_input_array: set it (a batch of inputs).")
    stage_units = partition_units(
        units, pieces, partition, example_input=example, context_fn=getattr(module, "pipeline_context", None),
    )
    return broadcast(stage_units)
