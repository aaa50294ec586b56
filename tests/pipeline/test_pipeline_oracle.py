"""The correctness oracle: the multi-process pipeline follows the single-device update rule.

Every scenario of one stage count runs inside one spawn (process start-up dominates on CPU).
2BW must equal ``DelayedOptimizer(pairing="2bw")``; the flushing schedules must equal plain training.

NCCL's rules on gloo: every schedule NCCL can run is run again under ``transport="nccl-rules"`` (tag 0, so two ranks'
messages match in posting order; ``batch_isend_irecv`` groups; no pre-posted receives) in the same spawns, as a twin
of a scenario under gloo's rules; the twin must train to the same bits. ZB-V at 4 micro-batches, whose two ends of a
pair compute that pair's messages in different orders, runs under the mode with its sends ordered for NCCL
(``program.order_sends``) and trains to the bits of its gloo run; with that pass taken out (and the order check with
it) it trains wrong (the negative control: the mode really matches in posting order).
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from unittest import mock

import pytest
import torch

from _pipeline_harness import pipeline_run, reference_run, spawn
from lightning_async.pipeline.schedules import spec

pytestmark = pytest.mark.slow  # the tests here start processes or run the CLI (README.md, Tests)

STEPS = 10


@dataclass(frozen=True)
class Scenario:
    """One pipeline run of the oracle and the single-device run it must equal.

    ``stages`` may be fewer than the processes: ``world // stages`` data-parallel replicas (4 processes and 2
    stages: 2 stages x 2 replicas). At most one correction: Error Feedback (``ef_strength``, 0: none) or another
    update- or gradient-level correction the pipeline supports (``correction``: ``build_correction`` settings).
    """

    stages: int
    schedule: str
    optimizer: str
    _: KW_ONLY
    ef_strength: float = 0.0
    correction: dict | None = None
    clip: float | None = None  # gradient-norm clipping threshold (None: no clipping)
    drain_after: tuple[int, ...] = ()  # batches after which the pipeline is evaluated (which drains it)
    prepost: bool = True  # pre-posted receives (gloo's default); False: the fused send/receive groups NCCL uses
    workload: str = "smollm2"  # "smollm2", "deep" or a Hugging Face model of test_hf.py (see workload_named)
    transport: str = "auto"  # "nccl-rules": NCCL's matching rules on gloo (no pre-posting: prepost=False)

    def __post_init__(self):
        if self.ef_strength and self.correction:
            raise ValueError(f"a scenario runs one correction, not EF {self.ef_strength} and {self.correction}")
        if self.transport == "nccl-rules" and self.prepost:
            raise ValueError("transport='nccl-rules' never pre-posts receives: give prepost=False")

    def under_nccl_rules(self) -> "Scenario":
        """This scenario again under NCCL's rules on gloo (its twin: the same run, every message tag 0)."""
        return dataclasses.replace(self, transport="nccl-rules", prepost=False)

    @property
    def correction_setting(self) -> float | dict:
        """What the harness takes (``_pipeline_harness.correction_of``): the correction's settings, else EF's strength."""
        return self.correction or self.ef_strength

    def __str__(self) -> str:
        correction = self.correction["method"] if self.correction else f"ef={self.ef_strength}"
        return f"{self.schedule}/{self.optimizer}/{correction}/clip={self.clip}/{self.workload}/{self.transport}"


# Keyed by the number of processes. Workloads: the harness's tied SmolLM2 (default; 4 blocks), ``deep`` (6 blocks:
# two chunks per rank on 4 ranks), and the Hugging Face ``llama`` and tied ``qwen2-tied`` of tests/models/test_hf.py.
ADAPTIVE_EF = {"method": "adaptive-ef", "strength": 1.0, "decay": 0.8}
NESTEROV = {"method": "nesterov", "strength": 1.0, "momentum": 0.8}
DC_ASGD = {"method": "dc-asgd", "strength": 2.0, "adaptive": True}
SCENARIOS = {
    2: [
        Scenario(2, "2bw", "adamw", drain_after=(0,)),
        Scenario(2, "2bw", "muon", ef_strength=1.0, clip=1.0, drain_after=(4,)),
        Scenario(2, "2bw", "lion", clip=0.5, prepost=False),
        Scenario(2, "2bw", "adan", ef_strength=0.5),
        Scenario(2, "2bw", "normuon", ef_strength=1.0),
        Scenario(2, "1f1b", "adamw", clip=1.0, drain_after=(2,)),
        Scenario(2, "gpipe", "muon", prepost=False),
        Scenario(2, "2bw", "adamw", correction=ADAPTIVE_EF, clip=1.0, drain_after=(3,)),
        Scenario(2, "2bw", "muon", correction=NESTEROV),
        Scenario(2, "2bw", "adan", correction=DC_ASGD, clip=0.5, prepost=False),
        Scenario(2, "zbh1", "adamw", clip=1.0, drain_after=(2,)),
        Scenario(2, "interleaved", "muon", drain_after=(3,), prepost=False),
        Scenario(2, "zbv", "adamw", clip=1.0, drain_after=(3,)),  # the tied embedding and head on one rank
        Scenario(2, "zbv", "lion", prepost=False),
        Scenario(2, "zbv", "adamw", clip=1.0, workload="llama"),
        Scenario(2, "interleaved", "muon", clip=1.0, drain_after=(2,), workload="qwen2-tied"),
        Scenario(2, "zbh1", "adamw", clip=1.0, prepost=False, workload="qwen2-tied"),
        Scenario(2, "2bw-split", "adamw", ef_strength=1.0, clip=1.0, drain_after=(2,)),
    ],
    3: [
        Scenario(3, "2bw", "adamw", correction=ADAPTIVE_EF),
        Scenario(3, "2bw", "lion", correction=NESTEROV, clip=1.0, drain_after=(2,)),
        Scenario(3, "2bw", "mars", correction=DC_ASGD),
        Scenario(3, "2bw", "muon", ef_strength=1.0, clip=0.5, prepost=False),
        Scenario(3, "zbh1", "muon", clip=0.5, drain_after=(2,)),
        Scenario(3, "zbv", "adamw", clip=1.0),
        Scenario(3, "2bw-split", "muon", correction=ADAPTIVE_EF, prepost=False),
    ],
    4: [
        Scenario(4, "2bw", "adamw", ef_strength=1.0, clip=0.5, drain_after=(3,)),
        Scenario(4, "2bw", "muon", prepost=False),
        Scenario(4, "2bw", "mars", ef_strength=1.0),
        Scenario(4, "1f1b", "adamw"),
        Scenario(2, "2bw", "adamw", ef_strength=1.0, clip=1.0),  # pipeline x data parallel
        Scenario(4, "zbh1", "adamw", clip=1.0, drain_after=(2,)),
        Scenario(4, "interleaved", "adamw", workload="deep"),
        Scenario(4, "zbv", "muon", clip=1.0, drain_after=(3,), workload="deep"),
        Scenario(2, "zbv", "adamw", clip=1.0),  # pipeline x data parallel, two chunks per rank
    ],
}
# Under NCCL's rules (their twins appended to the same spawns): every schedule, with corrections, clipping, drains,
# the Hugging Face workloads, 3 stages, 4 stages and 2 stages x 2 replicas (the indices of their twins above). ZB-V
# everywhere: on 3 stages (4 micro-batches) its sends are held back for the receiver's order (``program.order_sends``;
# 2 micro-batches on 2 stages and 4 on 4 need none), and the control below runs 2 stages at 4.
NCCL_RULES_TWINS = {2: [0, 1, 5, 6, 7, 10, 11, 12, 15, 16, 17], 3: [3, 4, 5, 6], 4: [0, 3, 4, 5, 6, 7, 8]}
TWINS = {world: {len(SCENARIOS[world]) + k: i for k, i in enumerate(indices)} for world, indices in NCCL_RULES_TWINS.items()}
for _world, _indices in NCCL_RULES_TWINS.items():
    SCENARIOS[_world] += [SCENARIOS[_world][i].under_nccl_rules() for i in _indices]


def workload_named(name: str):
    import _pipeline_harness as harness

    if name in ("smollm2", "deep"):
        return harness.SMOLLM2 if name == "smollm2" else harness.DEEP
    from test_hf import oracle_workload

    return oracle_workload(name)


def microbatches(stages: int) -> int:
    """As many micro-batches as stages where the batch of 8 (and the shrunk one of 4) divides, else 4."""
    return stages if 4 % stages == 0 else 4


def _all_scenarios(world: int) -> list:
    runs = [
        pipeline_run(sc.stages, sc.schedule, sc.optimizer, sc.correction_setting, STEPS, sc.clip,
                     m=microbatches(sc.stages), drain_at=sc.drain_after, prepost=sc.prepost,
                     workload=workload_named(sc.workload), transport=sc.transport)
        for sc in SCENARIOS[world]
    ]
    return runs + [_zbv_in_posting_order()] if world == 2 else runs


ZBV_MISMATCHED = 4  # micro-batches at which ZB-V's two ends of a pair compute its messages in different orders


def _zbv_in_posting_order() -> dict:
    """The control (after the scenarios, one entry more): ZB-V on 2 stages at 4 micro-batches under gloo's rules,
    under NCCL's (its sends held back for the receiver's order), and under NCCL's with that pass and the order check
    taken out (the sends in compute order)."""
    import lightning_async.pipeline.program as program
    import lightning_async.pipeline.rank as rank

    def run(transport: str):
        return pipeline_run(2, "zbv", "adamw", 0.0, STEPS, 1.0, m=ZBV_MISMATCHED, prepost=False, transport=transport)[0]

    with mock.patch.object(program, "order_sends", lambda spec, p, programs: list(programs)), \
            mock.patch.object(rank, "check_message_order", lambda *args, **kwargs: None):
        unordered = run("nccl-rules")
    return {"tagged": run("auto"), "ordered": run("nccl-rules"), "unordered": unordered}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["2-processes", "3-processes", "4-processes"])
def pipeline_results(request):
    world = request.param
    return world, spawn(world, _all_scenarios, world)


_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def _reference(sc: Scenario, world: int) -> dict[str, torch.Tensor]:
    """The single-device run ``sc`` must equal, computed once per setting (a twin under NCCL's rules shares it)."""
    delay = 1 if spec(sc.schedule).delayed else 0
    m = microbatches(sc.stages) * (world // sc.stages)
    key = (sc.optimizer, delay, repr(sc.correction_setting), sc.clip, m, sc.workload)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(sc.optimizer, delay, sc.correction_setting, STEPS, sc.clip, microbatches=m,
                                         workload=workload_named(sc.workload))
    return _REFERENCES[key]


def _merge(per_rank: list, index: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank_results in per_rank:
        merged.update(rank_results[index][0])
    return merged


def test_pipeline_equals_single_device_rule(pipeline_results):
    world, per_rank = pipeline_results
    for index, sc in enumerate(SCENARIOS[world]):
        replicas = world // sc.stages
        reference = _reference(sc, world)
        for replica in range(replicas):  # every replica holds the same weights
            weights = _merge(per_rank[replica * sc.stages : (replica + 1) * sc.stages], index)
            assert set(weights) <= set(reference) and len(weights) >= len(reference) - 1  # tied head may appear once
            worst = max((weights[n] - reference[n]).abs().max().item() for n in weights)
            assert worst < 2e-5, f"{sc.stages} stages x {replicas}, {sc}: max |diff| = {worst}"


def test_negative_control_2bw_differs_from_sync(pipeline_results):
    world, per_rank = pipeline_results
    two_bw = _merge(per_rank, 0)  # 2bw adamw
    first = SCENARIOS[world][0]
    sync = reference_run(first.optimizer, 0, 0.0, STEPS, first.clip, microbatches=microbatches(first.stages))
    assert max((two_bw[n] - sync[n]).abs().max().item() for n in two_bw) > 1e-4


def test_losses_reach_every_rank_and_match(pipeline_results):
    world, per_rank = pipeline_results
    for index in range(len(SCENARIOS[world])):
        losses = [rank_results[index][1] for rank_results in per_rank]
        assert all(loss == losses[0] for loss in losses), "every rank must log the same loss"
        values = [x for x in losses[0] if x is not None]
        assert len(values) == STEPS
        assert all(2.0 < x < 7.0 for x in values)


def test_receives_are_preposted_only_where_asked(pipeline_results):
    world, per_rank = pipeline_results
    for index, sc in enumerate(SCENARIOS[world]):
        counts = [rank_results[index][2] for rank_results in per_rank]
        if sc.prepost:
            assert all(n > 0 for n in counts), f"scenario {index}: every stage pre-posts receives, got {counts}"
        else:
            assert counts == [0] * world


def test_nccl_rules_take_nccls_path(pipeline_results):
    """Under the mode every group goes through ``batch_isend_irecv`` and nothing is pre-posted; under gloo's rules
    gloo posts each message on its own (no group is batched)."""
    world, per_rank = pipeline_results
    for index, sc in enumerate(SCENARIOS[world]):
        batched = [rank_results[index][5] for rank_results in per_rank]
        if sc.transport == "nccl-rules":
            assert all(n > 0 for n in batched), f"{sc}: groups batched per rank {batched}"
        else:
            assert batched == [0] * world, f"{sc}: groups batched per rank {batched}"


def test_nccl_rules_train_to_the_same_bits_as_gloos(pipeline_results):
    """Every twin under NCCL's rules equals its scenario under gloo's rules exactly: the same messages reached the same
    receives, only matched by posting order instead of by tag."""
    world, per_rank = pipeline_results
    assert TWINS[world], "every spawn runs some scenarios under NCCL's rules"
    for twin, index in TWINS[world].items():
        assert SCENARIOS[world][twin] == SCENARIOS[world][index].under_nccl_rules()
        for rank, rank_results in enumerate(per_rank):
            ours, theirs = rank_results[twin], rank_results[index]
            assert ours[0].keys() == theirs[0].keys()
            different = [n for n in ours[0] if not torch.equal(ours[0][n], theirs[0][n])]
            assert not different, f"{SCENARIOS[world][twin]}, rank {rank}: differs from gloo's rules in {different[:3]}"
            assert ours[1] == theirs[1], f"{SCENARIOS[world][twin]}, rank {rank}: losses differ"


@pytest.mark.parametrize("pipeline_results", [2], indirect=True, ids=["2-processes"])
def test_zbv_under_nccl_rules_trains_exactly_and_would_train_wrong_unordered(pipeline_results):
    _, per_rank = pipeline_results
    controls = [rank_results[len(SCENARIOS[2])] for rank_results in per_rank]
    for control in controls:  # the same bits as under gloo's tags: the same messages reached the same receives
        assert control["ordered"].keys() == control["tagged"].keys()
        assert all(torch.equal(control["ordered"][n], control["tagged"][n]) for n in control["tagged"])
    tagged = {n: w for c in controls for n, w in c["tagged"].items()}
    unordered = {n: w for c in controls for n, w in c["unordered"].items()}
    reference = reference_run("adamw", 0, 0.0, STEPS, 1.0, microbatches=ZBV_MISMATCHED)
    assert max((tagged[n] - reference[n]).abs().max().item() for n in tagged) < 2e-5  # gloo's tags: exact
    worst = max((unordered[n] - reference[n]).abs().max().item() for n in unordered)
    assert worst > 1e-3, f"ZB-V's sends in compute order, matched in posting order, should train wrong: {worst}"
