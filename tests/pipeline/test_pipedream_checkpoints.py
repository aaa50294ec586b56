"""PipeDream's checkpoints (``checkpoint_format="dcp"``) through Lightning: stage ``s`` keeps ``p - s`` weight versions,
each saved by how many updates it lacks (``version/``, ``version2/``, ...), and a resume puts each one back where the
next batches read it.

One spawn of four processes: a 3-stage fit of 8 steps saving every 4 resumes from step 4 and ends on the uninterrupted
fit's weights and logged loss exactly (stage 0's three versions); a 2-stage fit's step-4 checkpoint resumes on
2 stages x 2 replicas with the sharded optimizer from the saved weights and optimizer state.
"""

from __future__ import annotations

import os
from functools import partial

import pytest

from _checkpoint_checks import assert_resume_equals, assert_starts_from
from _pipeline_harness import in_world, spawn
from lightning_async.pipeline import distributed_checkpoint as distributed

pytestmark = pytest.mark.slow  # starts processes


def _fit(stages: int, devices: int, **kwargs):
    from test_distributed_checkpoint import StartState
    from test_strategy import fit

    from lightning_async.strategies import AsyncPipelineStrategy

    strategy = AsyncPipelineStrategy(schedule="pipedream", pipeline_parallel_size=stages, n_microbatches=1,
                                     correction="ef", checkpoint_format="dcp", shard_optimizer=devices > stages)
    start = StartState()
    state, metrics = fit(strategy, devices, callbacks=[start], gradient_clip_val=None, tied=False, **kwargs)
    return state, metrics, start.weights, start.optimizer


def _runs(tmp: str) -> dict:
    import torch.distributed as dist

    os.environ["SPAWN_RANK"] = str(dist.get_rank())
    three, two = os.path.join(tmp, "p3"), os.path.join(tmp, "p2")
    return {
        "p3": in_world(3, partial(_fit, 3, 3, ckpt_dir=three)),
        "p3_resumed": in_world(3, partial(_fit, 3, 3, ckpt_path=os.path.join(three, "step=4.ckpt"))),
        "p2": in_world(2, partial(_fit, 2, 2, ckpt_dir=two)),
        "dp2_resumed": in_world(4, partial(_fit, 2, 4, ckpt_path=os.path.join(two, "step=4.ckpt"))),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pipedream-dcp"))
    return tmp, spawn(4, _runs, tmp, timeout=300)


def test_stage_zero_saves_its_versions_by_age(runs):
    tmp, _ = runs
    keys = distributed.saved_keys(os.path.join(tmp, "p3", "step=4.ckpt"))
    embed = [k for k in keys if k.endswith("model.embed.weight")]
    assert {k.split("/", 1)[0] for k in embed} >= {"model", "version", "version2"}  # stage 0: two steps stale
    head = {k.split("/", 1)[0] for k in keys if k.startswith(("model/", "version")) and "head" in k}
    assert head == {"model"}  # the last stage keeps one version


def test_a_three_stage_resume_ends_on_the_uninterrupted_fit(runs):
    assert_resume_equals(runs[1], "p3", "p3_resumed")


def test_two_replicas_start_from_the_saved_weights_and_optimizer_state(runs):
    tmp, per_rank = runs
    assert_starts_from(os.path.join(tmp, "p2", "step=4.ckpt"), per_rank, "dp2_resumed")
