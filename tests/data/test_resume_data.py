"""Resuming from any checkpoint continues the data where the interrupted run was, mid-epoch or not."""

from __future__ import annotations

import random
import warnings

import pytest
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async.lm import CausalLM
from lightning_async.data import TextDataModule
from lightning_async.data.sampler import ResumableShuffleSampler

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")

STEPS = 12
BATCHES_PER_EPOCH = 5


class BatchLog(Callback):
    """Records (epoch, fingerprint of the batch) for every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((trainer.current_epoch, hash(tuple(batch[:, :6].flatten().tolist()))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    # 863 bytes: 21 training windows of 33 bytes (5 batches of 4, one window dropped) and 5 validation ones
    path.write_text(" ".join(rng.choice(words) for _ in range(150)))
    return path


def fit(corpus, root, ckpt_path=None, max_epochs=None, num_workers=0):
    seed_everything(0)
    log = BatchLog()
    data = TextDataModule(source="text", path=str(corpus), seq_len=32, batch_size=4, val_fraction=0.2,
                          cache_dir=str(root / "cache"), progress=False, num_workers=num_workers)
    model = CausalLM(model="tiny", lr=1e-3)
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS if max_epochs is None else -1, max_epochs=max_epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[log, checkpoints],
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return log.seen, data


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    seen, data = fit(corpus, root)
    return root, seen, data


def test_epochs_have_the_expected_length_and_new_orders(uninterrupted):
    _, seen, data = uninterrupted
    assert len(data.train_dataloader()) == BATCHES_PER_EPOCH
    assert len(seen) == STEPS
    epochs = [e for e, _ in seen]
    assert epochs == [s // BATCHES_PER_EPOCH for s in range(STEPS)]
    first, second = [f for e, f in seen if e == 0], [f for e, f in seen if e == 1]
    assert first != second  # each epoch is a new permutation


# mid-epoch, at the end of epoch 0, mid-epoch 1 (also with a worker process), mid-epoch 2
@pytest.mark.parametrize("step, workers", [(3, 0), (5, 0), (7, 0), (7, 1), (10, 0)])
def test_resume_continues_with_the_next_batch(uninterrupted, corpus, tmp_path, step, workers):
    root, seen, _ = uninterrupted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed, _ = fit(corpus, tmp_path, ckpt_path=str(root / "ckpt" / f"step={step}.ckpt"), num_workers=workers)
    assert resumed == seen[step:]
    assert not [w for w in caught if "not resumable" in str(w.message)]  # Lightning knows the loader resumes


def test_sampler_without_trainer_starts_a_new_epoch_per_iteration():
    sampler = ResumableShuffleSampler(range(12), batch_size=4, seed=3)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == list(range(12)) and first != second
    sampler.set_epoch(0)
    assert list(sampler) == first  # the permutation depends on (seed, epoch) only


def test_sampler_skips_trained_batches_and_shards():
    point = {"value": (1, 2)}
    sampler = ResumableShuffleSampler(range(24), batch_size=3, seed=5, num_replicas=2, rank=1, resume_point=lambda: point["value"])
    full = ResumableShuffleSampler(range(24), batch_size=3, seed=5, num_replicas=2, rank=1)
    full.set_epoch(1)
    assert list(sampler) == list(full)[6:]  # epoch 1, two batches of 3 already trained on this replica
    point["value"] = (1, 4)  # the whole epoch (12 samples / 3) was trained: the next epoch starts afresh
    full.set_epoch(2)
    epoch2 = list(full)
    assert list(sampler) == epoch2
    other = ResumableShuffleSampler(range(24), batch_size=3, seed=5, num_replicas=2, rank=0)
    other.set_epoch(2)
    assert not set(other) & set(epoch2)  # replicas see disjoint shards
