"""Pipeline checkpoints: a directory with ``meta.json`` and one ``stage-NN.ckpt`` per stage.

:func:`consolidate` merges the stages' weights into the state dict of the plain, unsplit module, for
evaluation or export (``CausalLM(...).load_state_dict(consolidate(path))``).
"""

from __future__ import annotations

import json
import os

import torch


def stage_files(path: str | os.PathLike) -> list[str]:
    path = os.fspath(path)
    meta_file = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_file):
        raise FileNotFoundError(f"{path} is not a pipeline checkpoint: {meta_file} is missing.")
    with open(meta_file) as f:
        stages = json.load(f)["stages"]
    files = [os.path.join(path, f"stage-{s:02d}.ckpt") for s in range(stages)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"Pipeline checkpoint {path} is incomplete; missing {', '.join(missing)}.")
    return files


def consolidate(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model's ``state_dict`` (newest weights) from a pipeline checkpoint directory."""
    merged: dict[str, torch.Tensor] = {}
    for file in stage_files(path):
        merged.update(torch.load(file, map_location="cpu", weights_only=False)["state_dict"])
    return merged


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
