"""PipeDream with weight stashing as a real schedule: the pipeline follows the ``pipedream`` delay profile exactly.

Stage ``s`` of ``p`` is ``p - 1 - s`` steps stale and keeps ``p - s`` weight versions. The single-device reference
is ``DelayedOptimizer(pairing="2bw")`` with the profile's per-parameter delays (what ``DelaySimulation(profile=
"pipedream")`` runs). One spawn of four processes runs every scenario (2, 3 and 4 stages, 2 stages x 2 replicas
with the sharded optimizer, NCCL's matching rules), one micro-batch per batch (PipeDream's update after every
micro-batch, the warm-up over several calls) and two; a drain (evaluation) and a shape change (a drain and a fresh
warm-up) mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import pytest
import torch

from _pipeline_harness import (
    UNTIED, assert_same_bits, each_in_its_world, merged_weights, pipeline_run, plan_rank, reference_run, spawn,
    worst_difference,
)
from lightning_async.pipeline.rank import build
from lightning_async.pipeline.schedules import spec

pytestmark = pytest.mark.slow  # starts processes

STEPS = 10
TOLERANCE = 2e-5  # as the oracle matrix (float32, summation order)


@dataclass(frozen=True)
class Run:
    stages: int
    optimizer: str
    m: int = 1
    ef: float = 0.0
    replicas: int = 1
    drain_after: tuple[int, ...] = ()
    transport: str = "auto"

    @property
    def world(self) -> int:
        return self.stages * self.replicas


RUNS = [
    Run(2, "adamw", drain_after=(2,)),
    Run(2, "muon", ef=1.0),
    Run(3, "adamw", drain_after=(3,)),
    Run(3, "lion", ef=1.0),  # the k-step EF: stage 0 is two steps stale
    Run(3, "adamw", drain_after=(3,), transport="nccl-rules"),  # twin of RUNS[2] under NCCL's matching rules
    Run(4, "muon", m=2, drain_after=(2,)),  # fewer micro-batches than stage 0's warm-up forwards (3)
    Run(2, "adamw", replicas=2, drain_after=(4,)),  # 2 stages x 2 replicas, sharded optimizer
]


def _run(run: Run):
    return pipeline_run(run.stages, "pipedream", run.optimizer, run.ef, STEPS, None, m=run.m, drain_at=run.drain_after,
                        prepost=False if run.transport == "nccl-rules" else None, workload=UNTIED,
                        shard_optimizer=run.replicas > 1, transport=run.transport)


@pytest.fixture(scope="module")
def results():
    return spawn(4, each_in_its_world, _run, RUNS, attrgetter("world"))


def _merged(results, index: int, replica: int = 0) -> dict[str, torch.Tensor]:
    return merged_weights(results, index, RUNS[index].stages, replica)


def _reference(run: Run, profile: str | None = "pipedream", delay: int = 1) -> dict[str, torch.Tensor]:
    return reference_run(run.optimizer, delay, run.ef, STEPS, None, microbatches=run.m * run.replicas, workload=UNTIED,
                         profile=profile, stages=run.stages)


def test_pipedream_follows_its_single_device_rule(results):
    for index, run in enumerate(RUNS):
        reference = _reference(run)
        for replica in range(run.replicas):
            weights = _merged(results, index, replica)
            assert set(weights) == set(reference)
            assert worst_difference(weights, reference) < TOLERANCE, f"{run}, replica {replica}: {worst_difference(weights, reference)}"


def test_nccl_rules_train_to_the_same_bits(results):
    assert_same_bits(results, 4, 2, ranks=3)


def test_negative_control_a_uniform_delay_is_another_rule(results):
    """Without per-stage delays (2BW's one step everywhere) the reference differs: the test can fail."""
    for index in (0, 2):
        run = RUNS[index]
        assert worst_difference(_merged(results, index), _reference(run, profile=None, delay=1)) > 1e-4


def test_stages_keep_p_minus_s_versions_and_every_rank_reports_the_same_losses(results):
    for index, run in enumerate(RUNS):
        per_rank = [results[rank][index] for rank in range(run.world)]
        versions = [r[4]["weight_versions"] / r[4]["parameters"] for r in per_rank[: run.stages]]
        assert versions == [run.stages - s for s in range(run.stages)], f"{run}: {versions}"
        losses = [r[1] for r in per_rank]
        assert all(x == losses[0] for x in losses)
        values = [x for x in losses[0] if x is not None]
        assert len(values) >= STEPS - run.stages + 1 and all(2.0 < x < 7.0 for x in values)


def _plan(stages: int, tied: bool):
    from _pipeline_harness import make_model, make_untied_model

    model = (make_model if tied else make_untied_model)()
    units = [(f"model.{n}", u) for n, u in model.pipeline_units()]
    return units, lambda rank=0: plan_rank(units, "pipedream", 1, rank=rank, world_size=stages)


def test_tied_weights_are_refused_before_any_group():
    _, plan = _plan(3, tied=True)
    for rank in range(3):  # every rank alike, the middle one (which holds no tied weight) too
        with pytest.raises(ValueError, match=r"Schedule 'pipedream' gives pieces \[0, 2\] different delays .*tie_embeddings=False"):
            plan(rank)


def test_global_clipping_is_refused_before_any_group():
    _, plan = _plan(2, tied=False)
    p = plan(1)
    optimizer = torch.optim.SGD([t for _, t in p.named_parameters], lr=0.1)
    with pytest.raises(ValueError, match=r"Gradient clipping by the global norm .* \(gradient_clip_val=None\)"):
        build(p, optimizer, lambda b: b, lambda y, t: y, gradient_clip_val=1.0)


def test_the_schedule_is_delayed_per_stage():
    s = spec("pipedream")
    assert s.delayed and not s.uniform_delay
    assert [c.delay for c in s.clock(4).pieces] == [3, 2, 1, 0] and s.clock(4).loss_lag == 3


def test_a_pipeline_run_is_recorded_as_its_one_device_rule():
    """The run identity's delay and profile of a pipeline run equal those ``DelaySimulation`` records for the same
    rule, so ``compare`` and ``study`` pair them."""
    from lightning_async.pipeline import profiles

    assert spec("pipedream").recorded_delay(4) == (3, profiles.describe("pipedream", 4, 1))
    assert spec("paci").recorded_delay(4) == (1, profiles.describe("paci", 4, 1))
    assert spec("2bw").recorded_delay(4) == (1, "uniform") and spec("1f1b").recorded_delay(4) == (0, "uniform")
