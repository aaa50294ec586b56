"""One rank's stage: the units it runs (:class:`PieceModule`, one per chunk) and how a model is cut down to them.

:func:`build_rank_stage` is the one way a rank's stage is built (``pipeline.rank.build_rank`` calls it for the
strategy, the test harness and the benchmarks): the units of each of its pieces (one, or several for the
interleaved and V schedules), the names of weights it shares with another rank (tied embeddings, paired by their
global names), and its parameters with global names and no duplicates (what the optimizer gets).
:func:`prune_to_stage` replaces the other ranks' units of a module by placeholders, so a LightningModule holds
only its rank's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, flatten, takes_context, unit_arguments
from lightning_async.pipeline import schedules
from lightning_async.pipeline.partition import partition_units


class PieceModule(nn.Module):
    """The units of one stage, applied in order (see :mod:`~lightning_async.pipeline.boundary`).

    ``forward(value, context, recompute)``: each unit gets the previous unit's value spread as arguments,
    plus ``context=`` if its forward takes one and a context is given. With ``recompute`` each unit's
    forward is checkpointed (recomputed in the backward) with the weights it ran with: under the runtime's
    :class:`~lightning_async.pipeline.weight_swap.WeightSwap` those are the version swapped in, not the module's own
    (newest) parameters.
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
                weights = dict(unit.named_parameters())  # the version swapped in, bound for the recompute
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
    units: Sequence[tuple[str, nn.Module]], stage_units: Sequence[Sequence[str]], stage: int, schedule=None
) -> tuple[PieceModule | nn.ModuleList, list[str]]:
    """Rank ``stage``'s module and the names (in it) of the weights it shares with another rank (tied embeddings).

    ``stage_units`` lists the units of every piece (virtual stage) in model order; ``schedule`` (a spec or a name,
    default one piece per rank) says which rank holds which pieces. With one piece per rank the module is its
    :class:`PieceModule`; with several, an ``nn.ModuleList`` of one per chunk, in chunk order. Only the first and
    the last piece may share weights; when one rank holds both (ZB-V) the tie is local and not listed.
    """
    spec = schedules.spec(schedule or "1f1b")
    num_stages = len(stage_units) // spec.chunks
    piece_of = {name: k for k, names in enumerate(stage_units) for name in names}
    rank_of = {name: spec.holder(k, num_stages)[0] for name, k in piece_of.items()}
    owners: dict[int, set[int]] = {}  # weight -> the pieces that use it
    holders: dict[int, set[int]] = {}  # weight -> the ranks that hold it
    first_name: dict[int, str] = {}  # a weight's global name where it first appears: the same on every rank
    for name, unit in units:
        for pname, p in unit.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(piece_of[name])
            holders.setdefault(id(p), set()).add(rank_of[name])
            first_name.setdefault(id(p), f"{name}.{pname}")
    last = len(stage_units) - 1
    for pid, pieces in owners.items():
        if len(pieces) > 1 and pieces != {0, last}:
            raise ValueError(
                f"The weight {first_name[pid]!r} is shared by pipeline stages {sorted(pieces)}; only the first and the "
                f"last stage may share weights (tied embeddings). Choose a split that keeps it on one stage "
                f"(`partition`) or untie it."
            )
    chunks = [
        PieceModule([(n, u) for n, u in units if piece_of[n] == spec.piece(stage, c, num_stages)]) for c in range(spec.chunks)
    ]
    module = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    # both ends list their tied weights in one order (the reductions pair them by position)
    tied = sorted((n for n, p in module.named_parameters() if len(holders[id(p)]) > 1),
                  key=lambda n: first_name[id(module.get_parameter(n))])
    return module, tied


@dataclass
class RankStage:
    """What one rank holds of a model split into stages."""

    #: the rank's units: a :class:`PieceModule`, or an ``nn.ModuleList`` of one per chunk (several pieces per rank)
    module: PieceModule | nn.ModuleList
    #: names (in ``module``) of weights shared with another rank, in the order both ends use
    tied: list[str]
    #: the rank's parameters with global names (``unit.param``), each once (tied copies included once)
    named_parameters: list[tuple[str, nn.Parameter]]
    #: the unit names of every piece (virtual stage), in model order
    stage_units: list[list[str]]

    @property
    def chunks(self) -> list[PieceModule]:
        return list(self.module) if isinstance(self.module, nn.ModuleList) else [self.module]


def build_rank_stage(
    units: Sequence[tuple[str, nn.Module]], stage: int, stage_units: Sequence[Sequence[str]] | None = None,
    num_stages: int | None = None, partition: str | Sequence[str] = "uniform", schedule=None,
) -> RankStage:
    """Build rank ``stage``: from a given split ``stage_units`` (one list per piece), or by splitting the units into
    the ``num_stages x chunks`` pieces of ``schedule`` with ``partition`` (see
    :func:`~lightning_async.pipeline.partition.partition_units`)."""
    spec = schedules.spec(schedule or "1f1b")
    if stage_units is None:
        if num_stages is None:
            raise ValueError("build_rank_stage needs stage_units or num_stages.")
        stage_units = partition_units(units, spec.virtual_stages(num_stages), partition)
    split = [list(names) for names in stage_units]
    module, tied = build_stage(units, split, stage, spec)
    named, seen = [], set()
    mine = {n for c in (module if isinstance(module, nn.ModuleList) else [module]) for n in c.unit_names}
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
                   stage: int, schedule=None) -> None:
    """Replace, in ``module``, every unit another rank holds by a :class:`NotOnThisStage` placeholder."""
    spec = schedules.spec(schedule or "1f1b")
    num_stages = len(stage_units) // spec.chunks
    rank_of = {name: spec.holder(k, num_stages)[0] for k, names in enumerate(stage_units) for name in names}
    for name, _ in units:
        if rank_of[name] != stage:
            module.set_submodule(name, NotOnThisStage(name, rank_of[name]))
