"""The on-disk format of pipeline checkpoints: a directory with ``meta.json`` and one ``stage-NN.ckpt`` per stage.

Under the sharded optimizer (ZeRO-1) each further replica ``r`` of a stage adds ``stage-NN.replica-RR.ckpt``: its
share of the optimizer state and of the correction's buffers (``meta.json``'s ``optimizer_shares`` says how many
replicas wrote one). On load the shares of a stage are merged (:func:`merge_replica_shares`), so a checkpoint moves
between replica counts and between sharded and unsharded runs of the same split.

(No Lightning here: the strategy's collective save and load are in :mod:`lightning_async.strategies.checkpoints`.)

Writing is atomic as a directory: the stages write into ``<path>.partial``, then rank 0 writes
``meta.json`` (the completion marker, always last) and renames the directory into place (an older
checkpoint of the same name is moved to ``<path>.old`` for the instant of the swap, then removed; a plain
file or a foreign directory at ``<path>`` is kept as ``<path>.kept``). A crash at any moment leaves either
the old or the new checkpoint whole; :func:`resolve` finds it even in the instant between the two renames,
and :func:`recover` finishes what such a crash left (the swap, the removal, a killed save's stage files).
On load, every stage file must belong to the same step, schedule and split (:func:`mismatch`).

:func:`consolidate` merges the stages' weights into the state dict of the plain, unsplit module, for
evaluation or export (``CausalLM(...).load_state_dict(consolidate(path))``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

MARKER = "meta.json"


def stage_file(path: str | os.PathLike, stage: int) -> str:
    return os.path.join(os.fspath(path), f"stage-{stage:02d}.ckpt")


def replica_file(path: str | os.PathLike, stage: int, replica: int) -> str:
    """Replica ``replica``'s share of stage ``stage``'s optimizer state (sharded optimizer; replica 0's is in the
    stage file)."""
    return os.path.join(os.fspath(path), f"stage-{stage:02d}.replica-{replica:02d}.ckpt")


def staging_dir(path: str | os.PathLike) -> str:
    """Where the stages write before the checkpoint is complete."""
    return os.fspath(path) + ".partial"


def _previous_dir(path: str | os.PathLike) -> str:
    return os.fspath(path) + ".old"


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MARKER))


def begin_save(path: str | os.PathLike) -> str:
    """Rank 0, before any stage writes: an empty staging directory, after :func:`recover` of its directory (so an
    interrupted save of the same name is finished, not thrown away, and killed saves leave nothing behind)."""
    for repair in recover(os.path.dirname(os.path.abspath(path))):
        warnings.warn(str(repair), stacklevel=2)
    staging = staging_dir(path)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def discard_save(path: str | os.PathLike) -> None:
    """Remove the staging directory of a save that failed (any rank may call it)."""
    shutil.rmtree(staging_dir(path), ignore_errors=True)


def publish(path: str | os.PathLike, meta: dict) -> None:
    """Rank 0, after every stage wrote its file: write the marker last, then move the checkpoint into place."""
    marker = os.path.join(staging_dir(path), MARKER)
    with open(marker + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(marker + ".tmp", marker)
    _move_into_place(os.fspath(path))


def _move_into_place(path: str) -> None:
    """The complete staging directory of ``path`` becomes ``path`` (the two renames of a save)."""
    staging, previous = staging_dir(path), _previous_dir(path)
    if os.path.lexists(path) and not _holds_only_checkpoint_files(path):
        kept = _unused_name(path + ".kept")  # not ours (a plain .ckpt file, another tool's directory): keep it
        os.rename(path, kept)
        warnings.warn(f"{path} was not a pipeline checkpoint directory; it is kept as {kept} and the pipeline "
                      "checkpoint is written in its place.", stacklevel=3)
    if os.path.exists(path):  # a checkpoint overwritten in place (``last.ckpt``)
        if os.path.lexists(previous) and not _remove_ours(previous):
            previous = _unused_name(previous)  # (something else is called <path>.old)
        os.rename(path, previous)
        os.rename(staging, path)
        shutil.rmtree(previous)
    else:
        os.rename(staging, path)


# what a pipeline checkpoint directory holds (and all that :func:`recover` ever removes)
_CHECKPOINT_FILE = re.compile(r"stage-\d+(\.replica-\d+)?\.ckpt|meta\.json(\.tmp)?|\.metadata|__\d+_\d+\.distcp")


def _holds_only_checkpoint_files(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and all(_CHECKPOINT_FILE.fullmatch(f) for f in os.listdir(path))


def _remove_ours(path: str) -> bool:
    """Remove ``path`` if it is a (partial) pipeline checkpoint directory; whether it did."""
    if _holds_only_checkpoint_files(path):
        shutil.rmtree(path)
        return True
    return False


def _unused_name(path: str) -> str:
    candidate, n = path, 0
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


@dataclass(frozen=True)
class Repair:
    """What :func:`recover` did to one checkpoint: ``finished`` (an interrupted save is now in place),
    ``restored`` (the previous checkpoint is back in place) or ``cleaned`` (leftovers removed, the checkpoint
    unchanged)."""

    path: str
    action: str

    @property
    def changes_checkpoint(self) -> bool:
        """Whether the checkpoint at ``path`` is now another (or newly there): a resume chosen before is stale."""
        return self.action in ("finished", "restored")

    def __str__(self) -> str:
        return {
            "finished": f"Pipeline checkpoint {self.path}: a crash had interrupted its save after every stage file "
                        "and meta.json were written; the complete checkpoint is now in place.",
            "restored": f"Pipeline checkpoint {self.path}: a crash had moved it aside during a save; it is back in place.",
            "cleaned": f"Pipeline checkpoint {self.path}: removed what an interrupted save left next to it.",
        }[self.action]


def recover(directory: str | os.PathLike) -> list[Repair]:
    """Finish or clean up every save in ``directory`` that a crash interrupted; what it did, per checkpoint.

    Run by one process while no save is in progress (rank 0 before a save, or the launching process before
    any rank starts). A complete ``<name>.partial`` (``meta.json`` is written last) is the newest checkpoint
    of ``<name>`` and is moved into place; an incomplete one is a killed save and is removed; ``<name>.old``
    is removed once ``<name>`` is whole (or put back if ``<name>`` is missing and no complete save replaces
    it). Only directories that hold nothing but stage files and ``meta.json`` are ever moved or removed.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    names = {entry[: -len(suffix)] for entry in os.listdir(directory) for suffix in (".partial", ".old") if entry.endswith(suffix)}
    repairs = []
    for name in sorted(names):
        path = os.path.join(directory, name)
        staging, previous = staging_dir(path), _previous_dir(path)
        action = None
        if is_complete(staging) and _holds_only_checkpoint_files(staging):
            _move_into_place(path)
            action = "finished"
        elif _remove_ours(staging):
            action = "cleaned"
        if os.path.lexists(previous) and _holds_only_checkpoint_files(previous):
            if not os.path.lexists(path) and is_complete(previous):
                os.rename(previous, path)
                action = "restored"
            elif is_complete(path):
                shutil.rmtree(previous)
                action = action or "cleaned"
        if action:
            repairs.append(Repair(path, action))
    return repairs


def resolve(path: str | os.PathLike) -> str:
    """``path``, or the complete checkpoint a save left next to it if it crashed between its two renames."""
    path = os.fspath(path)
    if not os.path.exists(path):
        for candidate in (staging_dir(path), _previous_dir(path)):
            if is_complete(candidate):
                return candidate
    return path


def read_meta(path: str | os.PathLike) -> dict:
    """``meta.json`` of a complete pipeline checkpoint; a clear error for anything else."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a pipeline checkpoint directory (expected meta.json and stage-NN.ckpt files inside).")
    if not is_complete(path):
        raise ValueError(
            f"Pipeline checkpoint {path} is incomplete: {MARKER}, written last, is missing (its save was interrupted). "
            "Resume from an earlier checkpoint."
        )
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def load_stage(path: str | os.PathLike, stage: int, load: Callable[[str], dict] | None = None,
               replica: int = 0) -> dict:
    """Stage ``stage``'s checkpoint dict (``replica`` > 0: that replica's optimizer share); a damaged or missing file
    is named in the error."""
    file = stage_file(path, stage) if replica == 0 else replica_file(path, stage, replica)
    if not os.path.isfile(file):
        raise ValueError(f"Pipeline checkpoint {os.fspath(path)} is incomplete: {file} is missing.")
    try:
        return load(file) if load is not None else torch.load(file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ValueError(
            f"Cannot read pipeline checkpoint file {file} ({type(err).__name__}: {err}). The file is damaged "
            "(a truncated copy or an interrupted write): resume from another checkpoint."
        ) from err


def replica_share(checkpoint: dict, stage: int, replica: int) -> dict:
    """What replica ``replica`` of a sharded stage writes beside the stage file: its share of the optimizer state
    (by the optimizer's parameter index, as in ``optimizer.state_dict()``) and of the correction's buffers."""
    runtime = checkpoint.get("pipeline_runtime") or {}
    return {
        "pipeline": {"stage": stage, "replica": replica},
        "global_step": checkpoint.get("global_step"),
        "optimizer_state": [o["state"] for o in checkpoint.get("optimizer_states", [])],
        "correction": runtime.get("correction"),
    }


def merge_replica_shares(path: str | os.PathLike, checkpoint: dict, shares: list[dict]) -> dict:
    """``checkpoint`` (a stage file) with the optimizer state and correction buffers of its other replicas' shares
    filled in; a share from another step is refused."""
    for share in shares:
        if share.get("global_step") != checkpoint.get("global_step"):
            raise ValueError(
                f"Pipeline checkpoint {os.fspath(path)} mixes files: replica {share['pipeline']['replica']}'s optimizer "
                f"share of stage {share['pipeline']['stage']} is from step {share.get('global_step')}, the stage file "
                f"from step {checkpoint.get('global_step')}. Resume from another checkpoint."
            )
        for optimizer, state in zip(checkpoint.get("optimizer_states", []), share["optimizer_state"]):
            optimizer["state"].update(state)
        saved, extra = (checkpoint.get("pipeline_runtime") or {}).get("correction"), share.get("correction")
        if saved is not None and extra is not None:
            for name, buffers in saved.items():
                if isinstance(buffers, list):
                    saved[name] = [mine if mine is not None else theirs for mine, theirs in zip(buffers, extra[name])]
    return checkpoint


def stage_identity(checkpoint: dict) -> dict:
    """What must agree between the stage files of one checkpoint: step, schedule and split."""
    pipeline = checkpoint.get("pipeline", {})
    runtime = checkpoint.get("pipeline_runtime") or {}
    return {
        "stage": pipeline.get("stage"),
        "global_step": checkpoint.get("global_step"),
        "schedule": runtime.get("schedule", pipeline.get("schedule")),
        "units": pipeline.get("units"),
    }


def mismatch(path: str | os.PathLike, identities: list[dict], meta: dict | None = None) -> str | None:
    """Why the stage files (identities by stage) do not form one checkpoint, or None if they do."""
    for stage, ident in enumerate(identities):
        if ident["stage"] not in (None, stage):
            return (
                f"Pipeline checkpoint {os.fspath(path)} mixes stage files: {stage_file(path, stage)} holds stage "
                f"{ident['stage']}. Resume from another checkpoint."
            )
    first = identities[0]
    for key, what in (("global_step", "step"), ("schedule", "schedule"), ("units", "split into stages")):
        values = [ident[key] for ident in identities]
        if meta is not None and key in meta and meta[key] is not None:
            expected = meta[key]
        elif all(v == values[0] for v in values):
            continue
        else:
            expected = first[key]
        odd = [s for s, v in enumerate(values) if v != expected]
        if odd:
            files = ", ".join(f"{stage_file(path, s)} ({what} {values[s]})" for s in odd)
            return (
                f"Pipeline checkpoint {os.fspath(path)} mixes stage files: expected {what} {expected}, but {files}. "
                "A checkpoint's stage files must come from one save: resume from another checkpoint."
            )
    return None


def split_boundaries(stage_units: list[list[str]]) -> list[str]:
    """The ``partition`` argument that reproduces ``stage_units``: the unit names where stages 1.. begin."""
    return [units[0] for units in stage_units[1:]]


def stage_files(path: str | os.PathLike) -> list[str]:
    path = resolve(path)
    stages = read_meta(path)["stages"]
    files = [stage_file(path, s) for s in range(stages)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"Pipeline checkpoint {path} is incomplete; missing {', '.join(missing)}.")
    return files


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model's ``state_dict`` (newest weights) from a pipeline checkpoint directory (either format)."""
    from lightning_async.pipeline import distributed_checkpoint

    if read_meta(resolve(path)).get("format") == "dcp":
        return distributed_checkpoint.consolidated_weights(resolve(path))
    files = stage_files(path)
    path = os.path.dirname(files[0])
    checkpoints = [load_stage(path, s) for s in range(len(files))]
    problem = mismatch(path, [stage_identity(c) for c in checkpoints])
    if problem:
        raise ValueError(problem)
    merged: dict[str, torch.Tensor] = {}
    for checkpoint in checkpoints:
        merged.update(checkpoint["state_dict"])
    return merged


def refuse_pipeline_checkpoint(path: str | os.PathLike | None) -> None:
    """Raise a clear error if ``path`` is a pipeline checkpoint directory (for runs without the pipeline strategy)."""
    if path is None or not os.path.isdir(os.fspath(path)):
        return
    path = os.fspath(path)
    stages = sorted(f for f in os.listdir(path) if f.startswith("stage-") and f.endswith(".ckpt"))
    if not stages and not is_complete(path):
        return
    raise ValueError(
        f"{path} is a pipeline checkpoint (one file per stage: {len(stages)} stage file(s)); only the pipeline strategy "
        f"resumes it as it is. Resume with strategy=async_pipe (as many stages as it has), or evaluate/export its weights "
        f"with `python -m lightning_async.pipeline.checkpoint {path} model.pt` and load model.pt into the plain module; to "
        f"continue training it on one device, convert it: `lightning-async export {path} OUT.ckpt --to one-device` "
        "(a checkpoint_format='dcp' one)."
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_async.pipeline.checkpoint CKPT_DIR OUT.pt``: write the consolidated state dict."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m lightning_async.pipeline.checkpoint CKPT_DIR OUT.pt", file=sys.stderr)
        return 2
    torch.save(consolidate(args[0]), args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
