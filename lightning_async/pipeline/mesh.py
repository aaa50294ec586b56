"""The pipeline x data-parallel mesh: which rank is which stage of which replica, and who talks to whom.

Rank ``r`` of ``world = pp x dp`` processes is stage ``r % pp`` of replica ``r // pp`` (replicas are contiguous
blocks of stages, so on one node a pipeline's neighbours are neighbouring ranks). :class:`PipelineMesh` is the
one place that says so (the strategy, the process groups, the runtime's error messages and the test harness all
ask it); :class:`PipelineGroups` is one rank's view: its process groups and its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineMesh:
    """Sizes of the mesh and the rank arithmetic (like torchtitan's ``ParallelDims``, for two dimensions)."""

    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @classmethod
    def from_world(cls, world_size: int, pipeline_parallel_size: int | None = None,
                   data_parallel_size: int | None = None) -> "PipelineMesh":
        """The mesh of ``world_size`` processes; unset sizes are inferred (default: one replica). A clear error
        names the fix when the sizes cannot tile the world."""
        pp = pipeline_parallel_size or world_size // (data_parallel_size or 1)
        if pp < 1 or world_size % pp or (data_parallel_size and pp * data_parallel_size != world_size):
            raise ValueError(
                f"Cannot arrange {world_size} processes as pipeline_parallel_size={pipeline_parallel_size} x "
                f"data_parallel_size={data_parallel_size}. Choose sizes whose product is the number of processes "
                f"(devices x nodes = {world_size})."
            )
        return cls(pp, world_size // pp)

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank % self.pipeline_parallel_size

    def replica_of(self, rank: int) -> int:
        return rank // self.pipeline_parallel_size

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.pipeline_parallel_size + stage

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The stages of one replica, first to last."""
        return [self.rank_of(s, replica) for s in range(self.pipeline_parallel_size)]

    def data_parallel_ranks(self, stage: int) -> list[int]:
        """The same stage in every replica."""
        return [self.rank_of(stage, r) for r in range(self.data_parallel_size)]

    def tied_ranks(self, replica: int) -> list[int]:
        """First and last stage of a replica (the only stages that may share weights: tied embeddings)."""
        return [self.rank_of(0, replica), self.rank_of(self.pipeline_parallel_size - 1, replica)]


@dataclass
class PipelineGroups:
    """One rank's place in the mesh and its process groups (all ``None`` on a single process)."""

    mesh: PipelineMesh = PipelineMesh()
    rank: int = 0  # global rank of this process
    p2p: object = None  # sends/receives along this rank's pipeline
    pipeline: object = None  # collectives of this pipeline's stages (global gradient norm)
    data_parallel: object = None  # this stage across replicas (gradient averaging)
    weight_gather: object = None  # the same ranks, for the sharded optimizer's new weights (pipeline/sharding.py)
    tied: object = None  # first and last stage, when they share weights
    metrics: object = None  # every rank (loss reporting)

    @property
    def stage(self) -> int:
        return self.mesh.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.mesh.replica_of(self.rank)

    @property
    def num_stages(self) -> int:
        return self.mesh.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data_parallel_size

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def prev_rank(self) -> int | None:
        return self.rank - 1 if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        return self.rank + 1 if self.stage < self.num_stages - 1 else None

    def stage_of_rank(self, rank: int) -> int:
        return self.mesh.stage_of(rank)

    def members(self, kind: str) -> list[int]:
        """Global ranks of this process's ``pipeline``, ``tied``, ``data_parallel`` or ``metrics`` group."""
        if kind == "pipeline":
            return self.mesh.pipeline_ranks(self.replica)
        if kind == "tied":
            return self.mesh.tied_ranks(self.replica)
        if kind == "data_parallel":
            return self.mesh.data_parallel_ranks(self.stage)
        return list(range(self.world_size))
