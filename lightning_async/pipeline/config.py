"""``PipelineConfig``: every setting of a pipeline run in one typed object, validated once.

The strategy's arguments (``AsyncPipelineStrategy(schedule=..., n_microbatches=..., ...)``, also what the CLI's
``--trainer.strategy`` section sets) become one of these; the strategy, the launch checks
(:func:`~lightning_async.pipeline.run_checks.check_run`), :func:`~lightning_async.pipeline.rank.plan_rank` and the
runtime's options read it instead of each re-reading and re-checking the arguments. What can be checked without
knowing the processes is checked when it is built (a bad name, type or combination raises ``ValueError`` naming
the fix); what needs the world size (the mesh, micro-batches against stages, the backend) is checked by
:meth:`PipelineConfig.check` before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from lightning_async.optim.corrections import Correction, as_correction, check_applicable
from lightning_async.pipeline import schedules
from lightning_async.pipeline.mesh import PipelineMesh
from lightning_async.pipeline.p2p import check_transport

CHECKPOINT_FORMATS = ("stages", "dcp")


def checked_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """``timeout`` as a ``timedelta``; a clear error for a value that is not a positive duration."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if timeout is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0):
        raise ValueError(
            f"timeout must be a positive number of seconds (how long a stage waits for another before it gives up), "
            f"got {seconds!r}."
        )
    return None if timeout is None else timedelta(seconds=seconds)


def _positive_or_none(value, name: str) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive integer (or unset), got {value!r}.")
    return value


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline run's settings (see :class:`~lightning_async.strategies.AsyncPipelineStrategy` for each one).

    Build it with :meth:`of` from the strategy's arguments (names, numbers, ``None`` for the defaults).
    """

    schedule: schedules.ScheduleSpec = field(default_factory=lambda: schedules.spec("2bw"))
    n_microbatches: int | None = None  # None: 2 x stages
    pipeline_parallel_size: int | None = None  # None: every process
    data_parallel_size: int | None = None
    partition: str | tuple[str, ...] = "uniform"
    correction: str | dict | Correction | None = None  # the setting (built per rank by make_correction)
    activation_checkpointing: bool = False
    shard_optimizer: bool = False
    fsdp: bool = False
    checkpoint_format: str = "stages"
    timeout: timedelta | None = timedelta(seconds=300)
    transport: str = "auto"  # or "nccl-rules": NCCL's matching rules on gloo

    @classmethod
    def of(cls, schedule: "str | schedules.ScheduleSpec" = "2bw", virtual_stages: int | None = None,
           timeout: timedelta | float | None = 300, partition: str | list[str] = "uniform", **settings) -> "PipelineConfig":
        """The configuration of the strategy's arguments (``schedule`` a name, ``timeout`` in seconds...)."""
        if not isinstance(partition, str):
            partition = tuple(partition)
        return cls(schedules.spec(schedule, virtual_stages), timeout=checked_timeout(timeout), partition=partition,
                   **settings)

    def __post_init__(self) -> None:
        _positive_or_none(self.n_microbatches, "n_microbatches")
        _positive_or_none(self.pipeline_parallel_size, "pipeline_parallel_size")
        _positive_or_none(self.data_parallel_size, "data_parallel_size")
        for name in ("activation_checkpointing", "shard_optimizer", "fsdp"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be 'stages' (a file per stage) or 'dcp' "
                             f"(torch.distributed.checkpoint, moves between layouts), got {self.checkpoint_format!r}.")
        check_transport(self.transport)
        check_applicable(as_correction(self.correction), schedule=self.schedule)  # a bad name or schedule: now

    # ---- what follows from the world ------------------------------------------------------------
    def mesh(self, world_size: int) -> PipelineMesh:
        """The pipeline x data-parallel mesh of ``world_size`` processes (a clear error if the sizes do not fit)."""
        return PipelineMesh.from_world(world_size, self.pipeline_parallel_size, self.data_parallel_size)

    def microbatches(self, num_stages: int) -> int:
        """Micro-batches per batch on ``num_stages`` stages (default: twice the stages)."""
        return self.n_microbatches or 2 * num_stages

    def check(self, world_size: int, backend: str | None = None, device_type: str = "cpu", module=None) -> None:
        """Every check of the run that needs the world but no communication (``check_run``), the same on every
        rank: raised before any process group exists."""
        from lightning_async.pipeline.run_checks import check_run

        check_run(self, world_size, backend=backend, device_type=device_type, module=module)

    # ---- what the rank is built from -----------------------------------------------------------
    def plan_rank(self, units, rank: int, world_size: int, stage_units=None, tied=None):
        """:func:`~lightning_async.pipeline.rank.plan_rank` of this configuration for process ``rank``."""
        from lightning_async.pipeline.rank import plan_rank

        mesh = self.mesh(world_size)
        partition = self.partition if isinstance(self.partition, str) else list(self.partition)
        return plan_rank(units, self.schedule, self.microbatches(mesh.pipeline_parallel_size), rank=rank,
                         world_size=world_size, pipeline_parallel_size=mesh.pipeline_parallel_size,
                         stage_units=stage_units, partition=partition, tied=tied)

    def runtime_options(self, training: bool) -> dict:
        """The runtime's options this configuration sets (``training``: a fit, where the optimizer is sharded)."""
        return dict(activation_checkpointing=self.activation_checkpointing, fsdp=self.fsdp,
                    shard_optimizer=self.shard_optimizer and training, timeout=self.timeout, transport=self.transport)

