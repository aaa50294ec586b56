"""ZeRO-1 over the data-parallel replicas: the sharded optimizer follows the unsharded run to float tolerance.

Every scenario runs sharded and unsharded in the same spawn; the weights of every rank, the losses and the final
evaluation must agree, and each replica must hold only its share of the optimizer state and correction buffers.
Some run sharded a third time under NCCL's rules on gloo (``transport="nccl-rules"``: in-order matching, batched
groups), where the weight broadcasts meet the point-to-point traffic as they would on GPUs.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

import _pipeline_harness as harness
from _pipeline_harness import pipeline_run, spawn
from lightning_async.pipeline.sharding import balanced_owners

STEPS = 8
# Keyed by the number of processes (2 stages x 2 or x 3 replicas): (schedule, optimizer, correction, clip).
SCENARIOS = {
    4: [
        ("2bw", "adamw", 1.0, 1.0),
        ("2bw", "muon", 1.0, 0.5),
        ("1f1b", "adamw", 0.0, 1.0),
        ("zbv", "muon", 0.0, None),
        ("2bw-split", "adamw", 0.0, 1.0),
    ],
    6: [
        ("2bw", "adamw", 1.0, 1.0),
        ("2bw", "muon", 0.0, 1.0),
        ("zbh1", "adamw", 0.0, None),
    ],
}


# (schedule, optimizer) of the scenarios that also run sharded under NCCL's rules
NCCL_RULES = {("2bw", "adamw"), ("1f1b", "adamw"), ("zbh1", "adamw")}


# batches of 24 rows (the shrunk one 12): every replica's share splits into 2 micro-batches for 2 and 3 replicas
WORKLOAD = dataclasses.replace(harness.SMOLLM2, make_batches=functools.partial(harness.make_batches, batch_size=24))


def _both(world: int) -> list:
    out = []
    for schedule, optimizer, ef, clip in SCENARIOS[world]:
        runs = [pipeline_run(2, schedule, optimizer, ef, STEPS, clip, m=2, drain_at=(3,), workload=WORKLOAD,
                             shard_optimizer=shard, transport=transport)
                for shard, transport in ((False, "auto"), (True, "auto"), (True, "nccl-rules"))
                if transport == "auto" or (schedule, optimizer) in NCCL_RULES]
        out.append(runs)
    return out


def _with_a_lagging_replica() -> tuple:
    """2BW sharded on 2 x 2, with stage 1 of replica 0 and stage 0 of replica 1 applying updates only where they
    must (the start of call b + 2) while the other two apply them as soon as their reductions finish: each stage's
    broadcasts then start at different actions in the two replicas. A wait for the other replica's weights anywhere but at a call's start would deadlock here (the
    lagging replica's next gradient average waits for the replica that waits for it)."""
    import torch.distributed as dist

    from lightning_async.pipeline.runtime import PipelineRuntime

    plain = pipeline_run(2, "2bw", "adamw", 1.0, STEPS, 1.0, m=2, workload=WORKLOAD)
    if dist.get_rank() in (1, 2):  # stage 1 of replica 0 and stage 0 of replica 1
        PipelineRuntime._apply_ready_updates = lambda self: None
    lagging = pipeline_run(2, "2bw", "adamw", 1.0, STEPS, 1.0, m=2, workload=WORKLOAD, shard_optimizer=True)
    return plain[0], lagging[0]


@pytest.mark.slow
def test_a_lagging_replica_neither_hangs_nor_changes_the_result():
    for rank, (plain, lagging) in enumerate(spawn(4, _with_a_lagging_replica, timeout=120)):
        worst = max((plain[n] - lagging[n]).abs().max().item() for n in plain)
        assert worst < 1e-6, f"rank {rank}: max |diff| = {worst}"


@pytest.fixture(scope="module", params=[4, 6], ids=["2x2", "2x3"])
def sharded_results(request):
    world = request.param
    return world, spawn(world, _both, world, timeout=300)


@pytest.mark.slow
def test_sharded_equals_unsharded(sharded_results):
    world, per_rank = sharded_results
    for index, scenario in enumerate(SCENARIOS[world]):
        for rank, results in enumerate(per_rank):
            (plain, plain_losses, *_), *sharded_runs = results[index]
            assert len(sharded_runs) == 1 + (scenario[:2] in NCCL_RULES)
            for transport, (sharded, sharded_losses, *_) in zip(("auto", "nccl-rules"), sharded_runs):
                assert set(plain) == set(sharded)
                worst = max((plain[n] - sharded[n]).abs().max().item() for n in plain)
                assert worst < 1e-6, f"{scenario} {transport} rank {rank}: max |sharded - unsharded| = {worst}"
                assert sharded_losses == pytest.approx(plain_losses, abs=1e-6)


@pytest.mark.slow
def test_each_replica_holds_its_share_of_the_state(sharded_results):
    world, per_rank = sharded_results
    replicas = world // 2
    for index, (schedule, _optimizer, ef, _clip) in enumerate(SCENARIOS[world]):
        for stage in range(2):
            plain = per_rank[stage][index][0][4]
            shares = [per_rank[r * 2 + stage][index][1][4] for r in range(replicas)]
            assert sum(s["optimizer_state"] for s in shares) == plain["optimizer_state"]
            assert max(s["optimizer_state"] for s in shares) < 0.75 * plain["optimizer_state"]
            if ef:
                assert sum(s["correction"] for s in shares) == plain["correction"] > 0
                assert max(s["correction"] for s in shares) < 0.75 * plain["correction"]


def test_balanced_owners():
    assert balanced_owners([10, 1, 1, 8, 2], 2) == [0, 0, 1, 1, 1]  # loads 11 and 11
    owners = balanced_owners([5] * 7, 3)
    assert sorted(owners.count(r) for r in range(3)) == [2, 2, 3]
    assert balanced_owners([3, 2], 1) == [0, 0]


# ---- through Lightning: 2 stages x 2 replicas, checkpoints moving between sharded and unsharded runs ------------
def _strategy(shard: bool):
    from lightning_async.strategies import AsyncPipelineStrategy

    return AsyncPipelineStrategy(pipeline_parallel_size=2, n_microbatches=2, correction="ef", shard_optimizer=shard)


def _lightning_fits(tmp: str) -> dict:
    import os

    from _pipeline_harness import as_torchrun
    from test_strategy import fit

    as_torchrun()
    plain_dir, sharded_dir = os.path.join(tmp, "plain"), os.path.join(tmp, "sharded")
    return {
        "plain": fit(_strategy(False), 4, ckpt_dir=plain_dir),
        "sharded": fit(_strategy(True), 4, ckpt_dir=sharded_dir),
        "files": sorted(os.listdir(os.path.join(sharded_dir, "step=4.ckpt"))),
        "sharded_resumed": fit(_strategy(True), 4, ckpt_path=os.path.join(sharded_dir, "step=4.ckpt")),
        "sharded_to_plain": fit(_strategy(False), 4, ckpt_path=os.path.join(sharded_dir, "step=4.ckpt")),
        "plain_to_sharded": fit(_strategy(True), 4, ckpt_path=os.path.join(plain_dir, "step=4.ckpt")),
    }


@pytest.fixture(scope="module")
def lightning_fits(tmp_path_factory):
    return spawn(4, _lightning_fits, str(tmp_path_factory.mktemp("sharded")), timeout=300)


@pytest.mark.slow
def test_sharded_fit_and_every_resume_equal_the_unsharded_fit(lightning_fits):
    for run in ("sharded", "sharded_resumed", "sharded_to_plain", "plain_to_sharded"):
        for rank, results in enumerate(lightning_fits):
            plain, sharded = results["plain"][0], results[run][0]
            worst = max((plain[k] - sharded[k]).abs().max().item() for k in plain)
            assert worst < 1e-6, f"{run}, rank {rank}: max |diff| = {worst}"
            assert results[run][1]["train/loss"] == pytest.approx(results["plain"][1]["train/loss"], abs=1e-6)
    for rank, results in enumerate(lightning_fits):  # (a resumed fit validates at other batches: see test_strategy)
        assert results["sharded"][1]["val/loss"] == pytest.approx(results["plain"][1]["val/loss"], abs=1e-6)
    assert lightning_fits[0]["files"] == [
        "meta.json", "stage-00.ckpt", "stage-00.replica-01.ckpt", "stage-01.ckpt", "stage-01.replica-01.ckpt",
    ]


def test_sharding_one_replica_is_refused_before_launch():
    import lightning as L

    from lightning_async.strategies import AsyncPipelineStrategy

    strategy = AsyncPipelineStrategy(shard_optimizer=True)
    L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    with pytest.raises(ValueError, match=r"shard_optimizer=True .* one replica \(2 processes = 2 stages x 1\)"):
        strategy.validate_mesh()
