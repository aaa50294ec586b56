"""Pipeline checkpoints: atomic as a directory, and refused (on every rank, with the file named) when incomplete,
damaged, mixed from several saves or split differently from the run that resumes them."""

from __future__ import annotations

import os
import shutil

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from _pipeline_harness import as_torchrun, spawn
from test_strategy import SHAPE, TinyData

from lightning_async.lm import CausalLM
from lightning_async.pipeline import checkpoint as ckpt
from lightning_async.strategies.checkpoints import PipelineAwareCheckpointIO
from lightning_async.strategies import AsyncPipelineStrategy


# ---- the directory protocol, without processes --------------------------------------------------------------
def _write(path: str, step: int, stages: int = 2) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = ckpt.begin_save(path)
    for s in range(stages):
        torch.save({"global_step": step, "pipeline": {"stage": s, "units": [["a"], ["b"]]}, "state_dict": {}}, ckpt.stage_file(staging, s))
    ckpt.publish(path, {"stages": stages, "units": [["a"], ["b"]], "global_step": step})


def test_publish_replaces_a_checkpoint_whole_and_leaves_nothing_behind(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _write(path, 2)
    _write(path, 4)  # overwritten in place, as ModelCheckpoint does with last.ckpt
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert sorted(os.listdir(path)) == ["meta.json", "stage-00.ckpt", "stage-01.ckpt"]
    assert ckpt.read_meta(path)["global_step"] == 4


def test_a_save_killed_before_its_marker_leaves_the_old_checkpoint(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _write(path, 2)
    staging = ckpt.begin_save(path)  # the stages write, then the process dies before publish()
    torch.save({"global_step": 4}, ckpt.stage_file(staging, 0))
    assert ckpt.read_meta(path)["global_step"] == 2
    assert ckpt.resolve(path) == path
    ckpt.begin_save(path)  # the next save clears the leftovers first
    assert os.listdir(staging) == []
    ckpt.discard_save(path)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_crash_between_the_two_renames_is_resolved(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _write(path, 2)
    os.rename(path, path + ".old")  # publish() died right after moving the old checkpoint aside
    assert ckpt.resolve(path) == path + ".old"
    _write(str(tmp_path / "elsewhere" / "next.ckpt"), 4)
    os.rename(tmp_path / "elsewhere" / "next.ckpt", path + ".partial")  # ... or with the new one complete and unrenamed
    assert ckpt.resolve(path) == path + ".partial"


def _crash_between_the_renames(path: str) -> None:
    """The disk as publish() leaves it when the process dies between its two renames: the step-2 checkpoint moved
    to .old, the complete step-4 one still in .partial, nothing at ``path``."""
    _write(path, 2)
    os.rename(path, path + ".old")
    newer = os.path.join(os.path.dirname(path), "elsewhere", "new.ckpt")
    _write(newer, 4)  # (written elsewhere: a save in this directory would repair it first)
    os.rename(newer, path + ".partial")
    os.rmdir(os.path.dirname(newer))


def test_a_crash_between_the_renames_is_finished_not_thrown_away(tmp_path):
    """Before: the next save of the same name began by deleting the complete .partial (the newest checkpoint); had
    that save died too, only the older .old was left (and it was never removed)."""
    path = str(tmp_path / "last.ckpt")
    _crash_between_the_renames(path)
    with pytest.warns(UserWarning, match="a crash had interrupted its save .* now in place"):
        staging = ckpt.begin_save(path)  # the resumed run saves again, and dies before publish()
    torch.save({"global_step": 6}, ckpt.stage_file(staging, 0))
    assert ckpt.resolve(path) == path and ckpt.read_meta(path)["global_step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.partial"]
    assert ckpt.recover(tmp_path) == [ckpt.Repair(path, "cleaned")]  # the killed save's stage file
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"] and ckpt.read_meta(path)["global_step"] == 4


def test_recover_puts_the_previous_checkpoint_back_when_no_save_completed(tmp_path):
    path = str(tmp_path / "last.ckpt")
    _write(path, 2)
    os.rename(path, path + ".old")
    os.makedirs(path + ".partial")  # (a save's staging without its marker)
    assert ckpt.recover(tmp_path) == [ckpt.Repair(path, "restored")]
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"] and ckpt.read_meta(path)["global_step"] == 2


def test_leftovers_under_other_names_are_cleared_and_nothing_a_user_saved(tmp_path):
    """Before: a killed save's step=4.ckpt.partial and a leftover last.ckpt.old stayed forever (only a later save of
    the same name cleared them)."""
    _write(str(tmp_path / "step=2.ckpt"), 2)
    _write(str(tmp_path / "last.ckpt"), 2)
    staging = ckpt.begin_save(str(tmp_path / "step=4.ckpt"))  # killed during the save
    torch.save({"global_step": 4}, ckpt.stage_file(staging, 1))
    shutil.copytree(tmp_path / "last.ckpt", tmp_path / "last.ckpt.old")  # a swap finished, its removal did not
    os.makedirs(tmp_path / "notes.partial")  # not ours: other files inside
    (tmp_path / "notes.partial" / "todo.txt").write_text("keep me")
    (tmp_path / "data.old").write_text("keep me too")
    with pytest.warns(UserWarning, match="removed what an interrupted save left"):
        _write(str(tmp_path / "step=6.ckpt"), 6)
    assert sorted(os.listdir(tmp_path)) == ["data.old", "last.ckpt", "notes.partial", "step=2.ckpt", "step=6.ckpt"]
    assert (tmp_path / "notes.partial" / "todo.txt").read_text() == "keep me"


def test_a_plain_file_at_the_path_is_kept_and_the_checkpoint_written_whole(tmp_path):
    """Before: publish() moved the file to last.ckpt.old, put the checkpoint in place, then failed on rank 0 with
    NotADirectoryError removing the file (the other ranks: PeerFailure, the fit lost)."""
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"a plain Lightning checkpoint")
    with pytest.warns(UserWarning, match="was not a pipeline checkpoint directory; it is kept as .*last.ckpt.kept"):
        _write(str(path), 4)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "last.ckpt.kept"]
    assert ckpt.read_meta(path)["global_step"] == 4
    assert (tmp_path / "last.ckpt.kept").read_bytes() == b"a plain Lightning checkpoint"


def test_lightnings_launchers_repair_before_last_is_resolved(tmp_path):
    """Lightning resolves ckpt_path="last" (a .ckpt whose name starts with last) in every rank before the strategy's
    setup; the launching process repairs the checkpoint callbacks' directories before it starts them."""
    path = str(tmp_path / "last.ckpt")
    _crash_between_the_renames(path)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(start_method="spawn"), logger=False,
                        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), filename="last")])
    trainer.strategy.validate_launch(trainer)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"] and ckpt.read_meta(path)["global_step"] == 4


def test_an_incomplete_directory_is_refused(tmp_path):
    path = str(tmp_path / "step=4.ckpt")
    _write(path, 4)
    os.remove(os.path.join(path, "meta.json"))
    with pytest.raises(ValueError, match="step=4.ckpt is incomplete: meta.json, written last, is missing"):
        ckpt.read_meta(path)


def test_a_truncated_stage_file_is_named(tmp_path):
    """Before: torch's 'failed reading zip archive' without the file's name."""
    path = str(tmp_path / "step=4.ckpt")
    _write(path, 4)
    file = ckpt.stage_file(path, 1)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match=r"Cannot read pipeline checkpoint file .*stage-01\.ckpt .*damaged"):
        ckpt.consolidate(path)


def test_stage_files_of_different_steps_are_refused(tmp_path):
    """Before: consolidate() merged them silently."""
    old, new = str(tmp_path / "step=2.ckpt"), str(tmp_path / "step=4.ckpt")
    _write(old, 2)
    _write(new, 4)
    shutil.copy(ckpt.stage_file(old, 1), ckpt.stage_file(new, 1))
    with pytest.raises(ValueError, match=r"mixes stage files: expected step 4, but .*stage-01\.ckpt \(step 2\)"):
        ckpt.consolidate(new)


def test_a_single_device_run_refuses_a_pipeline_checkpoint_clearly(tmp_path):
    """Before: IsADirectoryError from torch.load."""
    path = str(tmp_path / "step=4.ckpt")
    _write(path, 4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[PipelineAwareCheckpointIO()],
    )
    with pytest.raises(ValueError, match="is a pipeline checkpoint .*strategy=async_pipe.*python -m lightning_async.pipeline.checkpoint"):
        trainer.fit(CausalLM(vocab_size=257, model_overrides=SHAPE), datamodule=TinyData(), ckpt_path=path)
    ckpt.refuse_pipeline_checkpoint(str(tmp_path))  # a plain directory is not refused
    ckpt.refuse_pipeline_checkpoint(None)


# ---- through the strategy, on two ranks ---------------------------------------------------------------------------
def _fit(steps: int, callbacks=(), ckpt_path=None, plugins=(), **strategy) -> L.Trainer:
    L.seed_everything(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(n_microbatches=2, **strategy), max_steps=steps,
        logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        callbacks=list(callbacks), limit_val_batches=0, num_sanity_val_steps=0, plugins=list(plugins),
    )
    trainer.fit(CausalLM(vocab_size=257, model_overrides=SHAPE, lr=3e-3), datamodule=TinyData(), ckpt_path=ckpt_path)
    return trainer


def _every(dirpath: str, filename: str, steps: int = 2, **kwargs) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=dirpath, filename=filename, every_n_train_steps=steps, enable_version_counter=False, **kwargs)


def _refusals(tmp: str) -> dict:
    import torch.distributed as dist

    rank = as_torchrun()
    root, last = os.path.join(tmp, "ckpt"), os.path.join(tmp, "last")
    _fit(4, callbacks=[_every(root, "{step}", save_top_k=-1), _every(last, "last", steps=1)])  # last.ckpt: overwritten 4 times
    step4 = os.path.join(root, "step=4.ckpt")
    broken = {name: os.path.join(tmp, name) for name in ("mixed", "truncated", "incomplete")}
    if rank == 0:
        for path in broken.values():
            shutil.copytree(step4, path)
        shutil.copy(os.path.join(root, "step=2.ckpt", "stage-01.ckpt"), os.path.join(broken["mixed"], "stage-01.ckpt"))
        file = os.path.join(broken["truncated"], "stage-01.ckpt")
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 2)
        os.remove(os.path.join(broken["incomplete"], "meta.json"))
    dist.barrier()
    out = {"listing": sorted(os.listdir(root)), "last_listing": sorted(os.listdir(last)), "last_meta": ckpt.read_meta(os.path.join(last, "last.ckpt"))}
    attempts = {name: dict(ckpt_path=path) for name, path in broken.items()}
    attempts["partition"] = dict(ckpt_path=step4, partition=["model.blocks.1"])
    attempts["schedule"] = dict(ckpt_path=step4, schedule="1f1b")
    attempts["intact"] = dict(ckpt_path=step4)  # control: the checks pass a good checkpoint (last: it trains on)
    for name, kwargs in attempts.items():
        try:
            out[name] = _fit(6, **kwargs).global_step
        except ValueError as err:
            out[name] = str(err)
    # last.ckpt (step 4) caught by a crash between the two renames of a save, then resumed with ckpt_path="last"
    if rank == 0:
        os.rename(os.path.join(last, "last.ckpt"), os.path.join(last, "last.ckpt.partial"))
        shutil.copytree(os.path.join(root, "step=2.ckpt"), os.path.join(last, "last.ckpt.old"))
    dist.barrier()
    out["resume_last"] = []
    for _ in range(2):
        started = StartStep()
        try:
            trainer = _fit(6, callbacks=[_every(last, "last"), started], ckpt_path="last")
            out["resume_last"].append((started.step, trainer.global_step))
        except ValueError as err:
            out["resume_last"].append(str(err))
    out["last_after_resume"] = (sorted(os.listdir(last)), ckpt.read_meta(os.path.join(last, "last.ckpt"))["global_step"])
    return out


class StartStep(L.Callback):
    step = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.step = trainer.global_step


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    return spawn(2, _refusals, str(tmp_path_factory.mktemp("refuse")), timeout=300)


def test_checkpoints_are_written_whole(refusals):
    assert refusals[0]["listing"] == ["step=2.ckpt", "step=4.ckpt"]  # no partial directories left
    assert refusals[0]["last_listing"] == ["last.ckpt"] and refusals[0]["last_meta"]["global_step"] == 4


@pytest.mark.parametrize("case, message", [
    ("mixed", r"mixes stage files: expected step 4, but \S*mixed/stage-01\.ckpt \(step 2\)"),
    ("truncated", r"Cannot read pipeline checkpoint file \S*truncated/stage-01\.ckpt"),
    ("incomplete", r"incomplete: meta\.json, written last, is missing"),
    ("partition", r"splits the model into stages as .*partition=\['model\.blocks\.2'\]"),
    ("schedule", r"written with schedule '2bw', this run uses '1f1b'"),
])
def test_a_bad_checkpoint_is_refused_on_every_rank(refusals, case, message):
    """Before: mixed and re-split checkpoints trained on (or failed with 'Unexpected key(s)'), a truncated one
    failed with torch's message on one rank only."""
    import re

    for rank in refusals:
        assert isinstance(rank[case], str) and re.search(message, rank[case]), rank[case]
    assert refusals[0][case] == refusals[1][case]


def test_a_good_checkpoint_still_resumes(refusals):
    assert [rank["intact"] for rank in refusals] == [6, 6]


@pytest.mark.slow
def test_resume_last_after_a_crash_between_the_renames(refusals):
    """Before: Lightning found no last*.ckpt (only last.ckpt.partial and .old), warned and trained from step 0, and
    its first save deleted the complete .partial. Under torchrun every rank now refuses once, after the repair (the
    checkpoint was chosen before the strategy could repair it), and the next start resumes from step 4."""
    for rank in refusals:
        refused, resumed = rank["resume_last"]
        assert isinstance(refused, str) and "last.ckpt: a crash had interrupted its save" in refused, refused
        assert "start it again to resume from the repaired checkpoint" in refused
        assert resumed == (4, 6)
    assert refusals[0]["resume_last"][0] == refusals[1]["resume_last"][0]
    assert refusals[0]["last_after_resume"] == (["last.ckpt"], 6)


class DieDuringSecondSave(TorchCheckpointIO):
    """Rank 1 writes half of its stage file at the second save, then dies (kill -9 in the middle of a write)."""

    def __init__(self) -> None:
        self.saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves += 1
        if int(os.environ["RANK"]) == 1 and self.saves == 2:
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04" + b"\0" * 1000)
            os._exit(17)
        super().save_checkpoint(checkpoint, path, storage_options)


def _killed_save(tmp: str) -> dict:
    as_torchrun(timeout=30)
    last = os.path.join(tmp, "last")
    try:
        _fit(6, callbacks=[_every(last, "last")], plugins=[DieDuringSecondSave()], timeout=30)
        error = None
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    path = os.path.join(last, "last.ckpt")
    steps = [ckpt.stage_identity(torch.load(f, weights_only=False))["global_step"] for f in ckpt.stage_files(path)]
    return {"error": error, "listing": sorted(os.listdir(last)), "steps": steps}


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path):
    """Before: last.ckpt held stage 0 at step 4 and a broken stage 1 file."""
    (survivor,) = spawn(2, _killed_save, str(tmp_path), timeout=120, reporting=1)
    assert survivor["error"].startswith("PeerFailure") and "while checkpoint" in survivor["error"], survivor["error"]
    assert survivor["listing"] == ["last.ckpt"]  # the partial save was removed
    assert survivor["steps"] == [2, 2]
