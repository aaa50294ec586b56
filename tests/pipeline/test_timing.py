"""The timing model of the schedules (lightning_async.pipeline.timing) against closed forms, and the
`plan` command."""

from __future__ import annotations

import json

import pytest

from lightning_async.pipeline.timeline import render_timeline
from lightning_async.pipeline.timing import DeadlockError, predict, time_action_lists, time_schedule
from lightning_async.pipeline.schedules import Action

GRID = [(1, 1), (1, 3), (2, 2), (3, 5), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24), (16, 32)]
COSTS = [(1.0, 2.0), (1.0, 1.0), (0.3, 0.7)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flushing_schedules_closed_form(schedule):
    for p, m in GRID:
        for tf, tb in COSTS:
            r = time_schedule(schedule, p, m, 5, tf, tb)
            assert r.per_batch_time == pytest.approx((m + p - 1) * (tf + tb))
            assert r.total_time == pytest.approx(5 * (m + p - 1) * (tf + tb))
            assert r.bubble == pytest.approx((p - 1) / (m + p - 1))
            assert r.bubble_total == pytest.approx((p - 1) / (m + p - 1))
            assert r.throughput_rel == pytest.approx(m / (m + p - 1))
            assert r.weight_versions == [1] * p
            if schedule == "gpipe":
                assert r.peak_inflight == [m] * p
            else:
                assert r.peak_inflight == [min(p - s, m) for s in range(p)]


def test_gpipe_closed_form_when_m_below_p():
    r = time_schedule("gpipe", 8, 3, 4, 1.0, 2.0)
    assert r.per_batch_time == pytest.approx((3 + 7) * 3.0)
    assert r.peak_inflight == [3] * 8


def test_2bw_steady_state_has_no_bubble():
    for p, m in GRID:
        for tf, tb in COSTS:
            r = time_schedule("2bw", p, m, 6, tf, tb)
            assert r.per_batch_time == pytest.approx(m * (tf + tb))
            assert r.bubble == pytest.approx(0.0, abs=1e-9)
            assert max(r.bubble_per_stage) == pytest.approx(0.0, abs=1e-9)
            assert r.throughput_rel == pytest.approx(1.0)
            # One fill and one drain for the whole run, not one per batch.
            assert r.total_time == pytest.approx((6 * m + p - 1) * (tf + tb))
            assert r.peak_inflight == [p - s for s in range(p)]
            assert r.weight_versions == [2] * p
            assert 0 < r.bubble_total < (p - 1) / (m + p - 1) + 1e-12 or p == 1


def test_2bw_gain_over_1f1b_matches_formula():
    for p, m in [(4, 4), (8, 16), (16, 16)]:
        t1 = time_schedule("1f1b", p, m, 5, 1.0, 2.0).per_batch_time
        t2 = time_schedule("2bw", p, m, 5, 1.0, 2.0).per_batch_time
        assert t1 / t2 == pytest.approx((m + p - 1) / m)


def test_communication_latency():
    """GPipe pays the hop latency twice per fill/drain; 2BW once per round trip of its p in-flight micro-batches."""
    for p, m, c in [(2, 2, 1.0), (4, 4, 0.5), (4, 8, 0.5), (8, 16, 1.0), (8, 8, 0.25)]:
        tf, tb = 1.0, 2.0
        gp = time_schedule("gpipe", p, m, 6, tf, tb, comm=c)
        assert gp.per_batch_time == pytest.approx((m + p - 1) * (tf + tb) + 2 * (p - 1) * c)
        bw = time_schedule("2bw", p, m, 6, tf, tb, comm=c)
        assert bw.per_batch_time == pytest.approx(m * (tf + tb + 2 * (p - 1) * c / p))
        ofob = time_schedule("1f1b", p, m, 6, tf, tb, comm=c)
        # 1F1B alternates F and B, so it waits on the latency in its steady phase too: never faster than GPipe.
        assert ofob.per_batch_time >= gp.per_batch_time - 1e-9
        assert bw.per_batch_time < gp.per_batch_time
    # Per-hop latencies as a list. Stages s..r hold r - s + 1 more micro-batches in flight than stage r + 1, and
    # each makes the round trip s -> r -> s, so the period per micro-batch is at least
    # max over windows [s, r] of (sum of tf + tb over the window + 2 * sum of the hops inside) / (r - s + 1).
    for hops, period in [([0.0, 1.5], 4.5), ([1.5, 0.0], 4.5), ([1.0, 0.5], 4.0), ([0.25, 0.25], 10 / 3)]:
        assert period == pytest.approx(_window_bound([1.0] * 3, [2.0] * 3, hops))
        r = time_schedule("2bw", 3, 6, 6, 1.0, 2.0, comm=hops)
        assert r.per_batch_time == pytest.approx(6 * period), hops


def _window_bound(tf, tb, hops):
    p = len(tf)
    return max(
        (sum(tf[s : r + 1]) + sum(tb[s : r + 1]) + 2 * sum(hops[s:r])) / (r - s + 1) for s in range(p) for r in range(s, p)
    )


def test_unbalanced_stages_run_at_the_bottleneck():
    tf, tb = [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0]
    r = time_schedule("2bw", 4, 8, 8, tf, tb)
    assert r.ideal_per_batch_time == pytest.approx(8 * 6.0)
    assert r.per_batch_time == pytest.approx(8 * 6.0)
    assert r.bubble_per_stage[2] == pytest.approx(0.0, abs=1e-9)
    assert r.bubble_per_stage[0] == pytest.approx(0.5)
    assert r.bubble == pytest.approx(1 - (3 * 24 + 48) / (4 * 48))
    s = time_schedule("1f1b", 4, 8, 8, tf, tb)
    assert s.per_batch_time > r.per_batch_time
    assert s.throughput_rel == pytest.approx(48 / s.per_batch_time)


def test_update_time_is_paid_once_per_batch():
    for schedule, base in [("1f1b", 11 * 3.0), ("2bw", 8 * 3.0)]:
        r = time_schedule(schedule, 4, 8, 6, 1.0, 2.0, update=0.5)
        assert r.per_batch_time == pytest.approx(base + 0.5)


def test_trace_respects_dependencies():
    p, m, c = 4, 6, 0.25
    r = time_schedule("2bw", p, m, 3, [1.0, 1.5, 1.0, 0.5], 2.0, comm=c)
    end = [{(a.kind, a.microbatch): e for a, _, e in t if a.kind != "U"} for t in r.trace]
    for s, t in enumerate(r.trace):
        prev_end = 0.0
        for a, start, e in t:
            assert start >= prev_end - 1e-12  # one action at a time, in order
            prev_end = e
            if a.kind == "F" and s > 0:
                assert start >= end[s - 1][("F", a.microbatch)] + c - 1e-12
            if a.kind == "B":
                dep = end[s + 1][("B", a.microbatch)] + c if s < p - 1 else end[s][("F", a.microbatch)]
                assert start >= dep - 1e-12
        # Work-conserving: each action starts exactly when its stage or its dependency frees up.
        for (a, start, _), (_, _, before) in zip(t[1:], t[:-1]):
            deps = [before]
            if a.kind == "F" and s > 0:
                deps.append(end[s - 1][("F", a.microbatch)] + c)
            if a.kind == "B":
                deps.append(end[s + 1][("B", a.microbatch)] + c if s < p - 1 else end[s][("F", a.microbatch)])
            assert start == pytest.approx(max(deps))


def test_simulate_rejects_bad_settings():
    with pytest.raises(ValueError, match="n_microbatches"):
        time_schedule("2bw", 4, 2, 2)
    with pytest.raises(ValueError, match="one per stage"):
        time_schedule("1f1b", 4, 4, 2, forward=[1.0, 2.0])
    with pytest.raises(ValueError, match="num_batches"):
        time_schedule("1f1b", 2, 2, 0)
    with pytest.raises(DeadlockError):
        time_action_lists([[Action("F", 1, 0)], [Action("F", 0, 0)]], 1.0, 1.0)


def test_predict():
    out = predict("2bw", 4, 8, 0.1, 0.2, num_batches=6)
    assert out["per_batch_s"] == pytest.approx(8 * 0.3)
    assert out["microbatches_per_s"] == pytest.approx(8 / 2.4)
    assert out["bubble"] == pytest.approx(0.0, abs=1e-9)
    assert out["total_s"] == pytest.approx((6 * 8 + 3) * 0.3)
    assert len(out["batch_end_s"]) == 6
    json.dumps(out)
    sync = predict("1f1b", 4, 8, [0.1] * 4, [0.2] * 4, comm_s=0.0, num_batches=3)
    assert sync["per_batch_s"] == pytest.approx(11 * 0.3)
    assert sync["bubble"] == pytest.approx(3 / 11)


def test_timeline_rendering():
    r = time_schedule("2bw", 4, 4, 2, 1.0, 1.0)
    text = render_timeline(r)
    rows = text.splitlines()
    assert len(rows) == 4 and all(row.startswith(f"s{s} ") for s, row in enumerate(rows))
    assert rows[0].split()[1:4] == ["F0", "F1", "F2"]
    assert rows[3].startswith("s3 ....")  # the last stage waits for the fill
    assert "|" in rows[0]  # update markers
    # Stage 0 is never idle between its first backward and its update of batch 0 in 2BW.
    segment = rows[0][rows[0].index("B0") : rows[0].index("|")]
    assert "." not in segment


def test_plan_command_with_given_costs(tmp_path, capsys):
    """``plan`` prints the map; ``--compare``, which chose the map over the removed 1F1B/2BW table, changes nothing."""
    from lightning_async.tools.plan import plan_main

    args = ["--forward-ms", "10", "--backward-ms", "20", "--stages", "4", "8", "--microbatches", "1", "2"]
    out, compared = tmp_path / "plan.json", tmp_path / "compare.json"
    assert plan_main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "2BW x best sync" in text and "recommendation" in text
    assert plan_main([*args, "--compare", "--json", str(compared)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == json.loads(compared.read_text())["rows"]
    rows = {(r["p"], r["m"]): r["schedules"] for r in data["rows"]}
    assert set(rows) == {(4, 4), (4, 8), (8, 8), (8, 16)}
    r = rows[(4, 8)]
    assert r["1f1b"]["per_batch_s"] == pytest.approx(11 * 0.03)
    assert r["2bw"]["per_batch_s"] == pytest.approx(8 * 0.03)
    assert r["1f1b"]["bubble"] == pytest.approx(3 / 11)


def test_the_map_compares_every_schedule_with_2bw(tmp_path, capsys):
    """``plan --compare``: closed forms at F = I = W (ZB-H1 and ZB-V 0.8 of the limit at m = p, ZB-V bubble-free at
    m = 2p), the best synchronous schedule, 2BW's speed-up over it, and the recommendation that follows."""
    from lightning_async.tools.plan import plan_main

    out = tmp_path / "map.json"
    assert plan_main(["--compare", "--forward-ms", "10", "--backward-ms", "20", "--stages", "4", "--microbatches", "1", "2",
                      "--json", str(out)]) == 0
    assert "recommendation" in capsys.readouterr().out
    rows = {(r["p"], r["m"]): r for r in json.loads(out.read_text())["rows"]}
    at_p, at_2p = rows[(4, 4)], rows[(4, 8)]
    times = {n: e["per_batch_s"] for n, e in at_p["schedules"].items()}
    assert times["1f1b"] == pytest.approx(7 * 0.03) and times["2bw"] == pytest.approx(4 * 0.03)
    assert times["zbh1"] == pytest.approx(4 * 0.03 + 3 * 0.01)  # m (F + B) + (p - 1)(F + I - W)
    assert times["interleaved"] == pytest.approx(4 * 0.03 + 3 * 0.03 / 2)
    assert at_p["2bw_over_best_sync"] == pytest.approx(1.25) and at_p["recommendation"].startswith("2bw")
    assert at_2p["schedules"]["zbv"]["per_batch_s"] == pytest.approx(8 * 0.03)
    assert at_2p["best_sync"] == "zbv" and at_2p["2bw_over_best_sync"] == pytest.approx(1.0)
    assert at_2p["recommendation"].startswith("zbv: 2BW gains only")


def test_the_map_leaves_out_schedules_over_the_memory_budget(tmp_path, capsys):
    from lightning_async.tools.plan import plan_main

    out = tmp_path / "map.json"
    assert plan_main(["--compare", "--stages", "4", "--microbatches", "1", "--memory-gib", "3", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    over = {n for n, e in row["schedules"].items() if not e["fits"]}
    assert over and "1f1b" not in over and row["best_sync"] not in over  # the nominal head makes ZB stages heavy
    assert plan_main(["--compare", "--weight-fraction", "1.5"]) == 2
    assert "--weight-fraction must be in [0, 1)" in capsys.readouterr().err


def test_the_map_at_a_global_batch_over_replica_counts(tmp_path, capsys):
    """``--global-batch G --data-parallel ...``: m = G / (dp x micro-batch) per pipeline; the sharded optimizer
    lowers the memory per rank by the optimizer state's (dp - 1) / dp; bad combinations are one-line errors."""
    from lightning_async.tools.plan import plan_main

    def rows(*extra):
        out = tmp_path / "map.json"
        assert plan_main(["--compare", "--stages", "4", "--global-batch", "32", "--micro-batch-size", "2",
                          "--data-parallel", "1", "2", "4", "3", *extra, "--json", str(out)]) == 0
        return {r["dp"]: r for r in json.loads(out.read_text())["rows"]}

    plain, sharded = rows(), rows("--shard-optimizer")
    assert {dp: r["m"] for dp, r in plain.items()} == {1: 16, 2: 8, 4: 4}  # dp=3 does not split 32
    assert "dp=3: the global batch 32 does not split" in capsys.readouterr().out
    gain = {dp: r["2bw_over_best_sync"] for dp, r in plain.items()}
    assert gain[4] > gain[1] + 0.02 and gain[2] > gain[1] - 1e-9  # fewer micro-batches per pipeline: 2BW gains
    for dp in (2, 4):
        saved = plain[dp]["schedules"]["2bw"]["peak_bytes"] - sharded[dp]["schedules"]["2bw"]["peak_bytes"]
        assert saved > 0
    assert plain[1]["schedules"]["2bw"]["peak_bytes"] == sharded[1]["schedules"]["2bw"]["peak_bytes"]
    assert plan_main(["--compare", "--data-parallel", "2"]) == 2
    assert "--data-parallel needs --global-batch" in capsys.readouterr().err
    assert plan_main(["--forward-ms", "10", "--stages", "4", "--global-batch", "8"]) == 0  # the map needs no --compare


def test_schedule_memory_shards_the_optimizer_and_correction_over_replicas():
    from lightning_async.pipeline.memory import schedule_memory

    plain = schedule_memory("2bw", 2, 4, 1000, 2000, 10, correction_buffers=1, data_parallel_size=4)
    sharded = schedule_memory("2bw", 2, 4, 1000, 2000, 10, correction_buffers=1, data_parallel_size=4, shard_optimizer=True)
    for a, b in zip(plain, sharded):
        assert (b["optimizer"], b["correction"]) == (a["optimizer"] // 4, a["correction"] // 4)
        assert (b["weights"], b["gradients"], b["activations"]) == (a["weights"], a["gradients"], a["activations"])
    with pytest.raises(ValueError, match="shard_optimizer and fsdp need data_parallel_size > 1"):
        schedule_memory("2bw", 2, 4, 1000, 2000, 10, shard_optimizer=True)


@pytest.mark.parametrize("schedule, copies", [("1f1b", 1), ("2bw", 3)])
def test_schedule_memory_under_fsdp_shards_weights_and_state_but_not_the_accumulated_gradient(schedule, copies):
    from lightning_async.pipeline.memory import schedule_memory

    plain = schedule_memory(schedule, 2, 4, 1000, 2000, 10, correction_buffers=1, data_parallel_size=4)
    fsdp = schedule_memory(schedule, 2, 4, 1000, 2000, 10, correction_buffers=1, data_parallel_size=4, fsdp=True)
    for a, b in zip(plain, fsdp):
        assert (b["optimizer"], b["correction"]) == (a["optimizer"] // 4, a["correction"] // 4)
        assert b["weights"] == copies * 1000 // 4  # 2BW: both versions and the parameters FSDP gathers from
        assert (b["gradients"], b["activations"]) == (a["gradients"], a["activations"])
    with pytest.raises(ValueError, match="fsdp already shards the optimizer state"):
        schedule_memory(schedule, 2, 4, 1000, 2000, 10, data_parallel_size=4, shard_optimizer=True, fsdp=True)


def test_the_map_under_fsdp_leaves_out_the_split_backward(tmp_path, capsys):
    from lightning_async.tools.plan import plan_main

    out = tmp_path / "map.json"
    assert plan_main(["--compare", "--stages", "4", "--global-batch", "16", "--micro-batch-size", "1",
                      "--data-parallel", "1", "4", "--fsdp", "--json", str(out)]) == 0
    rows = {r["dp"]: r for r in json.loads(out.read_text())["rows"]}
    assert "skipped" not in rows[1]["schedules"]["zbh1"]  # one replica: no FSDP, every schedule
    refused = {n for n, e in rows[4]["schedules"].items() if "skipped" in e}
    assert refused == {"zbh1", "zbv", "2bw-split", "paci", "wpipe"} and rows[4]["best_sync"] in ("1f1b", "interleaved")
    assert "splits the backward" in rows[4]["schedules"]["zbh1"]["skipped"]
    assert "updates each chunk of a stage on its own" in rows[4]["schedules"]["wpipe"]["skipped"]
    assert "in the middle of a call" in rows[4]["schedules"]["paci"]["skipped"]
    assert plan_main(["--compare", "--global-batch", "16", "--data-parallel", "2", "--fsdp", "--shard-optimizer"]) == 2
    assert "--fsdp already shards the optimizer state" in capsys.readouterr().err


def test_plan_command_measures_a_tiny_model(tmp_path, capsys):
    from lightning_async.tools.plan import plan_main

    out = tmp_path / "plan.json"
    rc = plan_main(
        ["--model", "tiny", "--seq-len", "64", "--stages", "2", "4", "8", "--reps", "1", "--json", str(out)]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "skip" in text.lower()  # tiny has 4 layers: p=8 cannot be placed
    data = json.loads(out.read_text())
    assert {r["p"] for r in data["rows"]} == {2, 4}
    assert data["skipped"] and data["skipped"][0]["p"] == 8
    row = next(r for r in data["rows"] if r["p"] == 4 and r["m"] == 4)["schedules"]
    assert row["2bw"]["peak_bytes"] > row["1f1b"]["peak_bytes"]  # a second weight version
    costs = data["stage_costs"]["4"]
    assert len(costs["forward_s"]) == 4 and all(t > 0 for t in costs["forward_s"] + costs["backward_s"])
    assert sum(costs["layers"]) == 4


def test_layer_splits():
    from lightning_async.tools.stage_costs import balanced_layers, split_layers

    assert split_layers(30, 4) == [7, 8, 8, 7]
    assert split_layers(32, 32) == [1] * 32
    assert split_layers(5, 1) == [5]
    with pytest.raises(ValueError, match="cannot fill"):
        split_layers(30, 32)
    # A head worth three blocks: the last stage gets fewer layers, and the slowest stage is as fast as possible.
    layers = balanced_layers(30, 4, 1.0, 0.0, 3.0)
    assert sum(layers) == 30 and min(layers) >= 1
    assert max(n + e for n, e in zip(layers, [0, 0, 0, 3])) == 9  # ceil((30 + 3) / 4)
    assert balanced_layers(8, 8, 1.0, 0.0, 5.0) == [1] * 8
    with pytest.raises(ValueError):
        balanced_layers(3, 4, 1.0, 0.0, 0.0)
