"""PACI as a real schedule: the pipeline follows ``PaciRule``, its single-device rule, exactly.

Stage ``s`` keeps one weight version; its update lands right after its last backward of a batch, so the batch
after's first ``p - 1 - s`` forwards (which ran before it) read the previous version and their backwards recompute
the stage at the updated weights. The reference is ``PaciRule`` on one device (what ``DelaySimulation(profile=
"paci")`` runs), its previous version forgotten where the pipeline ran empty (after an evaluation's drain and the
shape change of batch ``SHRUNK_BATCH``). One spawn of four processes runs 2, 3 and 4 stages, AdamW, Muon and Lion,
with and without clipping (the last stage then waits for the first one's norm), tied embeddings, NCCL's matching
rules, and 2 stages x 2 replicas with the sharded optimizer (each replica's first micro-batches read the previous
version: ``PaciRule(replicas=2)``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter

import pytest
import torch

from _pipeline_harness import (
    SHRUNK_BATCH, assert_same_bits, each_in_its_world, merged_weights, pipeline_run, reference_run, spawn,
    worst_difference,
)
from lightning_async.pipeline.schedules import spec

pytestmark = pytest.mark.slow  # starts processes

STEPS = 8
M = 4  # micro-batches per batch (>= p - 1 for every stage count here; divides the batch of 8 and the shrunk one of 4)
TOLERANCE = 2e-5  # as the oracle matrix (float32, summation order)


@dataclass(frozen=True)
class Run:
    stages: int
    optimizer: str
    clip: float | None = None
    drain_after: tuple[int, ...] = ()
    transport: str = "auto"
    replicas: int = 1
    m: int = M

    @property
    def world(self) -> int:
        return self.stages * self.replicas


RUNS = [
    Run(2, "adamw", clip=1.0, drain_after=(2,)),
    Run(3, "muon"),
    Run(3, "adamw", clip=1.0, drain_after=(2,)),
    Run(4, "lion", clip=0.5),
    Run(3, "adamw", clip=1.0, drain_after=(2,), transport="nccl-rules"),  # twin of RUNS[2]
    Run(2, "adamw", clip=1.0, drain_after=(3,), replicas=2, m=2),  # 2 stages x 2 replicas, the sharded optimizer
]


def _run(run: Run):
    return pipeline_run(run.stages, "paci", run.optimizer, 0.0, STEPS, run.clip, m=run.m, drain_at=run.drain_after,
                        prepost=False if run.transport == "nccl-rules" else None, transport=run.transport,
                        shard_optimizer=run.replicas > 1)


@pytest.fixture(scope="module")
def results():
    return spawn(4, each_in_its_world, _run, RUNS, attrgetter("world"))


def _merged(results, index: int, replica: int = 0) -> dict[str, torch.Tensor]:
    return merged_weights(results, index, RUNS[index].stages, replica)


def _reference(run: Run, profile: str | None = "paci") -> dict[str, torch.Tensor]:
    shape_changes = tuple(b for b in (SHRUNK_BATCH, SHRUNK_BATCH + 1) if b < STEPS)  # (each drains the pipeline)
    refills = tuple(b + 1 for b in run.drain_after) + shape_changes
    return reference_run(run.optimizer, 0, 0.0, STEPS, run.clip, microbatches=run.m * run.replicas, profile=profile,
                         stages=run.stages, refills=refills, replicas=run.replicas)


def test_paci_follows_its_single_device_rule(results):
    for index, run in enumerate(RUNS):
        reference = _reference(run)
        for replica in range(run.replicas):
            weights = _merged(results, index, replica)
            assert set(weights) <= set(reference) and len(weights) >= len(reference) - 1  # (a tied head: once)
            assert worst_difference(weights, reference) < TOLERANCE, f"{run}, replica {replica}"


def test_negative_control_synchronous_training_is_another_rule(results):
    """Every forward on the current weights (1F1B with a flush) differs: the stale forwards are seen."""
    for index in (0, 2, 5):
        assert worst_difference(_merged(results, index), _reference(RUNS[index], profile=None)) > 1e-4
    # over replicas, each replica's first micro-batches are stale, not only the batch's first ones
    assert worst_difference(_merged(results, 5), _reference(replace(RUNS[5], replicas=1))) > 1e-4


def test_nccl_rules_train_to_the_same_bits(results):
    assert_same_bits(results, 4, 2, ranks=3)


def test_one_weight_version_and_the_same_losses_everywhere(results):
    for index, run in enumerate(RUNS):
        per_rank = [results[rank][index] for rank in range(run.world)]
        assert all(r[4]["weight_versions"] == r[4]["parameters"] for r in per_rank)
        losses = [r[1] for r in per_rank]
        assert all(x == losses[0] for x in losses)
        values = [x for x in losses[0] if x is not None]
        assert len(values) == STEPS and all(2.0 < x < 7.0 for x in values)


def test_the_clock_names_the_stale_forwards():
    clock = spec("paci").clock(4)
    assert [clock.stale_forwards(s) for s in range(4)] == [3, 2, 1, 0] and clock.loss_lag == 1
    assert [clock.forward_reads(0, 5, j) for j in range(4)] == [4, 4, 4, 5] and clock.rank(0).updates_read(5) == 5


def test_corrections_and_few_microbatches_are_refused():
    from lightning_async.optim import build_correction
    from lightning_async.optim.corrections import check_applicable

    with pytest.raises(ValueError, match="schedule 'paci' has none: every gradient is taken at the current weights"):
        check_applicable(build_correction("ef", 1.0), schedule=spec("paci"))
    with pytest.raises(ValueError, match=r"needs n_microbatches >= stages - 1 .* got 2 for 4 stages"):
        spec("paci").validate(4, 2)
