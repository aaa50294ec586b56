"""The pipeline runtime (``lightning_async.pipeline.runtime``) on one process: it trains, refuses a batch it cannot
split into micro-batches, and ``PipelineRuntime.memory_report()`` gives exact byte counts (one stage, the tiny test
model). Its multi-process behaviour, the update rule against the single-device one, is the oracle's
(``test_pipeline_oracle.py``, ``test_multi_tensor.py``).

The memory report's expected sizes are computed from the model shape (not from the runtime's tensors): parameters
from ``SHAPE``, AdamW state as two fp32 moments per parameter plus one fp32 step counter per parameter tensor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import build_optimizer
from lightning_async.optim import ErrorFeedbackCorrection
from lightning_async.pipeline.runtime import PipelineRuntime
from lightning_async.pipeline.memory import schedule_memory

from _pipeline_harness import SHAPE, make_batches, make_model, rank_runtime

FP32 = 4


def expected_parameter_tensors() -> list[int]:
    """Element counts of the tiny model's unique parameter tensors (the LM head is tied to the embedding)."""
    v, h, f, n = SHAPE["vocab_size"], SHAPE["hidden_size"], SHAPE["ffn_size"], SHAPE["num_layers"]
    head_dim = h // SHAPE["num_heads"]
    kv = SHAPE["num_kv_heads"] * head_dim
    block = [h, h * h, h * kv, h * kv, h * h, h, h * f, h * f, f * h]  # norms, q k v o, norm, gate up down
    return [v * h] + block * n + [h]  # embedding, blocks, final norm


def make_runtime(schedule: str, ef: float | None, m: int = 2) -> PipelineRuntime:
    model = make_model()
    return rank_runtime(
        [(f"model.{name}", unit) for name, unit in model.pipeline_units()], schedule, m, split_next_token, next_token_loss,
        make_optimizer=lambda named: build_optimizer("adamw", named, lr=1e-3, weight_decay=0.1),
        correction=None if ef is None else ErrorFeedbackCorrection(ef), autocast=contextlib.nullcontext,
    )


def train(runtime: PipelineRuntime, steps: int = 3) -> dict[str, int]:
    for batch in make_batches(steps):
        runtime.train_batch(batch)
    runtime.drain()
    return runtime.memory_report()


def test_expected_shape_matches_model():
    sizes = expected_parameter_tensors()
    model = make_model()
    assert sorted(p.numel() for p in model.parameters()) == sorted(sizes)


@pytest.mark.parametrize(
    "schedule, ef, versions, ef_buffers",
    [("2bw", None, 2, 0), ("2bw", 0.0, 2, 0), ("2bw", 1.0, 2, 1), ("1f1b", None, 1, 0), ("gpipe", None, 1, 0)],
)
def test_memory_report_exact_bytes(schedule, ef, versions, ef_buffers):
    sizes = expected_parameter_tensors()
    params = sum(sizes) * FP32
    adamw = 2 * params + len(sizes) * FP32  # exp_avg + exp_avg_sq, plus a float32 scalar `step` per tensor
    report = train(make_runtime(schedule, ef))
    assert report == {
        "parameters": params,
        "weight_versions": versions * params,
        "optimizer_state": adamw,
        "correction": ef_buffers * params,
        "in_flight_microbatches": 0,
    }


def test_report_before_training_has_no_optimizer_or_ef_state():
    runtime = make_runtime("2bw", 1.0)
    report = runtime.memory_report()
    params = sum(expected_parameter_tensors()) * FP32
    assert report["weight_versions"] == 2 * params
    assert report["optimizer_state"] == 0 and report["correction"] == 0  # both are allocated lazily


@pytest.mark.slow
def test_report_agrees_with_the_memory_model():
    """The measured weight and EF terms are the ones ``memory.schedule_memory`` adds for 2BW and for EF."""
    sync, twobw, ef = (train(make_runtime(s, e)) for s, e in (("1f1b", None), ("2bw", None), ("2bw", 1.0)))

    def model(schedule: str, buffers: int = 0) -> dict[str, int]:
        (row,) = schedule_memory(schedule, 1, 2, sync["parameters"], sync["optimizer_state"], 0, correction_buffers=buffers)
        return row

    one, two, two_ef = model("1f1b"), model("2bw"), model("2bw", buffers=1)
    assert two["weights"] - one["weights"] == twobw["weight_versions"] - sync["weight_versions"]
    assert two_ef["correction"] == ef["correction"]
    assert two["optimizer"] == twobw["optimizer_state"] == ef["optimizer_state"]


def test_memory_report_counts_microbatches_in_flight():
    runtime = make_runtime("2bw", None, m=2)
    batches = make_batches(2)
    seen = []
    original = runtime.compute.backward

    def spy(chunk, mb, batch, grad, **kwargs):
        seen.append(runtime.memory_report()["in_flight_microbatches"])
        return original(chunk, mb, batch, grad, **kwargs)

    runtime.compute.backward = spy
    for batch in batches:
        runtime.train_batch(batch)
    runtime.drain()
    assert max(seen) >= 1  # one stage: each forward is followed by its backward
    assert runtime.memory_report()["in_flight_microbatches"] == 0


# ---- training and the batches it refuses ------------------------------------------------------------
def test_one_process_runtime_trains():
    runtime = rank_runtime([(f"model.{n}", u) for n, u in make_model().pipeline_units()], "1f1b", 2, split_next_token,
                           next_token_loss)
    batch = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    first = float(runtime.eval_batch(batch))
    for _ in range(5):
        runtime.train_batch(batch)
    assert float(runtime.eval_batch(batch)) < first


def test_inputs_and_targets_must_share_the_batch_dimension():
    runtime = rank_runtime([("lin", nn.Linear(2, 2))], "1f1b", 2, lambda b: b, F.mse_loss)
    with pytest.raises(ValueError, match="same size there"):
        runtime.train_batch(((torch.ones(4, 2), torch.ones(3, 2)), torch.ones(4, 2)))
    with pytest.raises(ValueError, match="not divisible by n_microbatches=2"):
        runtime.train_batch((torch.ones(3, 2), torch.ones(3, 2)))
