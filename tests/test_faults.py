"""A rank that dies mid-fit makes the others exit with a message naming it, instead of hanging."""

from __future__ import annotations

import os
import time

import lightning as L
import pytest

from _pipeline_harness import free_port, spawn
from test_strategy import SHAPE, TinyData

from lightning_async.lm import CausalLM
from lightning_async.strategies import AsyncPipelineStrategy


class DieAtBatch(L.Callback):
    """Kills this process (no clean-up, like an out-of-memory kill) at the start of a training batch."""

    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch = rank, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            os._exit(17)


def _fit_with_a_dying_stage(port: int) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_PORT=str(port))
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(n_microbatches=2, timeout=60), max_steps=8,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DieAtBatch(rank=1, batch=2)], num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(CausalLM(vocab_size=257, model_overrides=SHAPE), datamodule=TinyData())


def test_dead_stage_is_named_and_nobody_hangs():
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        spawn(2, _fit_with_a_dying_stage, free_port(), timeout=90, reporting=1)
    message = str(failure.value)
    assert message.startswith("rank 0 failed")
    assert "PeerFailure" in message and "stage 1 (global rank 1) stopped answering" in message, message[-600:]
    assert time.monotonic() - start < 90


def test_pre_posted_receives_are_refused_off_gloo():
    import torch

    from lightning_async.pipeline.p2p import StageTransport

    with pytest.raises(ValueError, match="Pre-posted receives need the gloo backend"):
        StageTransport(None, None, None, torch.device("cpu"), lambda r: r, prepost=True)  # no gloo group here
    transport = StageTransport(None, None, None, torch.device("cpu"), lambda r: r)
    assert transport.prepost_enabled is False
    with pytest.raises(ValueError, match="gloo"):
        transport.prepost_enabled = True
