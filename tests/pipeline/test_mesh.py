"""The pipeline x data-parallel mesh (``lightning_async.pipeline.mesh``): rank ``r`` is stage ``r % pp`` of replica
``r // pp``, the groups each rank belongs to, and the sizes that cannot tile the world (no processes)."""

from __future__ import annotations

import itertools

import pytest

from lightning_async.pipeline.mesh import PipelineGroups, PipelineMesh


def test_ranks_are_contiguous_pipelines_stage_then_replica():
    mesh = PipelineMesh(pipeline_parallel_size=3, data_parallel_size=2)
    assert mesh.world_size == 6
    assert [(mesh.stage_of(r), mesh.replica_of(r)) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [mesh.pipeline_ranks(replica) for replica in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [mesh.data_parallel_ranks(stage) for stage in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [mesh.tied_ranks(replica) for replica in range(2)] == [[0, 2], [3, 5]]


@pytest.mark.parametrize("pp, dp", [(1, 1), (1, 4), (4, 1), (2, 3), (3, 2)])
def test_rank_of_inverts_stage_and_replica(pp, dp):
    mesh = PipelineMesh(pp, dp)
    places = [(mesh.stage_of(r), mesh.replica_of(r)) for r in range(mesh.world_size)]
    assert sorted(places) == sorted(itertools.product(range(pp), range(dp)))  # every place once
    assert [mesh.rank_of(stage, replica) for stage, replica in places] == list(range(mesh.world_size))
    # the pipelines and the data-parallel groups each partition the world
    assert sorted(r for replica in range(dp) for r in mesh.pipeline_ranks(replica)) == list(range(pp * dp))
    assert sorted(r for stage in range(pp) for r in mesh.data_parallel_ranks(stage)) == list(range(pp * dp))


def test_one_stage_ties_the_rank_to_itself():
    assert PipelineMesh(1, 2).tied_ranks(1) == [1, 1]


@pytest.mark.parametrize("world, pp, dp, expected", [
    (4, None, None, (4, 1)),  # default: one replica
    (4, 2, None, (2, 2)),
    (6, None, 3, (2, 3)),
    (6, 3, 2, (3, 2)),
    (4, 0, None, (4, 1)),  # 0 counts as unset
    (1, None, None, (1, 1)),
])
def test_from_world_infers_the_unset_size(world, pp, dp, expected):
    mesh = PipelineMesh.from_world(world, pp, dp)
    assert (mesh.pipeline_parallel_size, mesh.data_parallel_size) == expected
    assert mesh.world_size == world


@pytest.mark.parametrize("world, pp, dp", [
    (4, 3, None),  # 3 stages cannot divide 4 processes
    (4, 8, None),  # more stages than processes
    (4, None, 3),  # replicas that do not divide the world
    (4, 2, 3),  # a product other than the world
    (6, 2, 2),
    (4, -2, None),
])
def test_from_world_refuses_sizes_that_cannot_tile_the_world(world, pp, dp):
    with pytest.raises(ValueError, match=rf"Cannot arrange {world} processes as pipeline_parallel_size={pp} x "
                                         rf"data_parallel_size={dp}\..*product is the number of processes"):
        PipelineMesh.from_world(world, pp, dp)


def test_a_ranks_groups_its_place_and_neighbours():
    mesh = PipelineMesh(3, 2)
    views = [PipelineGroups(mesh=mesh, rank=r) for r in range(6)]
    assert [(g.stage, g.replica) for g in views] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert all(g.num_stages == 3 and g.data_parallel_size == 2 and g.world_size == 6 for g in views)
    # neighbours stay inside the rank's own pipeline: rank 3 starts replica 1, rank 2 ends replica 0
    assert [(g.prev_rank, g.next_rank) for g in views] == [(None, 1), (0, 2), (1, None), (None, 4), (3, 5), (4, None)]
    assert views[4].stage_of_rank(5) == 2
    assert views[4].members("pipeline") == [3, 4, 5]
    assert views[4].members("data_parallel") == [1, 4]
    assert views[4].members("tied") == [3, 5]
    assert views[4].members("metrics") == list(range(6))


def test_a_single_process_is_one_stage_without_neighbours():
    groups = PipelineGroups()
    assert (groups.stage, groups.replica, groups.num_stages, groups.world_size) == (0, 0, 1, 1)
    assert groups.prev_rank is None and groups.next_rank is None
    assert groups.members("pipeline") == groups.members("data_parallel") == [0]
    assert groups.p2p is None and groups.data_parallel is None and groups.metrics is None
