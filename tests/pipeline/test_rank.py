"""The one rank builder: ``plan_rank`` decides what a rank holds before any group exists, ``build`` makes it."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from torch import nn

from _pipeline_harness import make_model
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.pipeline.rank import build, plan_rank
from lightning_async.pipeline.stage import NotOnThisStage

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _units():
    return [(f"model.{n}", u) for n, u in make_model().pipeline_units()]


def test_plans_of_every_rank_cover_the_model_once_and_pair_the_tied_embedding():
    units = _units()
    plans = [plan_rank(units, "1f1b", 4, rank=r, world_size=3) for r in range(3)]
    names = [n for plan in plans for n, _ in plan.named_parameters]
    model_params = {id(p) for _, u in units for p in u.parameters()}
    assert len(names) == len(set(names))
    assert {id(p) for plan in plans for _, p in plan.named_parameters} == model_params
    # the embedding (stage 0) and the head (stage 2) share one weight; the middle stage shares nothing
    assert len(plans[0].tied) == len(plans[2].tied) == 1 and plans[1].tied == []
    assert [plan.stage for plan in plans] == [0, 1, 2]


def test_plan_refuses_what_no_rank_could_run_before_any_group_is_made():
    units = _units()
    with pytest.raises(ValueError, match="needs at least as many micro-batches"):
        plan_rank(units, "1f1b", 2, rank=0, world_size=4)
    with pytest.raises(ValueError, match="Cannot arrange 6 processes"):
        plan_rank(units, "1f1b", 8, rank=0, world_size=6, pipeline_parallel_size=4)
    with pytest.raises(ValueError, match="runs 2 pieces, but stage_units lists 3"):
        plan_rank(units, "1f1b", 4, rank=0, world_size=2, stage_units=[[n] for n, _ in units[:3]])


def test_prune_leaves_only_the_ranks_units_in_the_module():
    model = make_model()
    units = [(f"model.{n}", u) for n, u in model.pipeline_units()]
    holder = nn.Module()
    holder.model = model
    plan = plan_rank(units, "1f1b", 2, rank=1, world_size=2)
    plan.prune(holder, units)
    kept = {id(p) for p in holder.parameters()}
    assert kept == {id(p) for _, p in plan.named_parameters}
    assert any(isinstance(m, NotOnThisStage) for m in holder.modules())


def test_an_optimizer_over_weights_the_rank_does_not_run_is_refused():
    units = _units()
    plan = plan_rank(units, "1f1b", 2, rank=0, world_size=2)
    everything = torch.optim.SGD(list({id(p): p for _, u in units for p in u.parameters()}.values()), lr=0.1)
    with pytest.raises(ValueError, match=r"holds a parameter .* that this stage does not run.*RankPlan.named_parameters"):
        build(plan, everything, split_next_token, next_token_loss)


def test_nothing_but_the_builder_constructs_a_runtime():
    """The strategy, the harness and the benchmarks must all go through ``pipeline.rank.build``."""
    offenders = []
    for path in [*ROOT.glob("lightning_async/**/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/**/*.py")]:
        if path.name in ("rank.py", "test_rank.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bPipelineRuntime\(", line) and not line.lstrip().startswith(("#", "*", "-", '"')):
                offenders.append(f"{path.relative_to(ROOT)}:{number}")
    assert offenders == []
