"""The GPU's step on the CPU: bf16 autocast, fused AdamW under 2BW's version swaps and ``torch.compile``d units,
each through the pipeline against its single-device reference (``DelayedOptimizer``, the same micro-batches).

All pipeline runs share one spawn of two processes; the references run in the test process.

- bf16: the pipeline's forwards and losses under ``torch.autocast("cpu", torch.bfloat16)`` (the runtime's ``autocast``
  option, what Lightning's ``bf16-mixed`` gives it) against ``reference_run`` under the same autocast: the same
  micro-batches through the same bf16 kernels. Tolerance 1e-4 (the fp32 oracle's is 2e-5): the two sides differ only
  where the fp32 oracle's do (fp32 sums in another order, e.g. the tied embedding's and head's gradients meeting
  across ranks: at most 5e-7 there), but under bf16 such a difference can flip the rounding of a bf16 value by one
  unit (2^-8 relative), and Adam turns a flipped gradient element into a weight difference of up to about
  lr x 2^-8 = 1.2e-5 per step; 8 steps bound it by about 1e-4. Measured 2026-12-05: 2.4e-5 (2BW + EF), 3.5e-5
  (1F1B). Negative control: the same pipeline is 7e-3 from the fp32 reference (70 x the tolerance), so a pipeline
  that dropped autocast, or ran it on one side only, fails.
- fused AdamW (``fused=True`` runs on the CPU in torch 2.13): 2BW writes each update into the stale version's storage
  and swaps versions under the modules; the fused kernel must step what the reference steps. The worker counts
  ``torch._fused_adamw_`` calls, so a silent fall-back to the foreach path fails the test.
- compiled units: every unit ``nn.Module.compile()``d (in place, names unchanged) and trained through 1F1B and 2BW
  (whose weight swaps change the parameters under the compiled code) against the eager reference. On this 2-core
  CPU inductor costs about 80 s of compilation per process (measured 2026-12-05, cold: the units of one model
  trained on one device, 80.6 s against 2.0 s eager), so CI compiles with ``backend="aot_eager"`` (Dynamo's capture
  and AOTAutograd's joint graph, the parts that see the swaps: 11 s there), and ``LIGHTNING_ASYNC_INDUCTOR=1`` runs
  the same checks under inductor (they passed: this file's spawn took 59 s against 24 s, inductor's on-disk cache
  warm).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

import pytest
import torch

import _pipeline_harness as harness

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:  # (also in the spawned workers, which import this module)
    sys.path.insert(0, BENCHMARKS)
from one_gpu_paths import counting_fused_adamw  # noqa: E402  (the GPU session's counter of fused AdamW steps)
from _pipeline_harness import pipeline_run, reference_run, spawn

pytestmark = pytest.mark.slow  # the tests here start processes

STEPS = 8
TOLERANCE = 2e-5  # the fp32 oracle's (test_pipeline_oracle.py)
BF16_TOLERANCE = 1e-4  # see the module's docstring
BACKEND = "inductor" if os.environ.get("LIGHTNING_ASYNC_INDUCTOR") == "1" else "aot_eager"


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def compiled_model(seed: int = 0):
    model = harness.make_model(seed)
    for _, unit in model.pipeline_units():
        unit.compile(backend=BACKEND)
    return model


COMPILED = dataclasses.replace(harness.SMOLLM2, make_model=compiled_model)
# name -> (schedule, EF strength, pipeline_run's and reference_run's extra keyword arguments)
RUNS = {
    "bf16 2bw": ("2bw", 1.0, {"autocast": bf16}),
    "bf16 1f1b": ("1f1b", 0.0, {"autocast": bf16}),
    "fused 2bw": ("2bw", 1.0, {"optimizer_kwargs": {"fused": True}}),
    "compiled 1f1b": ("1f1b", 0.0, {"workload": COMPILED}),
    "compiled 2bw": ("2bw", 1.0, {"workload": COMPILED}),
}


def _all_runs() -> dict:
    from torch._dynamo.utils import counters

    out = {}
    for name, (schedule, ef, options) in RUNS.items():
        torch._dynamo.reset()  # (each compiled run compiles afresh: its frames are counted, not reused)
        counters.clear()
        with counting_fused_adamw() as calls:
            weights = pipeline_run(2, schedule, "adamw", ef, STEPS, 1.0, m=2, **options)[0]
        out[name] = {"weights": weights, "fused_steps": calls["n"], "frames": dict(counters["frames"])}
    return out


@pytest.fixture(scope="module")
def runs():
    per_rank = spawn(2, _all_runs, timeout=600)
    return {name: {"weights": {n: w for rank in per_rank for n, w in rank[name]["weights"].items()},
                   "fused_steps": [rank[name]["fused_steps"] for rank in per_rank],
                   "frames": [rank[name]["frames"] for rank in per_rank]} for name in RUNS}


@functools.cache
def _eager_reference(schedule: str, ef: float, setting: str = "") -> dict:
    """The single-device run (``setting``: "bf16", "fused" or plain fp32 eager), computed once."""
    options = {"bf16": {"autocast": bf16}, "fused": {"optimizer_kwargs": {"fused": True}}}.get(setting, {})
    return reference_run("adamw", 1 if schedule == "2bw" else 0, ef, STEPS, 1.0, microbatches=2, **options)


def _reference(name: str) -> dict:
    """The reference of run ``name`` (a compiled run's is eager)."""
    schedule, ef, _ = RUNS[name]
    return _eager_reference(schedule, ef, name.split()[0] if name.split()[0] in ("bf16", "fused") else "")


def _worst(weights: dict, reference: dict) -> float:
    assert set(weights) <= set(reference) and len(weights) >= len(reference) - 1  # (a tied head may appear once)
    return max((weights[n] - reference[n]).abs().max().item() for n in weights)


@pytest.mark.parametrize("name", ["bf16 2bw", "bf16 1f1b"])
def test_bf16_pipeline_equals_the_delay_rule_under_the_same_autocast(runs, name):
    assert _worst(runs[name]["weights"], _reference(name)) < BF16_TOLERANCE
    fp32 = _eager_reference(*RUNS[name][:2])
    assert _worst(runs[name]["weights"], fp32) > 20 * BF16_TOLERANCE  # negative control: autocast changed the run


def test_fused_adamw_under_2bw_version_swaps_equals_its_reference(runs):
    run = runs["fused 2bw"]
    assert all(n > 0 for n in run["fused_steps"]), f"the fused kernel stepped per rank: {run['fused_steps']}"
    assert runs["bf16 2bw"]["fused_steps"] == [0, 0]  # (the default on CPU: foreach)
    assert _worst(run["weights"], _reference("fused 2bw")) < TOLERANCE


@pytest.mark.parametrize("name", ["compiled 1f1b", "compiled 2bw"])
def test_compiled_units_train_to_the_eager_reference(runs, name):
    run = runs[name]
    assert all(frames.get("ok", 0) >= 3 for frames in run["frames"]), f"frames compiled per rank: {run['frames']}"
    assert _worst(run["weights"], _reference(name)) < TOLERANCE
