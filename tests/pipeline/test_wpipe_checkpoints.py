"""WPipe's checkpoints through Lightning: each chunk's weight versions saved on their own (G0 two, by age; G1 one),
and a resume puts each back where the next batches read it.

One spawn of four processes: a 2-stage fit of 8 steps (m = 2, EF on G0) saving every 4 in DCP and in the per-stage files (torch.save)
format; both resume from step 4 and end on the uninterrupted fit's weights and logged loss; the DCP checkpoint
resumes on 2 stages x 2 replicas (the sharded optimizer) from the saved weights and optimizer state.
"""

from __future__ import annotations

import os
from functools import partial

import pytest

from _checkpoint_checks import assert_resume_equals, assert_starts_from
from _pipeline_harness import in_world, spawn
from lightning_async.pipeline import distributed_checkpoint as distributed

pytestmark = pytest.mark.slow  # starts processes


def _fit(devices: int, checkpoint_format: str = "dcp", **kwargs):
    from test_distributed_checkpoint import StartState
    from test_strategy import fit

    from lightning_async.strategies import AsyncPipelineStrategy

    strategy = AsyncPipelineStrategy(schedule="wpipe", pipeline_parallel_size=2, n_microbatches=2, correction="ef",
                                     checkpoint_format=checkpoint_format, shard_optimizer=devices > 2)
    start = StartState()
    state, metrics = fit(strategy, devices, callbacks=[start], gradient_clip_val=None, tied=False, **kwargs)
    return state, metrics, start.weights, start.optimizer


def _runs(tmp: str) -> dict:
    import torch.distributed as dist

    os.environ["SPAWN_RANK"] = str(dist.get_rank())
    dcp, stages = os.path.join(tmp, "dcp"), os.path.join(tmp, "stages")
    return {
        "dcp": in_world(2, partial(_fit, 2, ckpt_dir=dcp)),
        "dcp_resumed": in_world(2, partial(_fit, 2, ckpt_path=os.path.join(dcp, "step=4.ckpt"))),
        "stages": in_world(2, partial(_fit, 2, "stages", ckpt_dir=stages)),
        "stages_resumed": in_world(2, partial(_fit, 2, "stages", ckpt_path=os.path.join(stages, "step=4.ckpt"))),
        "dp2_resumed": in_world(4, partial(_fit, 4, ckpt_path=os.path.join(dcp, "step=4.ckpt"))),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("wpipe-ckpt"))
    return tmp, spawn(4, _runs, tmp, timeout=300)


def test_g0_saves_two_versions_and_g1_one(runs):
    tmp, _ = runs
    keys = distributed.saved_keys(os.path.join(tmp, "dcp", "step=4.ckpt"))
    prefixes = lambda unit: {k.split("/", 1)[0] for k in keys if k.startswith(("model/", "version")) and unit in k}
    assert prefixes("model.embed.") == {"model", "version"}  # piece 0: G0, one step stale
    assert prefixes("model.head.") == {"model"}  # the last piece: G1, current


@pytest.mark.parametrize("fmt", ["dcp", "stages"])
def test_a_resume_ends_on_the_uninterrupted_fit(runs, fmt):
    assert_resume_equals(runs[1], fmt, f"{fmt}_resumed")


def test_two_replicas_start_from_the_saved_weights_and_optimizer_state(runs):
    tmp, per_rank = runs
    assert_starts_from(os.path.join(tmp, "dcp", "step=4.ckpt"), per_rank, "dp2_resumed")
