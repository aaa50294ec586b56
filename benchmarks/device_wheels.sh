#!/usr/bin/env bash
# Wheels of the pure-Python dependencies that a GPU box with only torch, lightning and tensorboard lacks
# (it has no network), into .device-wheels/ (git-ignored, under 2 MiB): pass it with run(carry=[".device-wheels"]).
# benchmarks/gpu_session.sh installs them with --no-index --no-deps into .device-site/ (on PYTHONPATH), leaving the
# box's own Python untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-wheels
python -m pip download -q --no-deps -d .device-wheels "jsonargparse[signatures]>=4.30,<5" docstring-parser \
    typeshed-client importlib_resources "omegaconf>=2.3" pytorch-optimizer==4.1.0
python -m pip wheel -q --no-deps -w .device-wheels "antlr4-python3-runtime==4.9.3"  # sdist only upstream
ls -la .device-wheels
