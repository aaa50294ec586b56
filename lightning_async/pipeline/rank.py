"""Building a pipeline rank: a plan first (what the rank will hold), then one :func:`build` (groups, stage, runtime).

:func:`plan_rank` decides, before any process group exists, what rank ``rank`` holds: the mesh, the schedule, the
units of every piece, the rank's stage (its pieces, its tied weights, its parameters by global name). The caller
prepares what it owns with it: the strategy prunes the LightningModule to the plan, moves it and sets up the
user's optimizer; a test or a benchmark builds its optimizer from ``plan.named_parameters``. :func:`build` then
makes the process groups, synchronises the initial weights (tied copies, replicas) and returns the runtime.
Nothing else constructs a :class:`~lightning_async.pipeline.runtime.PipelineRuntime`, so the strategy, the test
harness and the benchmarks cannot drift apart (the harness once skipped the initial weight synchronisation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch import nn

from lightning_async.pipeline import schedules
from lightning_async.pipeline.fsdp import check_fsdp_applicable, check_optimizer, rebind_optimizer, shard_chunks
from lightning_async.pipeline.groups import make_pipeline_groups, synchronize_initial_weights
from lightning_async.pipeline.mesh import PipelineGroups, PipelineMesh
from lightning_async.pipeline.partition import partition_units
from lightning_async.pipeline.run_checks import check_message_order
from lightning_async.pipeline.runtime import PipelineRuntime
from lightning_async.pipeline.stage import RankStage, build_rank_stage, prune_to_stage


@dataclass(frozen=True)
class RankPlan:
    """What one rank of a pipeline will hold, decided before anything is built (no process groups, no runtime)."""

    rank: int
    mesh: PipelineMesh
    spec: schedules.ScheduleSpec
    n_microbatches: int
    #: the unit names of every piece (virtual stage), in model order
    stage_units: list[list[str]]
    #: the rank's pieces (they hold the model's own unit modules, not copies) and its tied weights
    rank_stage: RankStage

    @property
    def stage(self) -> int:
        """The pipeline stage this rank runs."""
        return self.mesh.stage_of(self.rank)

    @property
    def tied(self) -> list[str]:
        """Names (in the rank's module) of the weights it shares with another rank, in the order both ends use."""
        return self.rank_stage.tied

    @property
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The rank's parameters with global names (``unit.param``), each once: what its optimizer gets."""
        return self.rank_stage.named_parameters

    def prune(self, module: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> None:
        """Replace, in ``module`` (whose units are ``units``), every unit another rank holds by a placeholder."""
        prune_to_stage(module, units, self.stage_units, self.stage, self.spec)


@dataclass
class Rank:
    """What :func:`build` made for one process."""

    plan: RankPlan
    groups: PipelineGroups
    runtime: PipelineRuntime

    @property
    def stage(self) -> RankStage:
        return self.plan.rank_stage


def plan_rank(
    units: Sequence[tuple[str, nn.Module]],
    schedule: "str | schedules.ScheduleSpec",
    n_microbatches: int,
    rank: int = 0,
    world_size: int = 1,
    pipeline_parallel_size: int | None = None,
    stage_units: Sequence[Sequence[str]] | None = None,
    partition: str | Sequence[str] = "uniform",
    tied: Sequence[str] | None = None,
) -> RankPlan:
    """The plan of rank ``rank`` of a ``world_size``-process pipeline (``pipeline_parallel_size`` stages per replica).

    ``stage_units`` (the units of every piece, in model order) or ``partition`` decide the split. ``tied``
    overrides the tied weights the split finds (for a module whose other stages are placeholders already).
    Settings the schedule cannot run are refused here, before any rank makes a process group.
    """
    spec = schedules.spec(schedule)
    mesh = PipelineMesh.from_world(world_size, pipeline_parallel_size or world_size)
    spec.validate(mesh.pipeline_parallel_size, n_microbatches)
    pieces = spec.virtual_stages(mesh.pipeline_parallel_size)
    if stage_units is None:
        stage_units = partition_units(units, pieces, partition)
    if len(stage_units) != pieces:
        raise ValueError(
            f"Schedule {spec.name!r} on {mesh.pipeline_parallel_size} stages runs {pieces} pieces, but stage_units lists "
            f"{len(stage_units)}. Give one list of unit names per piece (or leave stage_units unset to partition)."
        )
    split = [list(names) for names in stage_units]
    if not spec.uniform_delay:
        _refuse_weights_shared_across_delays(spec, units, split, mesh.pipeline_parallel_size)
    rank_stage = build_rank_stage(units, mesh.stage_of(rank), split, schedule=spec)
    if tied is not None:
        rank_stage.tied = list(tied)
    return RankPlan(rank, mesh, spec, n_microbatches, split, rank_stage)


def build(
    plan: RankPlan,
    optimizer,
    split_batch: Callable,
    loss_fn: Callable,
    timeout: timedelta | None = None,
    fsdp: bool = False,
    **runtime_options,
) -> Rank:
    """Build the rank ``plan`` describes: its process groups, its initial weights, its runtime.

    Every rank must call it, in the same order (it makes the process groups and synchronises the initial weights:
    tied copies equal stage 0's, replicas equal replica 0's). ``optimizer`` holds the rank's parameters
    (``plan.named_parameters``) and nothing else. ``runtime_options`` go to :class:`PipelineRuntime` (clipping,
    correction, autocast, device, context, activation checkpointing, sharded optimizer, the transport's mode;
    under ``transport="nccl-rules"`` a schedule whose messages NCCL could not match is refused here, before any
    group). ``fsdp``: shard each unit's weights over the stage's replicas with FSDP2
    (:mod:`~lightning_async.pipeline.fsdp`); the optimizer's parameters are rebound to the sharded ones, and so are
    ``plan.named_parameters``.
    """
    _check_optimizer_holds_the_rank(optimizer, plan)
    if not plan.spec.uniform_delay and runtime_options.get("gradient_clip_val"):
        raise ValueError(
            f"Gradient clipping by the global norm needs every stage's gradient of a batch when the first stage "
            f"updates, but schedule {plan.spec.name!r} gives its stages different delays (the last stage updates with "
            "batch b's gradient before the first stage has computed its own). Turn clipping off "
            "(gradient_clip_val=None) or use schedule='2bw', whose stages share one delay."
        )
    mesh = plan.mesh
    check_message_order(plan.spec, mesh.pipeline_parallel_size, plan.n_microbatches, runtime_options.get("transport", "auto"))
    if fsdp:
        check_fsdp_applicable(plan.spec, mesh.data_parallel_size, runtime_options.get("shard_optimizer", False),
                              runtime_options.get("activation_checkpointing", False))
        check_optimizer(optimizer)
    groups = make_pipeline_groups(plan.rank, mesh.world_size, mesh.pipeline_parallel_size, timeout=timeout)
    module = plan.rank_stage.module
    synchronize_initial_weights(groups, module, plan.tied)
    if fsdp:
        device = runtime_options.get("device") or next(module.parameters()).device
        sharded = shard_chunks(plan.rank_stage.chunks, groups.weight_gather, device, versions=plan.spec.clock(mesh.pipeline_parallel_size).rank(groups.stage).versions)
        rebind_optimizer(optimizer, sharded)
        plan.rank_stage.named_parameters[:] = [(n, sharded.get(id(p), p)) for n, p in plan.named_parameters]
    runtime = PipelineRuntime(
        module, optimizer, plan.spec, plan.n_microbatches, split_batch, loss_fn, groups,
        tied_parameters=plan.tied, count_tied_in_norm=groups.stage == 0, fsdp=fsdp, **runtime_options,
    )
    return Rank(plan, groups, runtime)


def _refuse_weights_shared_across_delays(spec, units: Sequence[tuple[str, nn.Module]], split: list[list[str]],
                                        num_stages: int) -> None:
    """A weight two pieces share (tied embeddings) is summed over both; pieces of different delays compute their
    gradients of a batch in different calls, so a schedule with per-piece delays cannot sum them."""
    delays = spec.piece_delays(num_stages)
    modules = dict(units)
    holders: dict[int, set[int]] = {}
    for piece, names in enumerate(split):
        for name in names:
            for p in modules[name].parameters():
                holders.setdefault(id(p), set()).add(piece)
    for pieces in holders.values():
        if len({delays[k] for k in pieces}) > 1:
            raise ValueError(
                f"Schedule {spec.name!r} gives pieces {sorted(pieces)} different delays "
                f"({[delays[k] for k in sorted(pieces)]}), but they share a weight (tied embeddings?), whose gradient "
                "must be summed over both in the same step. Untie it (e.g. tie_embeddings=False in the model config; CLI: "
                "model.model_overrides: {tie_embeddings: false}) "
                "or use schedule='2bw'."
            )


def _check_optimizer_holds_the_rank(optimizer, plan: RankPlan) -> None:
    """Refuse an optimizer that steps a weight this rank does not hold (e.g. one built before the module was pruned)."""
    mine = {id(p) for _, p in plan.named_parameters}
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            if id(p) not in mine:
                raise ValueError(
                    f"The optimizer of pipeline rank {plan.rank} (stage {plan.stage}) holds a parameter of shape "
                    f"{tuple(p.shape)} that this stage does not run. Build the optimizer from the rank's parameters "
                    f"(RankPlan.named_parameters, or the LightningModule after RankPlan.prune)."
                )
