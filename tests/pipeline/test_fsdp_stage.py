"""FSDP2 inside a pipeline stage follows the unsharded run to float tolerance, with each replica holding its share.

Every scenario runs with and without ``fsdp`` in the same spawn (2 stages x 2 and x 3 replicas, gloo): the whole
weights of every rank, the losses and the final evaluation must agree, and each replica must hold about 1/dp of its
stage's weights, gradients and optimizer state. Through the strategy too: ``AsyncPipelineStrategy(fsdp=True)`` fits
to the same weights and metrics as without. What FSDP inside a stage does not run is refused before any group.
On 2 x 2, 1F1B and 2BW run under FSDP a third time under NCCL's rules on gloo (``transport="nccl-rules"``): FSDP's
gathers and reductions between the batched, in-order point-to-point groups, as on GPUs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
from torch import nn

import _pipeline_harness as harness
from _pipeline_harness import as_torchrun, pipeline_run, spawn
from lightning_async.optim import build_optimizer
from lightning_async.pipeline.checkpoint import consolidate
from lightning_async.pipeline import schedules
from lightning_async.pipeline.fsdp import check_fsdp_applicable, check_optimizer, shard_chunks
from lightning_async.pipeline.mesh import PipelineMesh

STEPS = 9  # (more than the first updates after a drain: a stale FSDP prefetch showed only from batch 7)
# Keyed by the number of processes (2 stages x 2 or x 3 replicas): (schedule, optimizer, correction, clip); the
# correction is an EF strength or build_correction's keyword arguments (harness.correction_of).
SCENARIOS = {
    4: [("1f1b", "adamw", 0.0, 1.0), ("gpipe", "lion", 0.0, None), ("interleaved", "adamw", 0.0, 0.5),
        ("2bw", "adamw", 1.0, 1.0)],
    6: [("1f1b", "adamw", 0.0, 1.0), ("gpipe", "adan", 0.0, 1.0), ("interleaved", "mars", 0.0, None),
        ("2bw", "lion", 1.0, None), ("2bw", "adan", 0.0, 1.0),
        ("2bw", "adamw", {"method": "dc-asgd", "strength": 2.0, "adaptive": True}, 1.0)],  # (reads the stale weights)
}
# batches of 24 rows: every replica's share splits into 2 micro-batches for 2 and 3 replicas
WORKLOAD = dataclasses.replace(harness.SMOLLM2, make_batches=functools.partial(harness.make_batches, batch_size=24))


NCCL_RULES = {4: [("1f1b", "adamw"), ("2bw", "adamw")]}  # (schedule, optimizer) also run under NCCL's rules


def _both(world: int, tmp: str) -> dict:
    out = {}
    for schedule, optimizer, ef, clip in SCENARIOS[world]:
        out[schedule, optimizer] = [
            pipeline_run(2, schedule, optimizer, ef, STEPS, clip, m=2, drain_at=(3,), workload=WORKLOAD, fsdp=fsdp)
            for fsdp in (False, True)
        ]
        if (schedule, optimizer) in NCCL_RULES.get(world, ()):
            out["nccl-rules", schedule, optimizer] = pipeline_run(
                2, schedule, optimizer, ef, STEPS, clip, m=2, drain_at=(3,), workload=WORKLOAD, fsdp=True,
                transport="nccl-rules")
    if world == 4:
        out["strategy"] = _fit_both()
        out["checkpoints"] = _checkpoints_move(tmp)
    return out


def _checkpoints_move(tmp: str) -> dict:
    """2BW + EF under FSDP saves through DCP at step 4; it resumes under FSDP and without (2 x 2 both), and an
    unsharded run's checkpoint resumes under FSDP."""
    import lightning as L

    from lightning_async.pipeline.fsdp import whole
    from lightning_async.strategies import AsyncPipelineStrategy
    from test_strategy import fit

    class Start(L.Callback):
        weights: dict = {}

        def on_train_start(self, trainer, pl_module) -> None:
            self.weights = {k: whole(v) for k, v in pl_module.state_dict().items()}

    def strategy(fsdp):
        return AsyncPipelineStrategy(schedule="2bw", pipeline_parallel_size=2, n_microbatches=2, correction="ef",
                                     checkpoint_format="dcp", fsdp=fsdp)

    def final(run):
        return {k: whole(v) for k, v in run[0].items()}

    as_torchrun()
    out = {"uninterrupted": final(fit(strategy(True), 4, ckpt_dir=os.path.join(tmp, "fsdp")))}
    at4 = os.path.join(tmp, "fsdp", "step=4.ckpt")
    out["fsdp_resumed"] = final(fit(strategy(True), 4, ckpt_path=at4))
    out["plain_resumed"] = final(fit(strategy(False), 4, ckpt_path=at4, ckpt_dir=os.path.join(tmp, "plain")))
    start = Start()
    fit(strategy(True), 4, callbacks=[start], steps=10, ckpt_path=os.path.join(tmp, "plain", "step=8.ckpt"))
    out["fsdp_start"], out["plain_saved"] = start.weights, consolidate(os.path.join(tmp, "plain", "step=8.ckpt"))
    return out


def _fit_both() -> list:
    from lightning_async.pipeline.fsdp import whole
    from lightning_async.strategies import AsyncPipelineStrategy
    from test_strategy import fit

    as_torchrun()
    runs = {}
    for schedule in ("1f1b", "2bw"):
        for fsdp in (False, True):
            strategy = AsyncPipelineStrategy(schedule=schedule, pipeline_parallel_size=2, n_microbatches=2, fsdp=fsdp)
            state, metrics = fit(strategy, 4)
            assert all(hasattr(v, "full_tensor") for v in state.values()) == fsdp  # sharded DTensors under FSDP only
            runs.setdefault(schedule, []).append(({k: whole(v) for k, v in state.items()}, metrics))
    return runs


@pytest.fixture(scope="module", params=[4, 6], ids=["2x2", "2x3"])
def fsdp_results(request, tmp_path_factory):
    world = request.param
    return world, spawn(world, _both, world, str(tmp_path_factory.mktemp(f"fsdp{world}")), timeout=300)


@pytest.mark.slow
def test_fsdp_equals_unsharded(fsdp_results):
    world, per_rank = fsdp_results
    for rank, results in enumerate(per_rank):
        for (schedule, optimizer, *_), (plain, sharded) in zip(SCENARIOS[world], (results[s[:2]] for s in SCENARIOS[world])):
            where = f"{world} processes, {schedule}/{optimizer}, rank {rank}"
            assert plain[0].keys() == sharded[0].keys(), where
            worst = max((plain[0][n] - sharded[0][n]).abs().max().item() for n in plain[0])
            assert worst < 1e-6, f"{where}: max |diff| = {worst}"
            assert plain[1] == pytest.approx(sharded[1], abs=1e-6), where


@pytest.mark.slow
def test_fsdp_under_nccl_rules_equals_gloos_rules(fsdp_results):
    world, per_rank = fsdp_results
    for schedule, optimizer in NCCL_RULES.get(world, ()):
        for rank, results in enumerate(per_rank):
            ours, theirs = results["nccl-rules", schedule, optimizer], results[schedule, optimizer][1]
            assert ours[5] > 0 and ours[2] == 0, "NCCL's path: batched groups, nothing pre-posted"
            worst = max((ours[0][n] - theirs[0][n]).abs().max().item() for n in theirs[0])
            assert worst < 1e-6, f"{schedule}/{optimizer} rank {rank}: max |nccl-rules - gloo's rules| = {worst}"
            assert ours[1] == pytest.approx(theirs[1], abs=1e-6)


@pytest.mark.slow
def test_each_replica_holds_its_share(fsdp_results):
    world, per_rank = fsdp_results
    mesh = PipelineMesh.from_world(world, 2)
    for schedule, optimizer, *_ in SCENARIOS[world]:
        for stage in range(2):
            ranks = [r for r in range(world) if mesh.stage_of(r) == stage]
            plain, sharded = zip(*((run[4] for run in per_rank[r][schedule, optimizer]) for r in ranks))
            for term in ("parameters", "weight_versions", "optimizer_state", "correction"):
                where = f"{schedule}/{optimizer} stage {stage} {term}"
                assert all(p[term] == plain[0][term] for p in plain), where  # unsharded: every replica the whole
                # the shards add up to the whole (the optimizer's scalar step counters aside), none much over 1/dp;
                # under 2BW FSDP holds a third copy of the weights, the parameters it gathers from, beside the versions
                whole = plain[0][term] * (1.5 if term == "weight_versions" and schedule == "2bw" else 1)
                assert sum(x[term] for x in sharded) == pytest.approx(whole, rel=0.01), where
                assert max(x[term] for x in sharded) <= whole * (1 / len(ranks) + 0.05), where


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_results", [4], indirect=True, ids=["2x2"])  # the strategy runs in the 2 x 2 spawn
def test_the_strategy_fits_the_same_under_fsdp(fsdp_results):
    world, per_rank = fsdp_results
    for rank, results in enumerate(per_rank):
        for schedule, ((plain, plain_metrics), (sharded, sharded_metrics)) in results["strategy"].items():
            worst = max((plain[k] - sharded[k]).abs().max().item() for k in plain)
            assert worst < 1e-6, f"{schedule}, rank {rank}: max |diff| = {worst}"
            assert plain_metrics.keys() == sharded_metrics.keys() and plain_metrics
            for k in plain_metrics:
                assert plain_metrics[k] == pytest.approx(sharded_metrics[k], abs=1e-6), (schedule, k)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_results", [4], indirect=True, ids=["2x2"])
def test_fsdp_checkpoints_move_to_and_from_unsharded_runs(fsdp_results):
    _, per_rank = fsdp_results
    for rank, results in enumerate(per_rank):
        c = results["checkpoints"]
        for run in ("fsdp_resumed", "plain_resumed"):  # (FSDP equals unsharded: both end where the FSDP run ended)
            worst = max((c["uninterrupted"][k] - c[run][k]).abs().max().item() for k in c["uninterrupted"])
            assert worst < 1e-6, f"rank {rank}, {run}: max |diff| = {worst}"
    started = {k: v for results in per_rank for k, v in results["checkpoints"]["fsdp_start"].items()}
    saved = per_rank[0]["checkpoints"]["plain_saved"]
    assert set(started) == set(saved)
    differ = [k for k in saved if not torch.equal(started[k], saved[k])]
    assert not differ, f"FSDP resumed from other weights than the unsharded run saved: {differ[:3]}"


@pytest.mark.parametrize("schedule, replicas, kwargs, match", [
    ("2bw-split", 2, {}, "splits the backward"),
    ("zbh1", 2, {}, "splits the backward"),
    ("zbv", 2, {}, "splits the backward"),
    ("1f1b", 1, {}, "Add replicas"),
    ("1f1b", 2, {"shard_optimizer": True}, "shard_optimizer=False"),
    ("gpipe", 2, {"activation_checkpointing": True}, "activation_checkpointing=False"),
])
def test_what_fsdp_cannot_run_is_refused(schedule, replicas, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_fsdp_applicable(schedules.spec(schedule), replicas, **kwargs)
    for runs in ("1f1b", "2bw"):  # and what it runs is not
        check_fsdp_applicable(schedules.spec(runs), 2)


@pytest.mark.parametrize("kwargs, match", [
    ({"schedule": "zbh1"}, "fsdp=True: schedule 'zbh1' splits the backward"),
    ({"schedule": "1f1b", "pipeline_parallel_size": 4}, "this run has 1"),
])
def test_the_strategy_refuses_fsdp_before_launch(kwargs, match):
    from test_strategy import _strategy

    with pytest.raises(ValueError, match=match):
        _strategy(4, fsdp=True, **{"pipeline_parallel_size": 2, **kwargs}).validate_mesh()


def test_the_strategy_refuses_per_stage_checkpoints_under_fsdp():
    import lightning as L

    from lightning_async.strategies import AsyncPipelineStrategy

    strategy = AsyncPipelineStrategy(schedule="1f1b", pipeline_parallel_size=2, fsdp=True)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)  # a ModelCheckpoint by default
    with pytest.raises(ValueError, match="pass checkpoint_format='dcp'"):
        strategy._refuse_checkpoints_under_fsdp(trainer)
    strategy = AsyncPipelineStrategy(schedule="1f1b", pipeline_parallel_size=2, fsdp=True, checkpoint_format="dcp")
    strategy._refuse_checkpoints_under_fsdp(L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False))


@pytest.mark.parametrize("name", ["muon", "normuon", "soap"])
def test_whole_matrix_optimizers_are_refused(name):
    model = nn.Linear(8, 8)
    optimizer = build_optimizer(name, model.named_parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="needs whole weight matrices"):
        check_optimizer(optimizer)
    check_optimizer(torch.optim.AdamW(model.parameters()))


def test_a_weight_two_units_of_a_rank_share_is_refused_before_any_group():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(ValueError, match="FSDP cannot shard a weight two units share"):
        shard_chunks([nn.Sequential(a, b)], group=None, device=torch.device("cpu"))
