"""Pipeline checkpoints as the strategy writes and reads them: every rank together, through one object.

The on-disk format (a directory of ``stage-NN.ckpt`` files plus ``meta.json`` written last, renamed into place)
and its checks live in :mod:`lightning_async.pipeline.checkpoint`; this module is the collective part: which
rank writes what, the barriers between the steps of a save, and the check on load that every rank's file
belongs to one checkpoint of this run's split, so all ranks refuse alike before training.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from lightning_async.pipeline import checkpoint as layout
from lightning_async.pipeline import distributed_checkpoint as distributed
from lightning_async.pipeline.p2p import PeerFailure


class PipelineCheckpoints:
    """Saves, loads and removes the pipeline checkpoints of ``strategy`` (an ``AsyncPipelineStrategy``)."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy

    # ---- save -------------------------------------------------------------------------------------
    def save(self, checkpoint: dict[str, Any], filepath) -> None:
        """A directory with one file per stage plus ``meta.json``, written atomically.

        The stages write into ``<filepath>.partial``; rank 0 writes ``meta.json`` last and renames the directory
        into place. A save that fails (a rank died or stopped answering) removes its partial directory on every
        surviving rank; the previous checkpoints stay whole.
        """
        s, filepath = self.strategy, str(filepath)
        try:
            if s.global_rank == 0:
                layout.begin_save(filepath)
            self._barrier("prepared", filepath)
            staging = layout.staging_dir(filepath)
            if s.checkpoint_format == "dcp":
                self._save_distributed(checkpoint, staging)
            else:
                self._save_stage_files(checkpoint, staging)
            self._barrier("written", filepath)
            if s.global_rank == 0:
                meta = {**self._split(), "global_step": checkpoint.get("global_step"), "optimizer_shares": self._shares}
                if s.checkpoint_format == "dcp":
                    meta.update(format="dcp", optimizer_shares=None, data_parallel_size=s.data_parallel_size)
                layout.publish(filepath, meta)
            self._barrier("published", filepath)
        except BaseException:
            layout.discard_save(filepath)
            raise

    def _save_stage_files(self, checkpoint: dict, staging: str) -> None:
        """Replica 0 of each stage writes the stage file; under the sharded optimizer every other replica writes its
        share of the optimizer state beside it."""
        s, replica = self.strategy, self.strategy.data_parallel_rank
        if s.runtime is not None and (replica == 0 or self._shares > 1):
            checkpoint["pipeline_runtime"] = s.runtime.state_dict()
        if replica == 0:
            checkpoint["pipeline"] = {"stage": s.stage, **self._split()}
            s.checkpoint_io.save_checkpoint(checkpoint, layout.stage_file(staging, s.stage))
        elif self._shares > 1:
            share = layout.replica_share(checkpoint, s.stage, replica)
            s.checkpoint_io.save_checkpoint(share, layout.replica_file(staging, s.stage, replica))

    def _save_distributed(self, checkpoint: dict, staging: str) -> None:
        """Every rank writes what it holds, keyed by global names (:mod:`~lightning_async.pipeline.distributed_checkpoint`)."""
        s = self.strategy
        if s.runtime is not None:
            checkpoint["pipeline_runtime"] = s.runtime.state_dict()
        params = s.runtime.params if s.runtime is not None else []
        optimizer = s.optimizers[0] if s.optimizers else None
        names = distributed.parameter_names(s.lightning_module)
        distributed.save(distributed.rank_state(checkpoint, optimizer, params, names, with_trainer=s.global_rank == 0), staging)

    def _distributed_request(self, path: str) -> distributed.RankRequest:
        """What this rank reads of a DCP checkpoint, in this run's layout (on its own: no collective)."""
        s = self.strategy
        runtime, fitting = s.runtime, s.lightning_module.trainer.state.fn == TrainerFn.FITTING
        try:
            return distributed.RankRequest(
            distributed.saved_keys(path), s.lightning_module.state_dict(), s.optimizers[0] if fitting and s.optimizers else None,
            runtime.params if runtime is not None else [], runtime.version_layout() if runtime is not None else 1,
            distributed.parameter_names(s.lightning_module),
            owned=runtime.owned if runtime is not None else None,
            )
        except Exception as err:  # (every rank reports before any reads: none may raise alone and hang the others)
            raise ValueError(f"Checkpoint {path}: {err}" if isinstance(err, ValueError) else
                             f"Cannot read pipeline checkpoint {path} ({type(err).__name__}: {err}): its metadata is "
                             "damaged or from another model. Resume from another checkpoint.") from err

    @property
    def _shares(self) -> int:
        """How many replicas write a share of each stage's optimizer state (1: replica 0 writes it all)."""
        runtime = self.strategy.runtime
        return self.strategy.data_parallel_size if runtime is not None and runtime.owned is not None else 1

    def _split(self) -> dict:
        s = self.strategy
        return {"stages": s.pipeline_parallel_size, "units": s.stage_units, "schedule": s.schedule}

    def _barrier(self, what: str, filepath: str) -> None:
        try:
            self.strategy.barrier(f"pipeline_checkpoint_{what}")
        except Exception as err:
            raise PeerFailure(
                f"A pipeline rank stopped answering while checkpoint {filepath} was saved ({err}). The partial save is "
                "removed; earlier checkpoints are whole. Look at the other ranks' logs for the original error."
            ) from err

    # ---- saves a crash interrupted -------------------------------------------------------------------
    def recover_before_launch(self, trainer) -> None:
        """In the process that starts the others, before it does (Lightning's script and spawn launchers): finish the
        saves a crash interrupted in the checkpoint callbacks' directories, so ``ckpt_path="last"`` sees the newest
        checkpoint. Ranks started by torchrun or SLURM all run this too, at once: they leave it to setup."""
        if self.strategy.cluster_environment.creates_processes_externally:
            return
        for repair in self._recover(trainer):
            rank_zero_info(str(repair))

    def recover_at_setup(self, trainer) -> None:
        """On every rank (a collective): the same, by rank 0. Under torchrun or SLURM no process runs before the
        ranks, and Lightning resolves ``ckpt_path`` (``"last"``) before the strategy's setup, so a checkpoint this
        repair puts in place may not be the one this run resumes from: every rank refuses, and the next start
        resumes from it. (Under Lightning's own launchers the repair happened before launch; nothing is left.)"""
        repairs = self._recover(trainer) if self.strategy.global_rank == 0 else None
        if dist.is_initialized() and self.strategy.world > 1:
            repairs = self.strategy.broadcast(repairs)
        changed = [r for r in repairs if r.changes_checkpoint]
        if changed:
            raise ValueError(
                " ".join(str(r) for r in changed) + " This run chose its checkpoint (ckpt_path) before the repair: "
                "start it again to resume from the repaired checkpoint."
            )
        for repair in repairs:
            rank_zero_info(str(repair))

    @staticmethod
    def _recover(trainer) -> list:
        directories = sorted({str(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)})
        return [repair for directory in directories for repair in layout.recover(directory)]

    # ---- load -------------------------------------------------------------------------------------
    def load(self, checkpoint_path) -> dict[str, Any]:
        """This stage's file of a pipeline checkpoint directory (a collective: every rank checks its file, and all
        refuse alike, before training, a checkpoint that is incomplete, damaged, mixed or split differently)."""
        s = self.strategy
        path = layout.resolve(str(checkpoint_path))
        checkpoint, identity, problem, meta, request = None, None, None, None, None
        try:
            meta = layout.read_meta(path)
            if meta.get("format") == "dcp":
                request = self._distributed_request(path)
            elif s.fsdp:
                raise ValueError(
                    f"Checkpoint {path} is in the per-stage format, which fsdp=True does not load. Convert it: resume it "
                    "once without fsdp and with checkpoint_format='dcp', and save."
                )
            elif meta["stages"] != s.pipeline_parallel_size:
                raise ValueError(
                    f"Checkpoint {path} has {meta['stages']} stages, this run has {s.pipeline_parallel_size}. Resume "
                    "with the same pipeline_parallel_size, or convert it: resume once on its own layout with "
                    "checkpoint_format='dcp' and save (that format moves between stage and replica counts)."
                )
            else:
                read = lambda file: s.checkpoint_io.load_checkpoint(file, weights_only=False)  # noqa: E731
                checkpoint = layout.load_stage(path, s.stage, read)
                shares = [layout.load_stage(path, s.stage, read, replica=r) for r in range(1, meta.get("optimizer_shares", 1))]
                checkpoint = layout.merge_replica_shares(path, checkpoint, shares)
                identity = layout.stage_identity(checkpoint)
        except ValueError as err:
            meta, problem = None, str(err)
        reports = [(s.stage, problem, identity)]
        if dist.is_initialized() and s.world > 1:
            reports = [None] * s.world
            dist.all_gather_object(reports, (s.stage, problem, identity))
        problems = list(dict.fromkeys(p for _, p, _ in reports if p))
        if problems:
            raise ValueError(" ".join(problems))
        if request is not None:
            return self._finish_distributed_load(path, request)
        by_stage = {stage: ident for stage, _, ident in reports}
        problem = layout.mismatch(path, [by_stage[i] for i in range(s.pipeline_parallel_size)], meta)
        if problem:
            raise ValueError(problem)
        self._check_resumable(path, identity)
        return checkpoint

    def _finish_distributed_load(self, path: str, request) -> dict:
        try:
            request.load(path)
        except Exception as err:
            raise ValueError(
                f"Cannot read pipeline checkpoint {path} ({type(err).__name__}: {str(err).splitlines()[0]}). A file of "
                "it is damaged (a truncated copy or an interrupted write): resume from another checkpoint."
            ) from err
        checkpoint = request.checkpoint()
        schedule = (checkpoint.get("pipeline_runtime") or {}).get("schedule")
        self._check_resumable(path, {"units": None, "schedule": schedule})
        return checkpoint

    def _check_resumable(self, path: str, identity: dict) -> None:
        """The checkpoint's split (and, to train on, its schedule) must be this run's."""
        s = self.strategy
        saved = identity["units"]
        if saved is not None and [list(u) for u in saved] != [list(u) for u in s.stage_units]:
            raise ValueError(
                f"Checkpoint {path} splits the model into stages as {saved}, this run as {s.stage_units} "
                f"(partition={s.partition!r}). Resume with the checkpoint's split: "
                f"partition={layout.split_boundaries(saved)!r} (the units where stages 1.. begin)."
            )
        fitting = s.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and identity["schedule"] not in (None, s.schedule):
            raise ValueError(
                f"Checkpoint {path} was written with schedule {identity['schedule']!r}, this run uses {s.schedule!r}: "
                "resume with the same schedule (evaluation may use any)."
            )

    # ---- remove -----------------------------------------------------------------------------------
    def remove(self, filepath) -> None:
        if self.strategy.global_rank == 0 and os.path.isdir(str(filepath)):
            shutil.rmtree(str(filepath))


class PipelineAwareCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO that refuses a pipeline checkpoint directory with a clear message (instead of
    ``IsADirectoryError``) in runs without the pipeline strategy: ``Trainer(plugins=[PipelineAwareCheckpointIO()])``."""

    def load_checkpoint(self, path, *args, **kwargs):
        layout.refuse_pipeline_checkpoint(path)
        return super().load_checkpoint(path, *args, **kwargs)
