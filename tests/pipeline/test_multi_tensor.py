"""Multi-tensor pipeline stages: tuples and dicts cross stage boundaries, integer leaves travel without
gradients, a stage context reaches the units that ask for it, and activation checkpointing keeps the
update rule. The pipeline oracle (2BW vs the single-device ``DelayedOptimizer`` rule) on three example
models written for the module contract; bad boundary values fail with clear errors, and nobody hangs.
"""

from __future__ import annotations

import contextlib
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _pipeline_harness import SHRUNK_BATCH, Workload, pipeline_run, rank_runtime, reference_run, spawn

from lightning_async.optim import build_optimizer
from lightning_async.optim import ErrorFeedbackCorrection
from lightning_async.pipeline.boundary import flatten, takes_context, unflatten
from lightning_async.pipeline.p2p import BoundaryChanged, PeerFailure
from lightning_async.pipeline.stage import PieceModule

VOCAB, HIDDEN, LAYERS, BATCH, SEQ = 61, 16, 4, 12, 12  # BATCH and BATCH // 2 divisible by 2 and 3 stages


# ---- example 1: blocks take (x, mask); a tuple with an integer mask crosses every boundary ------------
class TokenEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor):
        return self.embed(ids), mask


def masked_prefix_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``h`` over the unmasked positions up to each position (lets tokens interact, causally)."""
    keep = mask.unsqueeze(-1).to(h.dtype)
    return (h * keep).cumsum(1) / keep.cumsum(1).clamp(min=1.0)


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        return x + torch.tanh(self.out(masked_prefix_mean(self.mix(self.norm(x)), mask))), mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(self.norm(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class MaskedLM(nn.Module):
    """Inputs ``(ids, mask)``; every boundary is ``(x, mask)`` with an int64 mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = TokenEmbedding()
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(LAYERS))
        self.head = Head()

    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        return [("embed", self.embed), *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)), ("head", self.head)]

    @staticmethod
    def pipeline_split_batch(batch: dict):
        return (batch["ids"][:, :-1], batch["mask"][:, :-1]), batch["ids"][:, 1:]

    pipeline_loss = staticmethod(next_token_loss)

    def forward(self, inputs):
        x, mask = self.embed(*inputs)
        for block in self.blocks:
            x, mask = block(x, mask)
        return self.head(x, mask)


# ---- example 2: dict boundaries (bool mask, a float leaf without grad) and a stage context ------------
class DictEmbedding(TokenEmbedding):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor):
        return {"x": self.embed(ids), "mask": mask, "bias": 0.1 * mask.float()}  # bias: float, needs no grad


class DictBlock(MaskedBlock):
    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor, context: torch.Tensor):
        h = self.mix(self.norm(x)) + context[:, None] + bias.unsqueeze(-1)
        return {"x": x + torch.tanh(self.out(masked_prefix_mean(h, mask))), "mask": mask, "bias": bias}


class DictLM(MaskedLM):
    """Inputs ``{"ids", "mask"}`` (bool mask); boundaries ``{"x", "mask", "bias"}``; a positional context."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = DictEmbedding()
        self.blocks = nn.ModuleList(DictBlock() for _ in range(LAYERS))

    @staticmethod
    def pipeline_split_batch(batch: dict):
        return {"ids": batch["ids"][:, :-1], "mask": batch["mask"][:, :-1].bool()}, batch["ids"][:, 1:]

    @staticmethod
    def pipeline_context(inputs: dict) -> torch.Tensor:
        return torch.linspace(-0.5, 0.5, inputs["ids"].shape[1])

    def forward(self, inputs):
        context = self.pipeline_context(inputs)
        value = self.embed(**inputs)
        for block in self.blocks:
            value = block(**value, context=context)
        return self.head(**value)


# ---- example 3: a plain sequential model (one tensor everywhere) --------------------------------------
class PlainMLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4))

    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        return list(self.named_children())

    @staticmethod
    def pipeline_split_batch(batch):
        return batch

    pipeline_loss = staticmethod(F.mse_loss)


# ---- data ------------------------------------------------------------------------------------------
def _seeded(cls):
    def make():
        torch.manual_seed(0)
        return cls()

    return make


def _shrink(batches: list) -> list:
    """Batch ``SHRUNK_BATCH`` has half the rows: a new shape mid-run re-announces every boundary."""
    if len(batches) > SHRUNK_BATCH:
        b = batches[SHRUNK_BATCH]
        batches[SHRUNK_BATCH] = {k: v[: BATCH // 2] for k, v in b.items()} if isinstance(b, dict) else tuple(v[: BATCH // 2] for v in b)
    return batches


def token_batch(rows: int, g: torch.Generator) -> dict:
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    mask = (torch.rand(rows, SEQ + 1, generator=g) > 0.3).long()
    return {"ids": ids, "mask": mask}


def token_batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return _shrink([token_batch(BATCH, g) for _ in range(n)])


def token_eval_batch() -> dict:
    return token_batch(7, torch.Generator().manual_seed(9))


def regression_batch(rows: int, g: torch.Generator) -> tuple:
    x = torch.randn(rows, 8, generator=g)
    return x, torch.sin(x[:, :4] * 2)


def regression_batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    return _shrink([regression_batch(BATCH, g) for _ in range(n)])


def regression_eval_batch() -> tuple:
    return regression_batch(7, torch.Generator().manual_seed(9))


MASKED = Workload(_seeded(MaskedLM), token_batches, token_eval_batch, MaskedLM.pipeline_split_batch, next_token_loss)
DICT = Workload(_seeded(DictLM), token_batches, token_eval_batch, DictLM.pipeline_split_batch, next_token_loss)
PLAIN = Workload(_seeded(PlainMLP), regression_batches, regression_eval_batch, PlainMLP.pipeline_split_batch, F.mse_loss)
WORKLOADS = {"masked": MASKED, "dict": DICT, "plain": PLAIN}

STEPS = 10
# By process count: (workload, optimizer, EF strength, clip, activation checkpointing); all 2BW, m = stages.
SCENARIOS = {
    2: [
        ("masked", "adamw", 0.0, 1.0, False),
        ("masked", "muon", 1.0, 1.0, False),
        ("dict", "adamw", 1.0, 1.0, False),
        ("plain", "adamw", 1.0, 1.0, False),
        ("masked", "adamw", 1.0, 1.0, True),  # the same update with activation checkpointing (compared below)
        ("masked", "adamw", 1.0, 1.0, False),
        ("masked", "adamw", 1.0, 1.0, True, "2bw-split"),  # recomputed under a split backward (its deferred dW)
    ],
    3: [
        ("masked", "adamw", 1.0, 1.0, False),
        ("masked", "muon", 0.0, 1.0, False),
        ("dict", "muon", 1.0, 1.0, True),
        ("plain", "adamw", 0.0, 1.0, False),
        ("dict", "muon", 1.0, 1.0, False),
    ],
}
# scenarios that differ only in activation checkpointing: (with, without)
CHECKPOINTING_PAIRS = {2: (4, 5), 3: (2, 4)}


def _all_scenarios(world: int) -> list:
    return [
        pipeline_run(world, schedule, opt, ef, STEPS, clip, m=world, drain_at=(2,), workload=WORKLOADS[name],
                     activation_checkpointing=ckpt)
        for name, opt, ef, clip, ckpt, schedule in map(_with_schedule, SCENARIOS[world])
    ]


def _with_schedule(scenario: tuple) -> tuple:
    """A scenario with its schedule (``2bw`` unless it names one)."""
    return scenario if len(scenario) == 6 else (*scenario, "2bw")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def oracle_results(request):
    world = request.param
    return world, spawn(world, _all_scenarios, world, timeout=180)


def _merged(per_rank: list, index: int) -> dict[str, torch.Tensor]:
    return {name: value for rank_results in per_rank for name, value in rank_results[index][0].items()}


def test_multi_tensor_pipeline_equals_single_device_rule(oracle_results):
    world, per_rank = oracle_results
    for index, (name, opt, ef, clip, ckpt, schedule) in enumerate(map(_with_schedule, SCENARIOS[world])):
        reference = reference_run(opt, 1, ef, STEPS, clip, microbatches=world, workload=WORKLOADS[name])
        weights = _merged(per_rank, index)
        assert set(weights) == set(reference)
        worst = max((weights[n] - reference[n]).abs().max().item() for n in weights)
        assert worst < 1e-5, f"{world} stages, {schedule}, {name}/{opt}/ef={ef}/clip={clip}/checkpointing={ckpt}: max |diff| = {worst}"
        losses = [x for x in per_rank[0][index][1] if x is not None]
        assert len(losses) == STEPS and losses[-1] < losses[0], losses


def test_headers_are_sent_only_when_the_boundary_changes(oracle_results):
    """Per sending stage: the first batch, the evaluation after batch 2 (a reset) and the batch after it, the
    shrunk batch and the one after it (new shapes), and the final evaluation's two micro-batch sizes."""
    world, per_rank = oracle_results
    for index in range(len(SCENARIOS[world])):
        assert [rank_results[index][3] for rank_results in per_rank] == [7] * (world - 1) + [0]


def test_negative_control_delay_matters(oracle_results):
    world, per_rank = oracle_results
    name, opt, ef, clip, _ = SCENARIOS[world][0][:5]
    plain = reference_run(opt, 0, 0.0, STEPS, clip, microbatches=world, workload=WORKLOADS[name])
    weights = _merged(per_rank, 0)
    assert max((weights[n] - plain[n]).abs().max().item() for n in weights) > 1e-4


def test_activation_checkpointing_keeps_weights_bit_identical(oracle_results):
    world, per_rank = oracle_results
    with_ckpt, without = (_merged(per_rank, i) for i in CHECKPOINTING_PAIRS[world])
    assert set(with_ckpt) == set(without)
    for name in with_ckpt:
        assert torch.equal(with_ckpt[name], without[name]), name


def _one_stage_2bw_weights(activation_checkpointing: bool) -> list[torch.Tensor]:
    model = _seeded(MaskedLM)()
    runtime = rank_runtime(
        model.pipeline_units(), "2bw", 2, MaskedLM.pipeline_split_batch, next_token_loss,
        make_optimizer=lambda named: build_optimizer("adamw", named, lr=3e-3), gradient_clip_val=1.0,
        correction=ErrorFeedbackCorrection(1.0), activation_checkpointing=activation_checkpointing,
    )
    for batch in token_batches(STEPS):
        runtime.train_batch(batch)
    runtime.drain()
    return [p.detach().clone() for p in runtime.params]


@pytest.mark.slow
def test_activation_checkpointing_recomputes_with_the_weight_slot_of_its_batch():
    """Under 2BW two weight versions alternate; a recompute that read the module's own (newest) parameters
    instead of its batch's slot would give other gradients (0.01 apart after 10 steps when tried)."""
    for with_ckpt, without in zip(_one_stage_2bw_weights(True), _one_stage_2bw_weights(False)):
        assert torch.equal(with_ckpt, without)


# ---- the contract's calling convention, without processes -------------------------------------------
def test_stage_module_spreads_values_and_passes_context_only_where_asked():
    model = _seeded(DictLM)()
    stage = PieceModule(model.pipeline_units())
    assert stage.takes_context == [False, True, True, True, True, False]
    inputs, _ = model.pipeline_split_batch(token_eval_batch())
    context = model.pipeline_context(inputs)
    torch.testing.assert_close(stage(inputs, context), model(inputs), rtol=0, atol=0)
    compiled = torch.compile(DictBlock())
    assert takes_context(compiled) and not takes_context(torch.compile(nn.Linear(2, 2)))


class _Returns(nn.Module):
    def __init__(self, value) -> None:
        super().__init__()
        self.value = value
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.value(self.lin(x))


@pytest.mark.parametrize(
    "returns, offending",
    [(lambda y: "logits", "str"), (lambda y: None, "NoneType"), (lambda y: (y, 3), "int at output[1]"), (lambda y: {"x": [y, None]}, "NoneType at output['x'][1]")],
)
def test_unit_returning_a_non_tensor_is_refused(returns, offending):
    stage = PieceModule([("ok", nn.Linear(2, 2)), ("bad", _Returns(returns))])
    with pytest.raises(TypeError, match=re.escape(f"Pipeline unit 'bad' returned {offending};") + ".*pipeline_context"):
        stage(torch.ones(3, 2))
    runtime = rank_runtime([("ok", stage.units[0]), ("bad", stage.units[1])], "1f1b", 1, lambda b: (b, b), F.mse_loss)
    with pytest.raises(TypeError, match="Pipeline unit 'bad'"):
        runtime.train_batch(torch.ones(3, 2))


def test_boundary_values_round_trip_and_refuse_other_types():
    x, m = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    value = {"a": (x, [m, x]), "b": m}
    leaves, structure = flatten(value)
    assert [t is u for t, u in zip(leaves, [x, m, x, m])] == [True] * 4
    rebuilt = unflatten(leaves, structure)
    assert isinstance(rebuilt["a"], tuple) and isinstance(rebuilt["a"][1], list) and rebuilt["b"] is m
    with pytest.raises(TypeError, match=r"returned dict at output\['a'\]"):
        flatten({"a": {1: x}}, "Pipeline unit 'u'")


# ---- a boundary that changes shape within a batch: the offender names itself, neighbours see PeerFailure --
class _ShrinksOnSecondCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y if self.calls == 1 else y[:, :2]


def _shape_change_run():
    rank = dist.get_rank()
    torch.manual_seed(0)
    units = [("grow", _ShrinksOnSecondCall()), ("mid", nn.Linear(4, 4)), ("head", nn.Linear(4, 4))]
    names = [["grow"], ["mid"], ["head"]]
    runtime = rank_runtime(units, "2bw", 3, lambda b: b, F.mse_loss, rank=rank, world_size=3, stage_units=names,
                           autocast=contextlib.nullcontext)
    start = time.monotonic()
    try:
        runtime.train_batch((torch.ones(6, 4), torch.ones(6, 4)))
    except (BoundaryChanged, PeerFailure) as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.slow
def test_boundary_shape_change_within_a_batch_fails_clearly_and_nobody_hangs():
    results = spawn(3, _shape_change_run, timeout=60)
    offender, middle, last = results
    assert offender[0] == "BoundaryChanged", offender
    assert "pipeline stage 0 (last unit 'grow') changed within a batch" in offender[1]
    assert "float32[2, 4] (grad)" in offender[1] and "float32[2, 2] (grad)" in offender[1]
    assert middle[0] == "PeerFailure" and "stage 0 (global rank 0) stopped answering" in middle[1], middle
    assert last[0] == "PeerFailure" and "stopped answering" in last[1], last
    assert all(r[2] < 30 for r in results)


def test_partition_by_time_accepts_pytrees_and_context():
    from lightning_async.pipeline.partition import measure_unit_times, partition_units

    model = _seeded(DictLM)()
    inputs, _ = model.pipeline_split_batch(token_eval_batch())
    times = measure_unit_times([u for _, u in model.pipeline_units()], inputs, repeats=1, context_fn=model.pipeline_context)
    assert len(times) == LAYERS + 2 and all(t > 0 for t in times)
    split = partition_units(model.pipeline_units(), 2, "time", example_input=inputs, context_fn=model.pipeline_context)
    assert [n for s in split for n in s] == [n for n, _ in model.pipeline_units()]


def test_strategy_takes_the_activation_checkpointing_switch():
    from lightning_async.strategies import AsyncPipelineStrategy

    assert AsyncPipelineStrategy().activation_checkpointing is False
    assert AsyncPipelineStrategy(activation_checkpointing=True).activation_checkpointing is True
