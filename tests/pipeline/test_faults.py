"""A rank that dies, is terminated (SIGTERM) or stops answering (SIGSTOP) mid-fit makes every rank exit within
seconds (or `timeout`) with a message naming it, instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import lightning as L
import pytest

from _pipeline_harness import as_torchrun, spawn
from test_strategy import SHAPE, TinyData

from lightning_async.lm import CausalLM
from lightning_async.strategies import AsyncPipelineStrategy

pytestmark = pytest.mark.slow  # the tests here start processes or run the CLI (README.md, Tests)


class DieAtBatch(L.Callback):
    """Kills this process (no clean-up, like an out-of-memory kill) at the start of a training batch."""

    def __init__(self, rank: int, batch: int) -> None:
        self.rank, self.batch = rank, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            os._exit(17)


def _fit_with_a_dying_stage(transport: str = "auto") -> None:
    as_torchrun(timeout=60)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(n_microbatches=2, timeout=60, transport=transport),
        max_steps=8,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DieAtBatch(rank=1, batch=2)], num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(CausalLM(vocab_size=257, model_overrides=SHAPE), datamodule=TinyData())


@pytest.mark.parametrize("transport", ["auto", "nccl-rules"])
def test_dead_stage_is_named_and_nobody_hangs(transport):
    """Under NCCL's rules on gloo too: the survivor meets the dead peer in a ``batch_isend_irecv`` group (NCCL's
    path), not in a lone tagged send or a pre-posted receive, and must still name it."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        spawn(2, _fit_with_a_dying_stage, transport, timeout=90, reporting=1)
    message = str(failure.value)
    assert message.startswith("rank 0 failed")
    assert "PeerFailure" in message and "stage 1 (global rank 1) stopped answering" in message, message[-600:]
    assert time.monotonic() - start < 90


def test_pre_posted_receives_are_refused_off_gloo():
    import torch

    from lightning_async.pipeline.p2p import StageTransport

    with pytest.raises(ValueError, match="Pre-posted receives need the gloo backend"):
        StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r, prepost=True)  # no gloo group here
    transport = StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r)
    assert transport.prepost_enabled is False
    with pytest.raises(ValueError, match="gloo"):
        transport.prepost_enabled = True


def test_the_strategy_takes_the_transport_mode_and_names_the_choices():
    assert AsyncPipelineStrategy(transport="nccl-rules").transport == "nccl-rules"
    assert AsyncPipelineStrategy().transport == "auto"
    with pytest.raises(ValueError, match=r"transport must be one of 'auto', 'nccl-rules', got 'NCCL'"):
        AsyncPipelineStrategy(transport="NCCL")


# ---- signals and silent stages: every rank ends within seconds, with a message ------------------------------
class SignalAtBatch(L.Callback):
    """Sends ``signum`` to this process at the start of a training batch (as a scheduler or a hang would)."""

    def __init__(self, rank: int, batch: int, signum: int, stamp: str) -> None:
        self.rank, self.batch, self.signum, self.stamp = rank, batch, signum, stamp

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.batch:
            with open(self.stamp, "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), self.signum)


def _fit_outcome(timeout: float, callbacks: list, transport: str = "auto") -> dict:
    """Fit on this rank (as torchrun starts it); how it ended and when, instead of raising."""
    as_torchrun(timeout)
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(n_microbatches=2, timeout=timeout, transport=transport),
        max_steps=8,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0,
    )
    try:
        trainer.fit(CausalLM(vocab_size=257, model_overrides=SHAPE), datamodule=TinyData())
        outcome = {"error": None, "message": ""}
    except BaseException as err:  # SystemExit included: a SIGTERM-stopped stage raises StageTerminated
        outcome = {"error": type(err).__name__, "message": str(err), "code": getattr(err, "code", None)}
    return dict(outcome, ended=time.time())


@pytest.mark.parametrize("transport", ["auto", "nccl-rules"])
def test_sigterm_to_one_stage_stops_every_rank_within_seconds(tmp_path, transport):
    """Before: the signalled rank waited in Lightning's SIGTERM broadcast from rank 0, every rank for `timeout`.
    Under NCCL's rules on gloo too (tag 0, batched groups: the stop must not leave a message matched out of order)."""
    stamp = str(tmp_path / "signalled")
    callbacks = [SignalAtBatch(rank=1, batch=2, signum=signal.SIGTERM, stamp=stamp)]
    ends = spawn(2, _fit_outcome, 60, callbacks, transport, timeout=120)
    stopped, peer = ends[1], ends[0]
    assert stopped["error"] == "StageTerminated", stopped
    assert "SIGTERM: pipeline stage 1 (global rank 1) stopped at step 3" in stopped["message"]
    assert stopped["code"] and stopped["code"] != 0  # a SIGTERM-stopped fit exits non-zero
    assert peer["error"] == "PeerFailure" and "stage 1 (global rank 1)" in peer["message"], peer
    signalled = float(open(stamp).read())
    assert max(stopped["ended"], peer["ended"]) - signalled < 45  # well under the 60 s timeout (loaded CI cores are slow)


def test_silent_stage_is_timed_out_and_named(tmp_path):
    """SIGSTOP: the stage neither dies nor answers. Before: the pipeline groups had torch's 30-minute timeout."""
    stamp = str(tmp_path / "stopped")
    callbacks = [SignalAtBatch(rank=1, batch=2, signum=signal.SIGSTOP, stamp=stamp)]
    (peer,) = spawn(2, _fit_outcome, 5, callbacks, timeout=90, reporting=1)  # rank 1 never reports
    assert peer["error"] == "PeerFailure", peer
    assert "stage 1 (global rank 1) stopped answering" in peer["message"] and "Timed out" in peer["message"], peer["message"]
    waited = peer["ended"] - float(open(stamp).read())
    assert 4 < waited < 30, waited


# ---- SIGTERM outside training batches: evaluation on its own, the final drain --------------------------------
EVAL_BATCHES = 12


class EvalData(TinyData):
    """Twelve validation and twelve test batches: a SIGTERM at the second must not wait for the twelfth."""

    def val_dataloader(self):
        import torch

        g = torch.Generator().manual_seed(2)
        return torch.utils.data.DataLoader([torch.randint(0, 257, (17,), generator=g) for _ in range(8 * EVAL_BATCHES)], batch_size=8)

    test_dataloader = val_dataloader


class SigtermAt(L.Callback):
    """SIGTERM to rank ``rank`` at the start of evaluation batch 1, or as training ends (before the final drain)."""

    def __init__(self, rank: int, where: str) -> None:
        self.rank, self.where, self.evaluated = rank, where, 0

    def _fire(self, trainer, here: str) -> None:
        if trainer.global_rank == self.rank and here == self.where:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer, pl_module) -> None:
        self._fire(trainer, "drain")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.evaluated += 1
        if batch_idx == 1:
            self._fire(trainer, "validate")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.evaluated += 1
        if batch_idx == 1:
            self._fire(trainer, "test")


def _sigterm_outside_training(timeout: float) -> dict:
    """Three runs on the same two ranks, each on a fresh group: SIGTERM to rank 1 as fit ends, to rank 1 during a
    plain validate, to rank 0 during a plain test. How each rank ended and how many batches it started."""
    from lightning_async.lm import CausalLM

    outcomes = {}
    for where, rank in (("drain", 1), ("validate", 1), ("test", 0)):
        as_torchrun(timeout=120)
        L.seed_everything(0)
        signal_at = SigtermAt(rank, where)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(n_microbatches=2, timeout=timeout), max_steps=3,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[signal_at], num_sanity_val_steps=0, limit_val_batches=0 if where == "drain" else None,
        )
        run = trainer.fit if where == "drain" else getattr(trainer, where)
        try:
            run(CausalLM(vocab_size=257, model_overrides=SHAPE), datamodule=EvalData())
            outcomes[where] = {"error": None}
        except BaseException as err:  # StageTerminated is a SystemExit
            outcomes[where] = {"error": type(err).__name__, "message": str(err)}
        outcomes[where]["batches"] = signal_at.evaluated
    return outcomes


@pytest.mark.slow
def test_sigterm_in_evaluation_or_the_final_drain_stops_at_once():
    """Before: a SIGTERM was acted on only at the next training batch, so a plain validate or test ran all its
    batches and exited 0, and one during the final drain was ignored (the fit ended normally)."""
    ranks = spawn(2, _sigterm_outside_training, 10, timeout=300)
    drain, validate, test = (tuple(r[where] for r in ranks) for where in ("drain", "validate", "test"))
    # as fit ends: the signalled rank drains, then stops; the other has nothing left to wait for
    assert drain[1]["error"] == "StageTerminated", drain
    assert "pipeline stage 1 (global rank 1) stopped after the final drain (step 3)" in drain[1]["message"]
    assert drain[0]["error"] is None
    # a plain validate: the signalled stage stops before its next batch, the other stage is told
    assert validate[1]["error"] == "StageTerminated" and validate[1]["batches"] == 2, validate
    assert "stage 1 (global rank 1) stopped at validate batch 1" in validate[1]["message"]
    assert validate[0]["error"] == "PeerFailure" and validate[0]["batches"] <= 3, validate
    # a plain test, the first stage signalled
    assert test[0]["error"] == "StageTerminated" and test[0]["batches"] == 2, test
    assert "stage 0 (global rank 0) stopped at test batch 1" in test[0]["message"]
    assert test[1]["error"] == "PeerFailure" and test[1]["batches"] <= 3, test
