"""The pipeline's parameter counts, the model's and each stage's, said once at setup.

Lightning's model summary counts the module of the process that prints it: under a pipeline, rank 0 holds only its
stage, so the table showed stage 0's parameters (426 K of the quick start's 820 K) as the model's. The line this
module writes, before the module is cut into stages, gives the whole model and every stage::

    parameters: 820 K in the model; stage 0 426 K, stage 1 394 K (Lightning's model summary counts rank 0's stage)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

_COUNTED: "weakref.WeakKeyDictionary[object, tuple[int, list[int]]]" = weakref.WeakKeyDictionary()


def _unique_numel(parameters) -> int:
    seen: dict[int, int] = {}
    for parameter in parameters:
        seen.setdefault(id(parameter), parameter.numel())
    return sum(seen.values())


def parameter_counts(module, units: Sequence[tuple[str, object]], stage_units: Sequence[Sequence[str]],
                     holder: Callable[[int], int]) -> tuple[int, list[int]]:
    """``(the model's parameters, each stage's)`` of the whole ``module``: ``units`` are its ``(name, unit)`` pairs,
    ``stage_units`` the unit names of every piece, ``holder(piece)`` the stage that holds a piece. A weight shared by
    two stages (tied embeddings) counts once in the model and in each stage that holds it."""
    by_name = dict(units)
    stages: dict[int, list] = {}
    for piece, names in enumerate(stage_units):
        params = stages.setdefault(holder(piece), [])
        for name in names:
            params.extend(by_name[name].parameters())
    return _unique_numel(module.parameters()), [_unique_numel(stages[s]) for s in sorted(stages)]


def describe_parameter_counts(total: int, per_stage: Sequence[int]) -> str:
    stages = ", ".join(f"stage {s} {get_human_readable_count(n)}" for s, n in enumerate(per_stage))
    return (f"parameters: {get_human_readable_count(total)} in the model; {stages} (Lightning's model summary counts "
            "rank 0's stage)")


def log_parameter_counts(strategy, module, units: Sequence[tuple[str, object]]) -> str:
    """Say (rank 0) the model's and each stage's parameter counts for ``strategy``'s split of ``module``; call it
    after the split is decided and before the module is pruned to its stage. A module already pruned by an earlier
    ``fit``/``validate`` gives the counts it had then (none, ``""``, if this process never counted it whole).
    Returns the line."""
    from lightning_async.strategies.split import recorded_split

    if module not in _COUNTED and recorded_split(module) is not None:
        return ""
    if module not in _COUNTED:
        stages = strategy.pipeline_parallel_size
        _COUNTED[module] = parameter_counts(
            module, units, strategy.stage_units, lambda piece: strategy.schedule_spec.holder(piece, stages)[0])
    line = describe_parameter_counts(*_COUNTED[module])
    rank_zero_info(line)
    return line
