"""PipelineConfig: the strategy's arguments in one typed object, validated once; what the strategy reads."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch import nn

from lightning_async.pipeline.config import PipelineConfig
from lightning_async.pipeline.rank import plan_rank
from lightning_async.strategies import AsyncPipelineStrategy


@pytest.mark.parametrize("arguments, message", [
    (dict(schedule="2bx"), "Unknown pipeline schedule '2bx'"),
    (dict(n_microbatches=0), "n_microbatches must be a positive integer"),
    (dict(pipeline_parallel_size=1.5), "pipeline_parallel_size must be a positive integer"),
    (dict(checkpoint_format="zip"), "checkpoint_format must be 'stages'"),
    (dict(timeout=-1), "timeout must be a positive number of seconds"),
    (dict(schedule="1f1b", correction="ef"), "schedule '1f1b' is synchronous"),
    (dict(schedule="1f1b", virtual_stages=2), "applies to schedule 'interleaved' only"),
    (dict(transport="nccl"), "transport"),
])
def test_bad_arguments_are_refused_when_the_config_is_built(arguments, message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig.of(**arguments)
    with pytest.raises(ValueError, match=message):  # the strategy builds one: the same error, at construction
        AsyncPipelineStrategy(**arguments)


def test_defaults_follow_from_the_world():
    config = PipelineConfig.of("2bw", timeout=30)
    assert config.timeout == timedelta(seconds=30) and config.checkpoint_format == "stages"
    mesh = config.mesh(6)
    assert (mesh.pipeline_parallel_size, mesh.data_parallel_size) == (6, 1)
    assert config.microbatches(6) == 12
    replicated = PipelineConfig.of("1f1b", pipeline_parallel_size=2, n_microbatches=3)
    assert replicated.mesh(6).data_parallel_size == 3 and replicated.microbatches(2) == 3


def test_world_checks_run_before_any_group():
    with pytest.raises(ValueError, match=r"n_microbatches=1 < 2 stages"):
        PipelineConfig.of("1f1b", n_microbatches=1).check(2)
    with pytest.raises(ValueError, match="shard_optimizer=True shards the optimizer state"):
        PipelineConfig.of("2bw", shard_optimizer=True).check(2)
    PipelineConfig.of("zbv").check(2, backend="nccl", device_type="cuda")  # its sends ordered for NCCL: accepted
    PipelineConfig.of("zbv").check(2)  # gloo matches by tag: fine
    PipelineConfig.of("zbv", n_microbatches=4, transport="nccl-rules").check(2)  # NCCL's rules on gloo: accepted too
    with pytest.raises(ValueError, match="process_group_backend='nccl' needs CUDA tensors"):
        PipelineConfig.of("zbv").check(2, backend="nccl")


def test_the_strategy_reads_its_config():
    strategy = AsyncPipelineStrategy(schedule="interleaved", virtual_stages=3, n_microbatches=4, partition=["b", "c"],
                                     fsdp=True, checkpoint_format="dcp", timeout=12)
    config = strategy.config
    assert strategy.schedule_spec is config.schedule and strategy.schedule == "interleaved" and config.schedule.chunks == 3
    assert (strategy.fsdp, strategy.checkpoint_format, strategy.partition) == (True, "dcp", ("b", "c"))
    assert strategy._timeout == timedelta(seconds=12)
    assert config.runtime_options(training=True)["fsdp"] is True


def test_plan_rank_of_the_config_equals_the_direct_plan():
    units = [(f"u{i}", nn.Linear(2, 2)) for i in range(4)]
    config = PipelineConfig.of("1f1b", pipeline_parallel_size=2, n_microbatches=4)
    planned = config.plan_rank(units, rank=3, world_size=4)
    direct = plan_rank(units, "1f1b", 4, rank=3, world_size=4, pipeline_parallel_size=2)
    assert (planned.stage, planned.stage_units, planned.n_microbatches) == (direct.stage, direct.stage_units, 4)
    assert planned.mesh.data_parallel_size == 2
