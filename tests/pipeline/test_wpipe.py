"""WPipe as a real schedule: the pipeline follows the ``wpipe`` delay profile exactly.

Rank ``s`` holds pieces ``s`` (chunk 0, the first half G0) and ``p + s`` (chunk 1, G1). Each chunk updates on its
own once per batch: G0 one step stale with two versions, G1 in place between its backwards of a batch and its
forwards of the next, so ``g(t) = grad f_t(A(t - 1), B(t))``. The single-device reference is
``DelayedOptimizer(pairing="2bw")`` with the profile's per-parameter delays (what ``DelaySimulation(profile=
"wpipe", stages=p)`` runs): the first ``p`` of ``2p`` pieces one step stale, the rest current. One spawn of four
processes runs every scenario: 1 to 4 stages, ``m = p`` (the reference's) and ``m = 2p``, AdamW, Muon and Lion (EF
where G0 is delayed), 2 stages x 2 replicas with the sharded optimizer, NCCL's matching rules; a drain (evaluation) and a shape change (a drain
and a fresh warm-up) mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from operator import attrgetter

import pytest
import torch

from _pipeline_harness import (
    UNTIED, assert_same_bits, each_in_its_world, make_batches, make_deep_model, merged_weights, pipeline_run,
    reference_run, spawn, worst_difference,
)
from lightning_async.pipeline.schedules import call_actions, spec, wpipe_stream

pytestmark = pytest.mark.slow  # starts processes

STEPS = 10
TOLERANCE = 2e-5  # as the oracle matrix (float32, summation order)
TWELVE_ROWS = replace(UNTIED, make_batches=partial(make_batches, batch_size=12))  # (m = 3, 6 divide it)
DEEP_UNTIED = replace(UNTIED, make_model=partial(make_deep_model, tie_embeddings=False))  # 8 units: 4 stages x 2


@dataclass(frozen=True)
class Run:
    stages: int
    optimizer: str
    m: int
    ef: float = 0.0
    replicas: int = 1
    drain_after: tuple[int, ...] = ()
    transport: str = "auto"
    workload: object = UNTIED

    @property
    def world(self) -> int:
        return self.stages * self.replicas


RUNS = [
    Run(2, "adamw", m=2, drain_after=(2,)),  # the reference's m = p
    Run(2, "muon", m=4, ef=1.0),  # m = 2p, EF on G0
    Run(3, "adamw", m=3, drain_after=(3,), workload=TWELVE_ROWS),
    Run(3, "lion", m=6, ef=1.0, workload=TWELVE_ROWS),
    Run(3, "adamw", m=3, drain_after=(3,), workload=TWELVE_ROWS, transport="nccl-rules"),  # twin of RUNS[2]
    Run(4, "adamw", m=4, drain_after=(2,), workload=DEEP_UNTIED),
    Run(2, "adamw", m=2, replicas=2, drain_after=(4,)),  # 2 stages x 2 replicas, sharded optimizer
    Run(1, "muon", m=2),  # one rank holds both halves: G0 hands over to G1 on the rank
]


def _run(run: Run):
    return pipeline_run(run.stages, "wpipe", run.optimizer, run.ef, STEPS, None, m=run.m, drain_at=run.drain_after,
                        prepost=False if run.transport == "nccl-rules" else None, workload=run.workload,
                        shard_optimizer=run.replicas > 1, transport=run.transport)


@pytest.fixture(scope="module")
def results():
    return spawn(4, each_in_its_world, _run, RUNS, attrgetter("world"))


def _merged(results, index: int, replica: int = 0) -> dict[str, torch.Tensor]:
    return merged_weights(results, index, RUNS[index].stages, replica)


def _reference(run: Run, profile: str | None = "wpipe", delay: int = 1) -> dict[str, torch.Tensor]:
    return reference_run(run.optimizer, delay, run.ef, STEPS, None, microbatches=run.m * run.replicas,
                         workload=run.workload, profile=profile, stages=run.stages)


def test_wpipe_follows_its_single_device_rule(results):
    for index, run in enumerate(RUNS):
        reference = _reference(run)
        for replica in range(run.replicas):
            weights = _merged(results, index, replica)
            assert set(weights) == set(reference)
            assert worst_difference(weights, reference) < TOLERANCE, f"{run}, replica {replica}: {worst_difference(weights, reference)}"


def test_nccl_rules_train_to_the_same_bits(results):
    assert_same_bits(results, 4, 2, ranks=3)


def test_negative_controls_the_whole_model_stale_or_none_of_it_is_another_rule(results):
    """2BW's one step everywhere, or no delay at all: the reference differs, so the test can fail."""
    for index in (0, 2):
        run = RUNS[index]
        for delay in (0, 1):
            assert worst_difference(_merged(results, index), _reference(run, profile=None, delay=delay)) > 1e-4, (run, delay)


def test_g0_keeps_two_versions_g1_one_and_every_rank_reports_the_same_losses(results):
    for index, run in enumerate(RUNS):
        per_rank = [results[rank][index] for rank in range(run.world)]
        for memory in (r[4] for r in per_rank):  # versions = 2 |G0 shard| + |G1 shard| < 2 x parameters
            assert memory["parameters"] < memory["weight_versions"] < 2 * memory["parameters"], (run, memory)
        losses = [r[1] for r in per_rank]
        assert all(x == losses[0] for x in losses)
        values = [x for x in losses[0] if x is not None]
        assert len(values) == STEPS and all(2.0 < x < 7.0 for x in values)


def test_the_order_is_wpipes_published_one():
    """Rank 0 of 4 stages, as the reference code's layout gives it (F/B chunk.micro-batch)."""
    order = wpipe_stream(0, 4, 4)
    seen = [order.forward(k) for k in range(7)]
    for k in range(9):
        seen.append(order.forward(k + 7))
        order.backward_then_update(k, seen)
    text = " ".join(f"{a.kind}{a.chunk}.{a.microbatch}" if a.kind != "U" else f"U{a.chunk}" for a in seen)
    assert text == ("F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 B1.0 F0.4 B1.1 F0.5 B1.2 F0.6 B1.3 U1 F0.7 B0.0 "
                    "F1.4 B0.1 F1.5 B0.2 F1.6 B0.3 U0 F1.7 B1.4")


def test_wpipe_needs_a_multiple_of_the_stages():
    assert spec("wpipe").clock(2).update_groups(0)[0][1].delay == 1
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        call_actions("wpipe", 0, 2, 3, 0)


def test_fsdp_is_refused_before_any_group():
    from lightning_async.pipeline.fsdp import check_fsdp_applicable

    with pytest.raises(ValueError, match="updates each chunk of a stage on its own.*shard_optimizer=True"):
        check_fsdp_applicable(spec("wpipe"), 2)
