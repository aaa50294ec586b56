"""One rank's stage: the units it runs (:class:`StageModule`) and how a model is cut down to them.

:func:`build_rank_stage` is the one way a rank's stage is built (the strategy, the test harness and the
benchmarks all call it): the units of the stage, the names of weights it shares with another stage (tied
embeddings, paired by their global names), and its parameters with global names and no duplicates (what the
optimizer gets). :func:`prune_to_stage` replaces the other stages' units of a module by placeholders, so a
LightningModule holds only its stage's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, flatten, takes_context, unit_arguments
from lightning_async.pipeline.partition import partition_units


class StageModule(nn.Module):
    """The units of one stage, applied in order (see :mod:`~lightning_async.pipeline.boundary`).

    ``forward(value, context, recompute)``: each unit gets the previous unit's value spread as arguments,
    plus ``context=`` if its forward takes one and a context is given. With ``recompute`` each unit's
    forward is checkpointed (recomputed in the backward) with the weights it ran with: under
    ``functional_call`` those are the weight slot swapped in, not the module's own (newest) parameters.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.unit_names = [name for name, _ in units]
        self.units = nn.ModuleList(module for _, module in units)
        self.takes_context = [takes_context(module) for _, module in units]

    def forward(self, value, context=NO_CONTEXT, recompute: bool = False):
        for name, unit, wants_context in zip(self.unit_names, self.units, self.takes_context):
            unit_context = context if wants_context else NO_CONTEXT
            if recompute:
                weights = dict(unit.named_parameters())  # the slot functional_call put in, bound for the recompute
                value = checkpoint(_call_with, unit, weights, value, unit_context, use_reentrant=False)
            elif unit_context is NO_CONTEXT and isinstance(value, torch.Tensor):
                value = unit(value)  # the single-tensor path, as before
            else:
                value = call_unit(unit, value, unit_context)
            if not isinstance(value, torch.Tensor):
                flatten(value, f"Pipeline unit {name!r}")  # refuses anything but a small pytree of tensors
        return value


def _call_with(unit: nn.Module, weights: dict[str, torch.Tensor], value, context):
    """``unit(value)`` with ``weights`` in place of its parameters (what a checkpoint recomputes)."""
    args, kwargs = unit_arguments(value, context)
    return functional_call(unit, weights, args, kwargs)


def build_stage(
    units: Sequence[tuple[str, nn.Module]], stage_units: Sequence[Sequence[str]], stage: int
) -> tuple[StageModule, list[str]]:
    """This stage's module and the names (in it) of weights it shares with another stage (tied embeddings)."""
    stage_of = {name: s for s, names in enumerate(stage_units) for name in names}
    owners: dict[int, set[int]] = {}
    first_name: dict[int, str] = {}  # a weight's global name where it first appears: the same on every stage
    for name, unit in units:
        for pname, p in unit.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(stage_of[name])
            first_name.setdefault(id(p), f"{name}.{pname}")
    last = len(stage_units) - 1
    for pid, stages in owners.items():
        if len(stages) > 1 and stages != {0, last}:
            raise ValueError(
                f"The weight {first_name[pid]!r} is shared by pipeline stages {sorted(stages)}; only the first and the "
                f"last stage may share weights (tied embeddings). Choose a split that keeps it on one stage "
                f"(`partition`) or untie it."
            )
    stage_module = StageModule([(n, u) for n, u in units if stage_of[n] == stage])
    # both ends list their tied weights in one order (the reductions pair them by position)
    tied = sorted((n for n, p in stage_module.named_parameters() if len(owners[id(p)]) > 1),
                  key=lambda n: first_name[id(stage_module.get_parameter(n))])
    return stage_module, tied


@dataclass
class RankStage:
    """What one rank holds of a model split into stages."""

    module: StageModule
    #: names (in ``module``) of weights shared with another stage, in the order both ends use
    tied: list[str]
    #: the stage's parameters with global names (``unit.param``), each once (tied copies included once)
    named_parameters: list[tuple[str, nn.Parameter]]
    #: the unit names of every stage
    stage_units: list[list[str]]


def build_rank_stage(
    units: Sequence[tuple[str, nn.Module]], stage: int, stage_units: Sequence[Sequence[str]] | None = None,
    num_stages: int | None = None, partition: str | Sequence[str] = "uniform",
) -> RankStage:
    """Build stage ``stage``: from a given split ``stage_units``, or by splitting the units into ``num_stages``
    with ``partition`` (see :func:`~lightning_async.pipeline.partition.partition_units`)."""
    if stage_units is None:
        if num_stages is None:
            raise ValueError("build_rank_stage needs stage_units or num_stages.")
        stage_units = partition_units(units, num_stages, partition)
    split = [list(names) for names in stage_units]
    module, tied = build_stage(units, split, stage)
    named, seen = [], set()
    mine = set(split[stage])
    for name, unit in units:
        if name not in mine:
            continue
        for pname, p in unit.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((f"{name}.{pname}", p))
    return RankStage(module, tied, named, split)


class NotOnThisStage(nn.Module):
    """Placeholder for a pipeline unit that lives on another rank."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.unit, self.stage = name, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"Pipeline unit {self.unit!r} lives on stage {self.stage}; call it through the pipeline.")

    def extra_repr(self) -> str:
        return f"{self.unit!r} on stage {self.stage}"


def prune_to_stage(module: nn.Module, units: Sequence[tuple[str, nn.Module]], stage_units: Sequence[Sequence[str]],
                   stage: int) -> None:
    """Replace, in ``module``, every unit of another stage by a :class:`NotOnThisStage` placeholder."""
    stage_of = {name: s for s, names in enumerate(stage_units) for name in names}
    for name, _ in units:
        if stage_of[name] != stage:
            module.set_submodule(name, NotOnThisStage(name, stage_of[name]))
