"""The pipeline's parameter line: the model's count and each stage's, not rank 0's stage as the model's."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_async.lm import CausalLM
from lightning_async.pipeline import schedules
from lightning_async.pipeline.partition import partition_units
from lightning_async.strategies.summary import log_parameter_counts, parameter_counts


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_model_and_every_stage_are_counted():
    module = CausalLM(model="tiny", vocab_size=257)
    units = list(module.pipeline_units())
    stage_units = partition_units(units, 2, "uniform")
    spec = schedules.spec("2bw")
    total, per_stage = parameter_counts(module, units, stage_units, lambda piece: spec.holder(piece, 2)[0])
    assert total == _numel(module) and 800_000 < total < 850_000  # the README's 0.8 M, not stage 0's 426 K
    by_name = dict(units)
    assert per_stage == [sum(_numel(by_name[n]) for n in names) for names in stage_units]
    assert per_stage[0] < total and sum(per_stage) >= total

    strategy = SimpleNamespace(pipeline_parallel_size=2, stage_units=stage_units, schedule_spec=spec)
    line = log_parameter_counts(strategy, module, units)
    assert line.startswith(f"parameters: {total // 1000} K in the model; stage 0 {per_stage[0] // 1000} K, stage 1 ")


def test_v_placement_puts_the_first_and_last_piece_on_stage_0():
    """ZB-V: 2 stages, 4 pieces; stage 0 holds pieces 0 and 3, the embedding and the head, whose tied weight it
    counts once."""
    module = CausalLM(model="tiny", vocab_size=257)
    units = list(module.pipeline_units())
    stage_units = partition_units(units, 4, "uniform")
    spec = schedules.spec("zbv")
    _, per_stage = parameter_counts(module, units, stage_units, lambda piece: spec.holder(piece, 2)[0])
    by_name = dict(units)
    piece = [sum(_numel(by_name[n]) for n in names) for names in stage_units]
    head, embed = module.model.head.proj.weight, module.model.embed.weight
    tied = head.numel() if head is embed else 0
    assert tied and per_stage == [piece[0] + piece[3] - tied, piece[1] + piece[2]]


def test_the_memory_line_says_pipeline_not_the_strategy_name(monkeypatch):
    """The memory lines of every schedule (the 1F1B baseline's too) read ``pipeline memory``, as the setup line
    reads ``pipeline: schedule=..., mode=...``: not ``async_pipe``, the strategy's registry name."""
    from lightning_async.strategies import memory_log

    printed = []
    monkeypatch.setattr(memory_log, "rank_zero_info", printed.append)
    logged = {}
    logger = SimpleNamespace(log_metrics=logged.update)
    reports = [{"stage": s, "replica": r, "parameters": 2**20, "in_flight_microbatches": 3} for s in (0, 1) for r in (0, 1)]
    memory_log.log_memory_reports(reports, logger)
    assert printed == ["pipeline memory, stage 0: parameters 1.0 MiB", "pipeline memory, stage 1: parameters 1.0 MiB"]
    assert logged == {"train/memory/stage0/parameters_mib": 1.0, "train/memory/stage1/parameters_mib": 1.0}
