"""The depth study's findings (tools/depth_study) on synthetic run folders and made-up per-seed rows, and the advice
probe and plan print from them (tools/depth_advice)."""

from __future__ import annotations

import json
import math
import re

import pytest

from lightning_async.compare.divergence import Divergence, write_marker
from lightning_async.compare.synthetic import write_fake_run
from lightning_async.tools.depth_advice import (
    FINDINGS,
    TUNED_FINDINGS,
    depth_advice,
    load_comparisons,
    load_findings,
    optimizer_advice,
)
from lightning_async.tools.depth_study import (
    SeedRow,
    collect,
    comparisons,
    find_comparison,
    findings,
    load_summaries,
    main,
    merge_rows,
    read_rows,
    seed_rows,
    steps_to_reach,
    summarize,
)

TOL = 1e-5  # event files hold float32
SYNC = {0: [(200, 3.0), (400, 2.6), (600, 2.4)], 1: [(200, 3.1), (400, 2.7), (600, 2.5)]}
T_975_2 = 4.302652729911275  # Student t, 0.975 quantile, 2 degrees of freedom (n = 3 seeds)


def fake_study(root, profile: str, mode: str, finals: dict[int, float], optimizer: str = "adamw") -> None:
    for seed, final in finals.items():
        curve = dict(SYNC[seed][:-1]) | {600: final}
        write_fake_run(root / f"evidence-depth-{profile}" / "runs" / f"{optimizer}-{mode}-lr0.01-s{seed}", val_loss=curve)


def gaps(profile: str, correction: str, values: list[float], optimizer: str = "adamw") -> list[SeedRow]:
    """Made-up rows: seed i has gap ``values[i]``."""
    return [SeedRow(optimizer, profile, correction, seed, gap, 2.0) for seed, gap in enumerate(values)]


def test_rows_pair_each_run_with_the_sync_run_of_its_seed(tmp_path) -> None:
    fake_study(tmp_path, "2bw", "sync", {0: 2.4, 1: 2.5})
    fake_study(tmp_path, "2bw", "delayed", {0: 2.5, 1: 2.62})
    fake_study(tmp_path, "pipedream-8", "delayed", {0: 2.8, 1: 2.9})
    fake_study(tmp_path, "pipedream-8", "delayed-ef", {0: 2.6, 1: 2.7})
    write_fake_run(tmp_path / "evidence-depth-pipedream-8" / "runs" / "adamw-delayed-ef-lr0.01-s2", done=False)
    blown = write_fake_run(tmp_path / "evidence-depth-pipedream-8" / "runs" / "adamw-delayed-lr0.01-s2",
                           val_loss={200: 3.0, 400: float("nan")})
    write_marker(blown, Divergence(step=400, metric="val/loss", value=float("nan"), source="guard"))
    runs, unfinished, diverged = collect(tmp_path)
    assert unfinished == 1 and diverged == ["evidence-depth-pipedream-8/adamw-delayed-lr0.01-s2"]
    rows = seed_rows(runs, source="here")
    assert [(r.profile, r.correction, r.seed) for r in rows] == [
        ("2bw", "none", 0), ("2bw", "none", 1), ("pipedream-8", "none", 0), ("pipedream-8", "none", 1),
        ("pipedream-8", "ef", 0), ("pipedream-8", "ef", 1)]
    assert rows[1].gap == pytest.approx(0.12, abs=TOL) and rows[1].source == "here"
    summaries = {(r.profile, r.correction): r for r in summarize(rows)}
    plain, ef = summaries[("pipedream-8", "none")], summaries[("pipedream-8", "ef")]
    assert plain.seeds == 2 and plain.seed_ids == (0, 1) and plain.gap == pytest.approx(0.4, abs=TOL)
    assert plain.gap_low == pytest.approx(0.4, abs=1e-4)  # the same gap in both seeds: a zero-width interval
    assert ef.gap == pytest.approx(0.2, abs=TOL) and ef.recovered == pytest.approx(0.5, abs=TOL)
    # seed 0: sync reaches 2.6 at step 400 (its curve), the run ends there at 600: 1.5x; seed 1 the same
    assert ef.slowdown == pytest.approx(1.5, abs=TOL)
    assert summaries[("2bw", "none")].gap == pytest.approx(0.11, abs=TOL)


def test_an_optimizer_name_with_an_underscore_is_its_own_row(tmp_path) -> None:
    """``basis_rotation`` runs (the zoo name) pair with their own sync runs, not SOAP's or AdamW's."""
    fake_study(tmp_path, "2bw", "sync", {0: 2.4}, optimizer="basis_rotation")
    fake_study(tmp_path, "2bw", "delayed", {0: 2.45}, optimizer="basis_rotation")
    fake_study(tmp_path, "2bw", "sync", {0: 2.0}, optimizer="soap")
    rows = seed_rows(collect(tmp_path)[0])
    assert [(r.optimizer, r.profile, r.correction, r.seed) for r in rows] == [("basis_rotation", "2bw", "none", 0)]
    assert rows[0].gap == pytest.approx(0.05, abs=TOL)


def test_steps_to_reach_interpolates_and_says_never() -> None:
    curve = [(200, 3.0), (400, 2.6), (600, 2.4)]
    assert steps_to_reach(curve, 2.8) == pytest.approx(300)
    assert steps_to_reach(curve, 3.5) == 200 and steps_to_reach(curve, 2.0) is None


def test_main_prints_the_table_and_writes_every_seed(tmp_path, capsys) -> None:
    fake_study(tmp_path, "2bw", "sync", {0: 2.4})
    fake_study(tmp_path, "pipedream-4", "delayed", {0: 2.3})  # better than sync: sync never got there
    out = tmp_path / "findings.json"
    assert main([str(tmp_path), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| adamw | pipedream-4 | none | 1 | s0 -0.1000 | -0.100 (n=1, no interval) |  | sync never got there |" in table
    written = json.loads(out.read_text())
    assert written["rows"][0]["seed"] == 0 and math.isinf(written["rows"][0]["slowdown"])
    assert written["summaries"][0]["seeds"] == 1 and written["comparisons"] == []
    assert main([str(tmp_path / "nothing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main([]) == 2 and "--rows FILE, or both" in capsys.readouterr().err


def test_main_compares_the_optimizers_of_each_profile(tmp_path, capsys) -> None:
    for optimizer, delayed in (("adamw", {0: 2.7, 1: 2.9}), ("soap", {0: 2.45, 1: 2.56})):
        fake_study(tmp_path, "2bw", "sync", {0: 2.4, 1: 2.5}, optimizer=optimizer)
        fake_study(tmp_path, "pipedream-8", "delayed", delayed, optimizer=optimizer)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("across optimizers under pipedream-8 without a correction (these rows): soap has the smallest gap to its "
            "own sync run, +0.055 (n=2); its gap minus adamw's (+0.350): -0.295 (95% CI ") in out
    assert "under 2bw" not in out  # no delayed 2bw runs: nothing to compare there


def test_merging_keeps_recorded_rows_and_a_run_found_replaces_its_key(tmp_path, capsys) -> None:
    recorded = [SeedRow("adamw", "2bw", "none", 0, 0.9, 3.0, source="session 1"),
                SeedRow("adamw", "pipedream-16", "none", 0, 1.05, 6.0, True, "session 1")]
    merged, replaced = merge_rows(recorded, [SeedRow("adamw", "2bw", "none", 0, 0.1, 1.5, source="now"),
                                             SeedRow("adamw", "2bw", "none", 1, 0.2, 1.5, source="now")])
    assert replaced == 1
    assert [(r.profile, r.seed, r.gap, r.source) for r in merged] == [
        ("2bw", 0, 0.1, "now"), ("2bw", 1, 0.2, "now"), ("pipedream-16", 0, 1.05, "session 1")]
    # the same through the command: recorded rows from a findings file, runs from a folder, written back
    previous = tmp_path / "previous.json"
    previous.write_text(json.dumps(findings(recorded)))
    fake_study(tmp_path, "2bw", "sync", {0: 2.4, 1: 2.5})
    fake_study(tmp_path, "2bw", "delayed", {0: 2.5, 1: 2.62})
    assert main([str(tmp_path), "--rows", str(previous), "--json", str(previous)]) == 0
    assert "3 rows: 2 recorded (1 replaced by runs found), 2 from runs" in capsys.readouterr().out
    rows = read_rows(previous)
    assert [(r.profile, r.seed) for r in rows] == [("2bw", 0), ("2bw", 1), ("pipedream-16", 0)]
    assert rows[0].gap == pytest.approx(0.1, abs=TOL) and rows[2] == recorded[1]
    # without a folder the recorded rows alone are summarised again, and nothing is lost
    assert main(["--rows", str(previous), "--json", str(previous)]) == 0 and read_rows(previous) == rows
    # a file of summaries only (the older format) has no seeds to merge by
    old = tmp_path / "old.json"
    old.write_text(json.dumps(json.loads(previous.read_text())["summaries"]))
    assert main(["--rows", str(old)]) == 2 and "holds no per-seed rows" in capsys.readouterr().err
    assert load_summaries(old)[0][0].seeds == 2 and load_summaries(old)[1] == []


def test_paired_intervals_equal_a_hand_computed_reference() -> None:
    rows = (gaps("2bw", "none", [0.3, 0.4, 0.5]) + gaps("2bw", "ef", [0.1, 0.2, 0.3])
            + gaps("pipedream-8", "none", [0.9, 1.0, 1.4]))
    summary = {(r.profile, r.correction): r for r in summarize(rows)}
    plain = summary[("2bw", "none")]
    half = T_975_2 * 0.1 / math.sqrt(3)  # sd of 0.3, 0.4, 0.5 is 0.1
    assert (plain.seeds, plain.gap) == (3, pytest.approx(0.4))
    assert (plain.gap_low, plain.gap_high) == (pytest.approx(0.4 - half), pytest.approx(0.4 + half))
    # EF wins 0.2 in every seed: Fieller's interval of 0.2 / mean(gap) is 0.2 over the gap's own t interval
    ef = summary[("2bw", "ef")]
    assert ef.recovered == pytest.approx(0.5) and ef.seed_recovered == pytest.approx((2 / 3, 0.5, 0.4))
    assert (ef.recovered_low, ef.recovered_high) == (pytest.approx(0.2 / (0.4 + half)), pytest.approx(0.2 / (0.4 - half)))
    # pipedream-8 minus 2bw, per seed 0.6, 0.6, 0.9: mean 0.7, sd sqrt(0.03)
    found = comparisons(rows)
    mean, interval = find_comparison(found, "adamw", ("pipedream-8", "none"), ("2bw", "none"))
    half = T_975_2 * math.sqrt(0.03) / math.sqrt(3)
    assert (mean, interval.low, interval.high) == (pytest.approx(0.7), pytest.approx(0.7 - half), pytest.approx(0.7 + half))
    mean, interval = find_comparison(found, "adamw", ("2bw", "none"), ("pipedream-8", "none"))  # the other way round
    assert (mean, interval.low, interval.high) == (pytest.approx(-0.7), pytest.approx(-0.7 - half), pytest.approx(-0.7 + half))
    assert find_comparison(found, "muon", ("2bw", "ef"), ("2bw", "none")) is None


def test_no_share_of_a_gap_whose_interval_includes_zero() -> None:
    rows = gaps("2bw", "none", [0.3, -0.2, 0.1]) + gaps("2bw", "ef", [0.1, 0.0, 0.0])
    (ef,) = [r for r in summarize(rows) if r.correction == "ef"]
    assert ef.recovered is None and ef.recovered_low is None and ef.recovered_n == 3


def advice_rows(ef_gaps: list[float]) -> tuple[list, list]:
    rows = gaps("2bw", "none", [0.32, 0.36, 0.50]) + gaps("2bw", "ef", ef_gaps) + gaps("pipedream-8", "none", [0.8, 1.0, 1.0])
    return summarize(rows), comparisons(rows)


def test_advice_is_established_only_where_the_paired_interval_excludes_zero() -> None:
    # EF ends lower in every seed: the paired difference excludes 0 although the two gap intervals overlap
    summaries, compared = advice_rows([0.09, 0.11, 0.32])
    ef, plain = summaries[1], summaries[0]
    assert ef.gap_high > plain.gap_low  # overlapping intervals: an unpaired reading would not tell them apart
    text = depth_advice(8, summaries, comparisons=compared)
    assert "lowest measured gap: 2bw + Error Feedback (k-step form): gap to sync +0.173" in text
    assert "runner-up 2bw + no correction" in text
    # per seed -0.23, -0.25, -0.18: sd sqrt(0.0013), half-width 4.303 sd / sqrt(3) = 0.090
    assert "Established: best minus the runner-up -0.220 (95% CI -0.310 to -0.130, n=3, paired by seed)." in text
    assert "Against the best of pipedream-8 (pipedream-8 + no correction, gap +0.933): established: best minus" in text
    # EF ends higher in one seed: the paired interval includes 0, and the advice says so
    summaries, compared = advice_rows([0.09, 0.11, 0.70])
    text = depth_advice(8, summaries, comparisons=compared)
    assert "lowest measured gap: 2bw + Error Feedback (k-step form)" in text and "Established" not in text
    # per seed -0.23, -0.25, +0.20: sd 0.2542, half-width 0.632
    assert "Not established: best minus the runner-up -0.093 (95% CI -0.725 to +0.538, n=3, paired by seed) " \
           "includes 0; more seeds would settle it." in text
    # without the comparisons there is no paired interval, so nothing is established
    assert "Not established: fewer than two seeds in common with the runner-up" in depth_advice(8, summaries)


def test_advice_says_what_is_not_measured() -> None:
    summaries, compared = advice_rows([0.09, 0.11, 0.32])
    text = depth_advice(16, summaries, comparisons=compared)
    assert "PipeDream's profile at p=16 is not measured (measured p: 8)" in text
    assert depth_advice(1, summaries).startswith("p=1: one stage")
    alone = depth_advice(4, summaries[:1])
    assert "the only measurement: 2bw + no correction" in alone and "runner-up" not in alone
    assert "no muon measurement" in depth_advice(8, summaries, optimizer="muon")
    with pytest.raises(ValueError, match="stages must be a positive number"):
        depth_advice(0, summaries)


def test_across_optimizers_the_smallest_gap_is_established_only_by_its_paired_interval() -> None:
    def rows(optimizer, gaps, profile="pipedream-4"):
        return [SeedRow(optimizer, profile, "none", seed, gap, 1.0) for seed, gap in enumerate(gaps)]

    # SOAP's gap is below AdamW's in every seed: -0.48, -0.51, -0.49 (sd 0.0153, half-width 4.303 sd / sqrt(3) = 0.038)
    text = optimizer_advice(4, rows("adamw", [0.52, 0.54, 0.52]) + rows("soap", [0.04, 0.03, 0.03]), tuned_rows=())
    assert "soap has the smallest gap to its own sync run, +0.033 (n=3)" in text
    assert "minus adamw's (+0.527): -0.493 (95% CI -0.531 to -0.455, n=3, paired by seed), established" in text
    # one seed the other way round: the paired interval includes 0
    text = optimizer_advice(4, rows("adamw", [0.52, 0.54, 0.02]) + rows("soap", [0.04, 0.03, 0.30]), tuned_rows=())
    assert "not established (the interval includes 0)" in text and ", established" not in text
    # one seed in common, another profile, a correction: no comparison, or nothing said
    text = optimizer_advice(4, rows("adamw", [0.52]) + rows("soap", [0.04]), tuned_rows=())
    assert "not established, fewer than two seeds in common" in text
    assert optimizer_advice(4, rows("adamw", [0.5, 0.5]) + rows("soap", [0.04, 0.03], profile="pipedream-8"), tuned_rows=()) is None
    assert optimizer_advice(8, rows("soap", [0.04, 0.03], profile="pipedream-8"), tuned_rows=()) is None
    # the rows at each optimizer's sync-tuned lr follow, where they cover the profile
    tuned = rows("adamw", [0.56, 0.54, 0.58]) + rows("soap", [0.16, 0.17, 0.16])
    text = optimizer_advice(4, rows("adamw", [0.52, 0.54, 0.52]) + rows("soap", [0.04, 0.03, 0.03]), tuned_rows=tuned)
    first, then = text.split(" Then ")
    assert "soap has the smallest gap to its own sync run, +0.033 (n=3)" in first
    assert then.startswith("across optimizers under pipedream-4 without a correction (at each optimizer's sync-tuned lr")
    assert "soap has the smallest gap to its own sync run, +0.163 (n=3)" in then
    assert optimizer_advice(8, rows("adamw", [0.5, 0.5]), tuned_rows=tuned) is None


def test_shipped_findings_say_soap_beats_adamw_and_muon_under_pipedream() -> None:
    for p in (4, 8, 16, 32):  # docs/results.md, Part D: SOAP's gap under PipeDream's profile, three seeds, against the others'
        text = optimizer_advice(p).split(" Then ")[0]  # at the depth study's lrs (Tables 1 and 2)
        assert "soap has the smallest gap" in text
        for other in ("muon", "adamw", "basis_rotation"):
            assert re.search(rf"minus {other}'s \(\+[0-9.]+\): -[0-9.]+ \(95% CI -[0-9.]+ to -[0-9.]+, n=3, paired by seed\), "
                             r"established", text), text


def test_shipped_tuned_findings_say_soaps_lead_ends_at_sixteen_stages() -> None:
    """docs/results.md, Part D, Table 4: at each optimizer's sync-tuned lr SOAP's gap is below AdamW's under
    PipeDream-4 and -8 (established) and not told apart from it at 16 and 32 stages."""
    for p, verdict in ((4, "established"), (8, "established"), (16, "not established"), (32, "not established")):
        tuned = optimizer_advice(p).split(" Then ")[1]
        assert tuned.startswith(f"across optimizers under pipedream-{p} without a correction (at each optimizer's "
                                "sync-tuned lr") and "soap has the smallest gap" in tuned
        assert re.search(rf"minus adamw's \(\+[0-9.]+\): -[0-9.]+ \(95% CI [-+0-9. to]+, n=3, paired by seed\), "
                         rf"{verdict}", tuned), tuned
    tuned = json.loads(TUNED_FINDINGS.read_text())
    assert json.loads(json.dumps(findings(read_rows(TUNED_FINDINGS)))) == tuned  # regenerated from its own rows


def test_shipped_findings_are_the_paired_summaries_of_their_rows() -> None:
    shipped = json.loads(FINDINGS.read_text())
    assert json.loads(json.dumps(findings(read_rows(FINDINGS)))) == shipped  # regenerated from its own rows
    summary = {(r.optimizer, r.profile, r.correction): r for r in load_findings()}
    assert all(r.seeds == len(r.seed_ids) >= 1 for r in summary.values())
    # docs/results.md, Part D, Table 1 (AdamW n = 5, seeds 0-4)
    for profile, gap, low, high in (("2bw", 0.399, 0.297, 0.501), ("pipedream-4", 0.561, 0.455, 0.668),
                                    ("pipedream-8", 0.838, 0.615, 1.061)):
        r = summary[("adamw", profile, "none")]
        assert r.seed_ids == (0, 1, 2, 3, 4) and (round(r.gap, 3), round(r.gap_low, 3), round(r.gap_high, 3)) == (gap, low, high)
    # Table 1's basis rotation rows (its own label since session 4; 2BW's reproduce session 3's Table 3 to 4 decimals)
    rotation = summary[("basis_rotation", "2bw", "none")]
    assert rotation.seed_ids == (0, 1, 2) and (round(rotation.gap, 3), round(rotation.gap_low, 3)) == (0.071, 0.054)
    assert {p for (o, p, _) in summary if o in ("soap", "muon", "basis_rotation")} == {
        "2bw", "pipedream-4", "pipedream-8", "pipedream-16", "pipedream-32"}
    ef = summary[("adamw", "2bw", "ef")]
    assert (round(ef.recovered, 2), round(ef.recovered_low, 2), round(ef.recovered_high, 2)) == (0.58, 0.40, 0.83)
    compared = load_comparisons()
    for p in (4, 8):  # k-step EF under PipeDream: the paired difference includes 0
        _, interval = find_comparison(compared, "adamw", (f"pipedream-{p}", "ef"), (f"pipedream-{p}", "none"))
        assert not interval.excludes(0.0)


def test_a_run_worse_than_sync_at_its_first_validation_gives_a_lower_bound(tmp_path, capsys) -> None:
    fake_study(tmp_path, "2bw", "sync", {0: 2.4})
    fake_study(tmp_path, "pipedream-32", "delayed", {0: 3.2})  # above sync's 3.0 at step 200
    (row,) = summarize(seed_rows(collect(tmp_path)[0]))
    assert row.slowdown_is_bound and row.slowdown == pytest.approx(3.0)
    assert main([str(tmp_path)]) == 0 and "| >= 3.00x |" in capsys.readouterr().out
