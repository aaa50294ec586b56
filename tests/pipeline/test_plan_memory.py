"""Memory of the zero-bubble schedules: what the model (``memory.schedule_memory``) holds between a split backward's
``I`` and ``W``, against the closed form, the plan's map and what the runtime holds.

A micro-batch holds everything autograd saved for it (``A`` per piece) from ``F`` until ``B``, or until ``I`` when
the backward is split; from ``I`` to ``W`` only the deferred weight gradients' inputs stay (each linear layer's input
and output gradient, ``R < A``). So ZB-H1's rank ``r``, which defers up to ``r`` weight gradients, peaks at 1F1B's
``(p - r) A`` plus ``r R``. The old model held ``A`` until ``W`` (``p A`` on every rank, ``m`` on the last rank's
share at ``m = p``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_async.pipeline.schedules import spec
from lightning_async.pipeline.memory import WEIGHT_GRAD_SHARE, holds_two_gradients, inflight_and_versions, schedule_memory

GIB = 2**30
SHAPES = [(2, 2), (2, 4), (3, 3), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24)]


def activations(schedule: str, p: int, m: int, act, residue) -> list[int]:
    return [row["activations"] for row in schedule_memory(schedule, p, m, 0, 0, act, weight_grad_bytes=residue)]


@pytest.mark.parametrize("p, m", SHAPES)
def test_zbh1_peak_is_1f1b_peak_plus_the_deferred_weight_gradients_residue(p, m):
    act = [1000 + 100 * r for r in range(p)]  # per rank (the last one heavier, as with the LM head)
    residue = [int(0.6 * a) for a in act]
    one = activations("1f1b", p, m, act, residue)
    zb = activations("zbh1", p, m, act, residue)
    assert one == [(p - r) * act[r] for r in range(p)]
    # rank r defers r weight gradients: only their residue comes on top of 1F1B (the old model: p * act[r])
    assert zb == [one[r] + r * residue[r] for r in range(p)]


def test_zbh1_with_uniform_stages_peaks_at_1f1bs_peak():
    for p, m in SHAPES:
        for share in (0.0, 0.5, WEIGHT_GRAD_SHARE, 1.0):
            assert max(activations("zbh1", p, m, 1000, 1000 * share)) == max(activations("1f1b", p, m, 1000, 0)) == p * 1000


def test_the_default_residue_is_a_share_of_the_activations():
    rows = schedule_memory("zbh1", 4, 8, 0, 0, 1000)
    assert [r["activations"] for r in rows] == [round((4 - r) * 1000 + r * WEIGHT_GRAD_SHARE * 1000) for r in range(4)]


@pytest.mark.parametrize("p, m", SHAPES)
def test_zbh1_holds_1f1bs_microbatches_in_full(p, m):
    lists = {s: [spec(s).run_actions(r, p, m, 2) for r in range(p)] for s in ("1f1b", "zbh1")}
    (full_1f1b, v1), (full_zb, v2) = (inflight_and_versions(s, lists[s]) for s in ("1f1b", "zbh1"))
    assert full_zb == full_1f1b == [p - r for r in range(p)]
    assert v1 == v2 == [1] * p


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zbv_peaks_at_p_microbatches_of_its_share_whatever_the_residue(p, m):
    """ZB-V holds ``2p`` chunk micro-batches (``p`` of the rank's share) on every rank once ``m >= 2p``, 1F1B's
    rank-0 peak; its peak comes before the W it defers matter, so the residue does not move it (fewer micro-batches
    than ``2p``: below ``p``)."""
    for share in (0.0, 0.7, 1.0):
        zbv = activations("zbv", p, m, 1000, 1000 * share)
        assert max(zbv) == p * 1000
        if m >= 2 * p:
            assert zbv == [p * 1000] * p


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_interleaved_has_no_split_backward_so_no_residue(p, m):
    """Interleaved 1F1B holds whole activations until its B (at ``m = p`` all forwards come first: ``m`` of the share
    per rank); the weight-gradient bytes do not enter."""
    base = activations("interleaved", p, m, 1000, 0)
    assert activations("interleaved", p, m, 1000, 1000) == base
    full, _ = inflight_and_versions("interleaved", [spec("interleaved").run_actions(r, p, m, 2) for r in range(p)])
    assert base == [round(f * 1000) for f in full]
    if m == p:
        assert base == [m * 1000] * p


def test_plan_map_of_smollm2_360m_on_4_stages():
    """The numbers of docs/schedules.md: `plan --compare --model smollm2-360m --tflops 400 --stages 4 --seq-len 2048
    --micro-batch-size 4` (m = 4). ZB-H1's last stage holds one micro-batch in full and the residue of three (20.31
    GiB when all four were held in full)."""
    from lightning_async.tools.plan_table import compare_row
    from lightning_async.tools.stage_costs import nominal_model, stage_costs_from_measurement

    costs = stage_costs_from_measurement(nominal_model("smollm2-360m", 2048, 4, "bfloat16", 400.0), 4, 2.0)
    row = compare_row(4, 4, costs, 0.0, 0.0, 5, 0.5, None, 1.05)["schedules"]
    assert round(row["1f1b"]["peak_bytes"] / GIB, 2) == 11.25
    assert round(row["zbh1"]["peak_bytes"] / GIB, 2) == 13.58
    assert round(row["zbv"]["peak_bytes"] / GIB, 2) == round(row["interleaved"]["peak_bytes"] / GIB, 2) == 20.31
    one = schedule_memory("1f1b", 4, 4, costs["param_bytes"], costs["optimizer_bytes"], costs["activation_bytes"])
    zb = schedule_memory("zbh1", 4, 4, costs["param_bytes"], costs["optimizer_bytes"], costs["activation_bytes"],
                         weight_grad_bytes=costs["weight_grad_bytes"])
    assert zb[3]["total"] == one[3]["total"] + 3 * costs["weight_grad_bytes"][3]
    assert zb[3]["total"] == row["zbh1"]["peak_bytes"]


def test_nominal_weight_grad_bytes_match_the_measured_ones():
    """The nominal residue of a block and the head (linear inputs and output gradients) is what the split backward
    holds in the runtime's linear layers, measured; about 70% of a block's activations (75% on the tiny model)."""
    from lightning_async.pipeline.measure import measure_model
    from lightning_async.tools.stage_costs import nominal_model

    nominal = nominal_model("tiny", 64, micro_batch_size=2, dtype="float32", tflops=1.0)["units"]
    measured = measure_model("tiny", 64, 2, "cpu", "float32", reps=1, head_tokens=64)["units"]
    for unit in ("block", "head"):
        assert measured[unit]["weight_grad_bytes"] == pytest.approx(nominal[unit]["weight_grad_bytes"], rel=0.05)
    assert measured["embed"]["weight_grad_bytes"] == nominal["embed"]["weight_grad_bytes"] == 0
    share = measured["block"]["weight_grad_bytes"] / measured["block"]["activation_bytes"]
    assert WEIGHT_GRAD_SHARE - 0.1 < share < WEIGHT_GRAD_SHARE + 0.1


# ------------------------------------------------------------------------------------------ measured (2 processes)
BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
MEASURED = dict(model="tiny", p=2, m=4, micro_batch=2, seq_len=64, steps=2, device="cpu", sharding="none")


def _measure(cfg: dict) -> dict:
    """``benchmarks/memory.py``'s worker on this rank: the activations one micro-batch saves (``saved_tensors_hooks``
    on a probe forward), the bytes its split backward's deferred weight gradients hold (probed, and at every action
    read off the runtime's ``DeferredWeightGrads``), and the peak over every action of the activations held."""
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import memory

    return memory.measured_worker(cfg)


@pytest.fixture(scope="module")
def measured_ranks():
    from _pipeline_harness import spawn

    runs = {config: spawn(2, _measure, dict(MEASURED, config=config), timeout=120.0) for config in ("1f1b", "zbh1")}
    clipped = dict(MEASURED, config="2bw", clip=1.0)  # (tied weights too)
    # the first stage begins each update 0.2 s late: the last stage's next backward comes first (its worst case), and
    # the first stage's own poll comes before it sees its reductions finish (two buffers there until 2026-12-06)
    runs["2bw-clipped"] = spawn(2, _measure, dict(clipped, late_first_update_s=0.2), timeout=120.0)
    # the last stage starts each call 0.3 s late: the first stage reaches its next backward before the reductions end
    runs["2bw-clipped-late"] = spawn(2, _measure, dict(clipped, late_last_stage_s=0.3), timeout=120.0)
    return runs


@pytest.mark.slow
def test_measured_zbh1_peak_agrees_with_the_model(measured_ranks):
    """`python benchmarks/memory.py --configs 1f1b zbh1` in small: the runtime's peak activations are the model's on
    every rank, and the last rank's ZB-H1 / 1F1B ratio is 1 + R / A (the old model: 2, both micro-batches whole)."""
    p, m = MEASURED["p"], MEASURED["m"]
    peaks = {}
    for config, ranks in measured_ranks.items():
        if config not in ("1f1b", "zbh1"):
            continue
        act = [r["activation_bytes_per_microbatch"] for r in ranks]
        residue = [r["weight_grad_bytes_per_microbatch"] for r in ranks]
        assert [r["peak_activation_bytes"] for r in ranks] == activations(config, p, m, act, residue)
        peaks[config] = [r["peak_activation_bytes"] for r in ranks]
    last = measured_ranks["zbh1"][-1]
    a, r = last["activation_bytes_per_microbatch"], last["weight_grad_bytes_per_microbatch"]
    assert 0 < r < a
    assert peaks["zbh1"][0] == peaks["1f1b"][0]  # rank 0 runs each W right after its I
    assert peaks["zbh1"][-1] / peaks["1f1b"][-1] == pytest.approx(1 + r / a)
    assert peaks["zbh1"][-1] < 2 * peaks["1f1b"][-1]


@pytest.mark.parametrize("schedule, p, tied, clipping, expected", [
    ("2bw", 2, True, False, [False, True]),  # the last stage waits for the first to sum the tied weight's gradient
    ("2bw", 3, True, False, [False, False, True]),  # the middle stage takes no part in the tie
    ("2bw", 3, False, True, [False, True, True]),  # the global norm waits for the first stage on every other
    ("2bw-split", 4, False, True, [False, True, True, True]),
    ("2bw", 3, False, False, [False, False, False]),  # nothing to wait for: applied right after the last backward
    ("paci", 3, True, True, [False, False, False]),  # applied at the start of its next call, before any backward
    ("1f1b", 3, True, True, [False, False, False]),  # a flush: the next batch starts after the update
    ("zbv", 2, True, True, [False, False]),
])
def test_two_gradient_buffers_where_a_stage_waits_on_a_reduction_across_stages(schedule, p, tied, clipping, expected):
    assert [holds_two_gradients(schedule, p, r, tied, clipping) for r in range(p)] == expected
    rows = schedule_memory(schedule, p, 2 * p, 1000, 0, 0, tied_weights=tied, clipping=clipping)
    assert [row["gradients"] for row in rows] == [2000 if two else 1000 for two in expected]


@pytest.mark.slow
def test_measured_gradient_peak_of_clipped_tied_2bw_agrees_with_the_model(measured_ranks):
    """`python benchmarks/memory.py --configs 2bw --clip 1.0` in small: the last stage holds the pending update's
    gradients and the next batch's, two buffers; the first stage one, also when the last stage is late (CI once
    measured two there: the first stage's update waited for the reductions' completion to be seen by a poll, and
    under load its next backward came first)."""
    ranks = measured_ranks["2bw-clipped"]
    params = [r["parameters"] for r in ranks]
    model = schedule_memory("2bw", MEASURED["p"], MEASURED["m"], params, 0, 0, tied_weights=True, clipping=True)
    assert [r["peak_gradient_bytes"] for r in ranks] == [row["gradients"] for row in model] == [params[0], 2 * params[1]]
    late = [r["peak_gradient_bytes"] for r in measured_ranks["2bw-clipped-late"]]
    assert late[0] == params[0] and late[1] <= 2 * params[1]  # (the model is the last stage's worst case)


def test_the_map_places_zbvs_embedding_and_head_on_rank_0():
    """ZB-V's V puts the first and the last piece on rank 0: the embedding and the LM head. The map spread the
    head's cost over rank p - 1's two pieces (the per-stage costs of a one-chunk schedule) and put ZB-V at 20.31
    GiB on this model; over its pieces it is 10.72 GiB. Schedules with one chunk per stage read the per-stage costs
    as before."""
    from lightning_async.tools.plan_table import compare_row, schedule_costs
    from lightning_async.tools.stage_costs import map_costs, nominal_model

    meas = nominal_model("smollm2-360m", 2048, 4, "bfloat16", 400.0)
    costs = map_costs(meas, 4, 2.0)
    units = meas["units"]
    v = schedule_costs(spec("zbv"), 4, costs)
    pieces = costs["pieces"][2]
    tied = meas["tied_params"] * meas["element_bytes"]  # SmolLM2 ties the head to the embedding: one tensor on rank 0
    assert tied == units["embed"]["param_bytes"] > 0
    assert v["param_bytes"][0] == pieces["param_bytes"][0] + pieces["param_bytes"][7] - tied
    assert v["param_bytes"][0] - v["param_bytes"][3] == units["head"]["param_bytes"]
    assert v["forward_s"] == pieces["forward_s"] and len(v["forward_s"]) == 8
    assert schedule_costs(spec("1f1b"), 4, costs) is costs and schedule_costs(spec("zbv"), 4, {**costs, "pieces": {}}) is not v
    row = compare_row(4, 4, costs, 0.0, 0.0, 5, 0.5, None, 1.05)["schedules"]
    assert round(row["zbv"]["peak_bytes"] / GIB, 2) == 10.72 and round(row["1f1b"]["peak_bytes"] / GIB, 2) == 11.25


def test_where_the_layers_do_not_fill_the_pieces_only_the_two_chunk_schedules_are_skipped():
    """SmolLM2-135M has 30 layers: at p = 16 the one-chunk schedules fit and interleaved and ZB-V (32 pieces) do not."""
    from lightning_async.tools.plan_table import compare_row
    from lightning_async.tools.stage_costs import map_costs, nominal_model

    costs = map_costs(nominal_model("smollm2-135m", 2048, 1, "bfloat16", 100.0), 16, 2.0)
    row = compare_row(16, 16, costs, 0.0, 0.0, 5, 0.5, None, 1.05)["schedules"]
    for name in ("zbv", "interleaved"):
        assert row[name]["skipped"].startswith("2 chunks per stage are 32 pieces: 30 layers cannot fill 32 stages")
    assert all("per_batch_s" in row[name] for name in ("1f1b", "zbh1", "2bw"))
