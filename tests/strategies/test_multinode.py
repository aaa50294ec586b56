"""Two "nodes" of one process each, launched the way torchrun does it, through Lightning's own environment.

Each process gets torchrun's variables (``TORCHELASTIC_RUN_ID``, ``RANK``, ``GROUP_RANK`` = node rank,
``LOCAL_RANK`` 0, ``LOCAL_WORLD_SIZE`` 1), so Lightning picks ``TorchElasticEnvironment`` and ``Trainer(num_nodes=2,
devices=1)``. The script seeds each rank differently (a common pattern); the stages must still read the
same batches, so the data module uses rank 0's shuffle seed.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch.distributed as dist

from _pipeline_harness import as_torchrun, spawn
from lightning_async.data import TextDataModule
from lightning_async.lm import CausalLM
from lightning_async.strategies import AsyncPipelineStrategy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


class Batches(L.Callback):
    def __init__(self) -> None:
        self.seen: list[int] = []
        self.environment = ""

    def on_train_start(self, trainer, pl_module) -> None:
        env = trainer.strategy.cluster_environment
        self.environment = f"{type(env).__name__} node {env.node_rank()} of {trainer.num_nodes}"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append(hash(tuple(batch[:, :8].flatten().tolist())))


def _two_nodes(tmp: str) -> dict:
    rank = dist.get_rank()  # one process per node, with torchrun's variables
    as_torchrun(GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", TORCHELASTIC_RUN_ID="two-nodes")
    L.seed_everything(100 + rank)  # deliberately different per rank
    data = TextDataModule(source="stdlib", max_chars=300_000, seq_len=32, batch_size=8, val_batches=2,
                          cache_dir=os.path.join(tmp, f"cache-node{rank}"), progress=False)
    log = Batches()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=AsyncPipelineStrategy(n_microbatches=2), max_steps=6,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[log], limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(CausalLM(model="tiny", lr=3e-3), datamodule=data)
    scheduler_warnings = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return {"seen": log.seen, "environment": log.environment, "loss": float(trainer.callback_metrics["train/loss"]),
            "scheduler_warnings": scheduler_warnings}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    return spawn(2, _two_nodes, str(tmp_path_factory.mktemp("nodes")), timeout=240)


def test_torchrun_multinode_environment_is_lightnings(nodes):
    assert [r["environment"] for r in nodes] == ["TorchElasticEnvironment node 0 of 2", "TorchElasticEnvironment node 1 of 2"]


def test_stages_read_the_same_batches_whatever_each_rank_seeded(nodes):
    first, last = nodes
    assert len(first["seen"]) == 6 and first["seen"] == last["seen"]
    assert first["loss"] == last["loss"] and 2.0 < first["loss"] < 6.0


def test_no_scheduler_order_warning(nodes):
    """Under 2BW the scheduler steps before the batch's (deferred) update; torch must not call that a skipped lr."""
    assert [r["scheduler_warnings"] for r in nodes] == [[], []]
