"""The checks a pipeline run's settings must pass before any process group exists (raised alike on every rank).

Everything here needs no communication: the mesh tiles the world, the schedule takes the stages and
micro-batches, FSDP and the sharded optimizer have replicas to shard over, the backend fits the device and
(on NCCL, which matches messages by posting order, and under ``transport="nccl-rules"``, which keeps that rule
on gloo: :func:`check_message_order`) the lowered programs post their messages in matching order and finish, and the
module has enough units for the schedule's pieces. Each error names the fix.
"""

from __future__ import annotations

from lightning_async.pipeline.contract import check_pipeline_contract
from lightning_async.pipeline.fsdp import check_fsdp_applicable
from lightning_async.pipeline.p2p import check_transport
from lightning_async.pipeline.partition import partition_units
from lightning_async.pipeline.program import lower_all, message_order_mismatches, stuck


def check_run(config, world_size: int, backend: str | None = None, device_type: str = "cpu", module=None) -> None:
    """Raise ``ValueError`` (naming the fix) for a run of ``config`` (a :class:`~lightning_async.pipeline.config.PipelineConfig`)
    on ``world_size`` processes that the pipeline cannot run; ``backend``: the process-group backend asked for
    (``None``: the device's default); ``module`` (the LightningModule, if known) must also fit the pipeline contract
    and the schedule's pieces."""
    mesh = config.mesh(world_size)
    pp, m = mesh.pipeline_parallel_size, config.microbatches(mesh.pipeline_parallel_size)
    if config.shard_optimizer and mesh.data_parallel_size < 2:
        raise ValueError(
            f"shard_optimizer=True shards the optimizer state over data-parallel replicas, but this run has one "
            f"replica ({mesh.world_size} processes = {pp} stages x 1). Use processes = stages x replicas with "
            "data_parallel_size > 1 (e.g. devices=4, pipeline_parallel_size=2), or set shard_optimizer=False."
        )
    config.schedule.validate(pp, m)
    if config.fsdp:
        check_fsdp_applicable(config.schedule, mesh.data_parallel_size, config.shard_optimizer, config.activation_checkpointing)
    _check_backend(config.schedule, pp, m, config.transport, backend, device_type)
    if module is not None:
        _check_module(config.schedule, pp, config.partition, module)


def _check_backend(spec, pp: int, n_microbatches: int, transport: str, backend: str | None, device_type: str) -> None:
    check_message_order(spec, pp, n_microbatches, transport, backend, device_type)
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(
            "process_group_backend='nccl' needs CUDA tensors, but this run is on the CPU. "
            "Use accelerator='gpu', or process_group_backend='gloo' on CPUs."
        )
    if backend == "gloo" and device_type == "cuda":
        raise ValueError(
            "process_group_backend='gloo' cannot send CUDA tensors between pipeline stages. Leave "
            "process_group_backend unset (NCCL on GPUs), or use accelerator='cpu' with gloo."
        )


def check_message_order(
    spec, stages: int, n_microbatches: int, transport: str = "auto", backend: str | None = None, device_type: str = "cpu",
    lists=None,
) -> None:
    """Refuse a schedule whose lowered programs (sends ordered for NCCL by ``program.order_sends``) post a pair's
    messages in different orders at its two ends, or wait on each other, where messages are matched in posting
    order: on NCCL (no tags) and under ``transport="nccl-rules"`` (tag 0 on gloo). Every built-in schedule passes
    (ZB-V since its sends are ordered); what is left to refuse is an action list no order of sends can match (a
    message one end never posts) or one whose ranks would wait on each other. Needs no communication (the
    schedule's action lists; ``lists``: others, for tests), so every rank raises alike, before any group is made."""
    nccl = backend == "nccl" or device_type == "cuda"
    if stages < 2 or not (nccl or check_transport(transport) == "nccl-rules"):
        return
    if lists is None:  # (a delayed schedule: three calls, to reach the steady state of its stream)
        lists = [spec.run_actions(r, stages, n_microbatches, 3 if spec.delayed else 1) for r in range(stages)]
    where = "NCCL (no tags)" if nccl else "transport='nccl-rules' (tag 0 everywhere, as on NCCL)"
    others = ("Use another schedule (every built-in one is ordered for NCCL but 'wpipe' on 2 stages: there one pair of "
              "ranks carries both chunks' activations and gradients, whose order the stream interleaves), or 3+ stages")
    fix = f"{others}, or run it on CPUs (gloo)" if nccl else f"{others}, or transport='auto' on gloo (its tags match any order)"
    mismatches = message_order_mismatches(spec, lists, per_channel=False)
    if mismatches:
        raise ValueError(
            f"Schedule {spec.name!r} sends messages between two stages in another order than the receiver "
            f"posts them, which {where} cannot match. {fix}. The first pair that disagrees:\n" + mismatches[0]
        )
    waits = stuck(spec, lower_all(spec, lists))
    if waits:
        raise ValueError(
            f"Schedule {spec.name!r} posts its messages in matching order, but its stages would wait on each other "
            f"under {where}: {waits}. {fix}."
        )


def _check_module(spec, pp: int, partition, module) -> None:
    check_pipeline_contract(module)
    if partition == "time":  # 'time' measures the units on their device: checked when the split is made
        return
    units = list(module.pipeline_units())
    pieces = spec.virtual_stages(pp)
    if spec.chunks > 1 and len(units) < pieces:
        raise ValueError(
            f"Cannot split {len(units)} pipeline units into {pieces} pieces ({pp} stages x {spec.chunks} "
            f"chunks per stage for schedule {spec.name!r}): each piece needs a unit. Use fewer stages, a "
            "schedule with one chunk per stage ('zbh1', '1f1b'), or a model with more blocks."
        )
    partition_units(units, pieces, list(partition) if not isinstance(partition, str) else partition)
