"""Checkpoints through ``torch.distributed.checkpoint`` (``checkpoint_format="dcp"``) move between layouts.

A 2-stage run saves; a 4-stage run resumes it and ends where the 2-stage run ends; a 2 stages x 2 replicas run with
the sharded optimizer resumes it from identical weights and optimizer state (its data differs: two replicas read
twice the rows), and its own checkpoint (step 8) resumes on 4 stages from identical weights and state again. The
4-stage resume runs once more under NCCL's rules on gloo (``transport="nccl-rules"``) and must end where it ends.
"""

from __future__ import annotations

import os

import pytest
import torch

from _pipeline_harness import as_torchrun, spawn
from lightning_async.pipeline import distributed_checkpoint as distributed
from lightning_async.pipeline.checkpoint import consolidate, read_meta

pytestmark = pytest.mark.slow  # the tests here start processes


def _strategy(stages: int, shard: bool = False, transport: str = "auto"):
    from lightning_async.strategies import AsyncPipelineStrategy

    return AsyncPipelineStrategy(pipeline_parallel_size=stages, n_microbatches=4, correction="ef", shard_optimizer=shard,
                                 checkpoint_format="dcp", transport=transport)


class StartState:
    """A callback: the weights and optimizer state by parameter name when training starts (after a resume)."""

    def __new__(cls):
        import lightning as L

        class _Start(L.Callback):
            weights: dict = {}
            optimizer: dict = {}

            def on_train_start(self, trainer, pl_module) -> None:
                names = distributed.parameter_names(pl_module)
                self.weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
                opt = trainer.optimizers[0]
                self.optimizer = {f"{names[id(p)][0]}/{k}": v.clone() for p, state in opt.state.items()
                                  for k, v in state.items() if torch.is_tensor(v)}

        return _Start()


def _two_stages(tmp: str) -> dict:
    from test_strategy import fit

    as_torchrun()
    return {"fit": fit(_strategy(2), 2, ckpt_dir=os.path.join(tmp, "p2"))}


def _four_processes(tmp: str) -> dict:
    from test_strategy import fit

    as_torchrun()
    p2 = os.path.join(tmp, "p2", "step=4.ckpt")
    out = {"p4": fit(_strategy(4), 4, ckpt_path=p2)}
    out["p4_nccl_rules"] = fit(_strategy(4, transport="nccl-rules"), 4, ckpt_path=p2)
    start = StartState()
    out["dp2_sharded"] = fit(_strategy(2, shard=True), 4, callbacks=[start], ckpt_path=p2,
                             ckpt_dir=os.path.join(tmp, "dp2"))
    out["dp2_start"] = (start.weights, start.optimizer)
    start = StartState()
    out["back_to_p4"] = fit(_strategy(4), 4, callbacks=[start], steps=10, ckpt_path=os.path.join(tmp, "dp2", "step=8.ckpt"))
    out["back_start"] = (start.weights, start.optimizer)
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    two = spawn(2, _two_stages, tmp, timeout=300)
    four = spawn(4, _four_processes, tmp, timeout=300)
    return tmp, two, four


def _merged(per_rank: list, key: str) -> dict:
    merged = {}
    for rank in per_rank:
        merged.update(rank[key][0] if isinstance(rank[key], tuple) and isinstance(rank[key][0], dict) else {})
    return merged


def _saved_optimizer(path: str) -> dict:
    keys = distributed.saved_keys(path)
    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in keys.items()
            if k.startswith(distributed.OPTIMIZER) and isinstance(v, distributed.dcp.TensorStorageMetadata)}
    distributed.dcp.load(flat, storage_reader=distributed.dcp.FileSystemReader(path))
    return {k[len(distributed.OPTIMIZER):]: v for k, v in flat.items()}


def test_a_two_stage_checkpoint_resumes_on_four_stages_exactly(layouts):
    tmp, two, four = layouts
    assert read_meta(os.path.join(tmp, "p2", "step=4.ckpt"))["format"] == "dcp"
    p2, p4 = _merged(two, "fit"), _merged(four, "p4")
    assert set(p2) == set(p4)
    worst = max((p2[k] - p4[k]).abs().max().item() for k in p2)
    assert worst < 2e-5, f"max |p=4 resumed - p=2 uninterrupted| = {worst}"


def test_a_resume_under_nccl_rules_ends_where_gloos_rules_end(layouts):
    _, _, four = layouts
    tagged, in_order = _merged(four, "p4"), _merged(four, "p4_nccl_rules")
    assert set(tagged) == set(in_order)
    worst = max((tagged[k] - in_order[k]).abs().max().item() for k in tagged)
    assert worst < 1e-6, f"max |nccl-rules - gloo's rules| after the 4-stage resume = {worst}"
    for rank in four:
        assert rank["p4_nccl_rules"][1]["train/loss"] == pytest.approx(rank["p4"][1]["train/loss"], abs=1e-6)


@pytest.mark.parametrize("run, checkpoint", [("dp2_start", "p2/step=4.ckpt"), ("back_start", "dp2/step=8.ckpt")])
def test_another_layout_starts_from_the_saved_weights_and_optimizer_state(layouts, run, checkpoint):
    tmp, _, four = layouts
    path = os.path.join(tmp, checkpoint)
    weights, optimizer = consolidate(path), _saved_optimizer(path)
    seen_weights, seen_state = {}, {}
    for rank in four:
        seen_weights.update(rank[run][0])
        seen_state.update(rank[run][1])
    assert set(seen_weights) == set(weights)
    assert all(torch.equal(seen_weights[k], weights[k]) for k in weights)
    # every saved optimizer tensor is on some rank, equal (tied weights are saved under each of their names)
    assert {k for k in optimizer if k in seen_state} and all(torch.equal(seen_state[k], optimizer[k]) for k in seen_state)
    covered = {k.rsplit("/", 1)[0] for k in seen_state}
    assert len(covered) >= len({k.rsplit("/", 1)[0] for k in optimizer}) - 1  # (a tied head may appear once)


def test_export_reads_the_distributed_format(layouts):
    from lightning_async.export import read_checkpoint

    tmp, two, _ = layouts
    weights, hparams, _ = read_checkpoint(os.path.join(tmp, "p2", "step=8.ckpt"))
    final = _merged(two, "fit")
    assert hparams["lr"] == 3e-3 and all(torch.equal(weights[k], final[k]) for k in final)


def test_a_sharded_run_saves_each_optimizer_tensor_once_in_parallel(layouts):
    tmp, _, _ = layouts
    files = sorted(os.listdir(os.path.join(tmp, "dp2", "step=8.ckpt")))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "meta.json"]


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    """Without processes: the request names the weights the checkpoint lacks, before anything is read."""
    import warnings

    path = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        distributed.save({distributed.MODEL + "model.embed.weight": torch.zeros(4, 2)}, path)
    module = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match=r"no weights for weight, bias: it was saved from another model"):
        distributed.RankRequest(distributed.saved_keys(path), module.state_dict(), None, list(module.parameters()), 1,
                                distributed.parameter_names(module))


def test_each_rank_schedules_its_own_groups_rates():
    """Scheduler states come from rank 0; another stage's groups (same count, other rates) keep their own."""
    from lightning_async.pipeline.distributed_checkpoint import _per_group_schedulers

    saved = [{"base_lrs": [3e-3, 0.02], "_last_lr": [1.5e-3, 0.01], "last_epoch": 4, "lr_lambdas": [None, None]}]
    groups = [{"initial_lr": 0.02, "lr": 0.01}, {"initial_lr": 3e-3, "lr": 1.5e-3}]
    (state,) = _per_group_schedulers(saved, groups, saved_groups=2)
    assert state["base_lrs"] == [0.02, 3e-3] and state["_last_lr"] == [0.01, 1.5e-3] and state["last_epoch"] == 4
    (three,) = _per_group_schedulers(saved, groups + [{"initial_lr": 1.0, "lr": 0.5}], saved_groups=2)
    assert three["base_lrs"] == [0.02, 3e-3, 1.0] and three["lr_lambdas"] == [None] * 3
