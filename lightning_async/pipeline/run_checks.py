"""The checks a pipeline run's settings must pass before any process group exists (raised alike on every rank).

Everything here needs no communication: the mesh tiles the world, the schedule takes the stages and
micro-batches, FSDP and the sharded optimizer have replicas to shard over, the backend fits the device and
(on NCCL, which matches messages by posting order) the schedule posts its messages in matching order, and the
module has enough units for the schedule's pieces. Each error names the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_async.pipeline.contract import check_pipeline_contract
from lightning_async.pipeline.fsdp import check_fsdp_applicable
from lightning_async.pipeline.mesh import PipelineMesh
from lightning_async.pipeline.partition import partition_units
from lightning_async.pipeline.program import message_order_mismatches
from lightning_async.pipeline.schedules import ScheduleSpec


@dataclass(frozen=True)
class RunSettings:
    """What a pipeline run is asked to be (the strategy's arguments, resolved)."""

    mesh: PipelineMesh
    schedule: ScheduleSpec
    n_microbatches: int
    backend: str | None = None  # the process-group backend asked for (None: the device's default)
    device_type: str = "cpu"
    shard_optimizer: bool = False
    fsdp: bool = False
    activation_checkpointing: bool = False
    partition: str | list[str] = "uniform"


def check_run(settings: RunSettings, module=None) -> None:
    """Raise ``ValueError`` (naming the fix) for settings the pipeline cannot run; ``module`` (the LightningModule,
    if known) must also fit the pipeline contract and the schedule's pieces."""
    s, pp = settings, settings.mesh.pipeline_parallel_size
    if s.shard_optimizer and s.mesh.data_parallel_size < 2:
        raise ValueError(
            f"shard_optimizer=True shards the optimizer state over data-parallel replicas, but this run has one "
            f"replica ({s.mesh.world_size} processes = {pp} stages x 1). Use processes = stages x replicas with "
            "data_parallel_size > 1 (e.g. devices=4, pipeline_parallel_size=2), or set shard_optimizer=False."
        )
    s.schedule.validate(pp, s.n_microbatches)
    if s.fsdp:
        check_fsdp_applicable(s.schedule, s.mesh.data_parallel_size, s.shard_optimizer, s.activation_checkpointing)
    _check_backend(s)
    if module is not None:
        _check_module(s, module)


def _check_backend(s: RunSettings) -> None:
    pp, spec = s.mesh.pipeline_parallel_size, s.schedule
    if (s.backend == "nccl" or s.device_type == "cuda") and pp > 1:
        lists = [spec.run_actions(r, pp, s.n_microbatches, 1) for r in range(pp)]
        mismatches = message_order_mismatches(spec, lists, per_channel=False)
        if mismatches:
            raise ValueError(
                f"Schedule {spec.name!r} sends messages between two stages in another order than the receiver "
                "posts them, which NCCL (no tags) cannot match. Use schedule='zbh1' or 'interleaved' on GPUs, or "
                "run it on CPUs (gloo). The first pair that disagrees:\n" + mismatches[0]
            )
    if s.backend == "nccl" and s.device_type != "cuda":
        raise ValueError(
            "process_group_backend='nccl' needs CUDA tensors, but this run is on the CPU. "
            "Use accelerator='gpu', or process_group_backend='gloo' on CPUs."
        )
    if s.backend == "gloo" and s.device_type == "cuda":
        raise ValueError(
            "process_group_backend='gloo' cannot send CUDA tensors between pipeline stages. Leave "
            "process_group_backend unset (NCCL on GPUs), or use accelerator='cpu' with gloo."
        )


def _check_module(s: RunSettings, module) -> None:
    check_pipeline_contract(module)
    if s.partition == "time":  # 'time' measures the units on their device: checked when the split is made
        return
    spec, pp = s.schedule, s.mesh.pipeline_parallel_size
    units = list(module.pipeline_units())
    pieces = spec.virtual_stages(pp)
    if spec.chunks > 1 and len(units) < pieces:
        raise ValueError(
            f"Cannot split {len(units)} pipeline units into {pieces} pieces ({pp} stages x {spec.chunks} "
            f"chunks per stage for schedule {spec.name!r}): each piece needs a unit. Use fewer stages, a "
            "schedule with one chunk per stage ('zbh1', '1f1b'), or a model with more blocks."
        )
    partition_units(units, pieces, s.partition)
