"""The depth study's table (tools/depth_study) on synthetic run folders, and the advice probe and plan print
from it (tools/depth_advice)."""

from __future__ import annotations

import json
import math

import pytest

from lightning_async.compare.synthetic import write_fake_run
from lightning_async.tools.depth_advice import depth_advice, load_findings
from lightning_async.tools.depth_study import DepthRow, collect, depth_rows, main, steps_to_reach
from lightning_async.tools.plan import plan_main

TOL = 1e-5  # event files hold float32
SYNC = {0: [(200, 3.0), (400, 2.6), (600, 2.4)], 1: [(200, 3.1), (400, 2.7), (600, 2.5)]}


def fake_study(root, profile: str, mode: str, finals: dict[int, float]) -> None:
    for seed, final in finals.items():
        curve = dict(SYNC[seed][:-1]) | {600: final}
        write_fake_run(root / f"evidence-depth-{profile}" / "runs" / f"adamw-{mode}-lr0.01-s{seed}", val_loss=curve)


def test_rows_pair_each_run_with_the_sync_run_of_its_seed(tmp_path) -> None:
    fake_study(tmp_path, "2bw", "sync", {0: 2.4, 1: 2.5})
    fake_study(tmp_path, "2bw", "delayed", {0: 2.5, 1: 2.62})
    fake_study(tmp_path, "pipedream-8", "delayed", {0: 2.8, 1: 2.9})
    fake_study(tmp_path, "pipedream-8", "delayed-ef", {0: 2.6, 1: 2.7})
    write_fake_run(tmp_path / "evidence-depth-pipedream-8" / "runs" / "adamw-delayed-ef-lr0.01-s2", done=False)
    runs, unfinished = collect(tmp_path)
    assert unfinished == 1
    rows = {(r.profile, r.correction): r for r in depth_rows(runs)}
    assert list(rows) == [("2bw", "none"), ("pipedream-8", "none"), ("pipedream-8", "ef")]
    plain, ef = rows[("pipedream-8", "none")], rows[("pipedream-8", "ef")]
    assert plain.seeds == 2 and plain.gap == pytest.approx(0.4, abs=TOL) and plain.gap_low == pytest.approx(0.4, abs=TOL)
    assert ef.gap == pytest.approx(0.2, abs=TOL) and ef.recovered == pytest.approx(0.5, abs=TOL)
    # seed 0: sync reaches 2.6 at step 400 (its curve), the run ends there at 600: 1.5x; seed 1 the same
    assert ef.slowdown == pytest.approx(1.5, abs=TOL)
    assert rows[("2bw", "none")].gap == pytest.approx(0.11, abs=TOL)


def test_steps_to_reach_interpolates_and_says_never() -> None:
    curve = [(200, 3.0), (400, 2.6), (600, 2.4)]
    assert steps_to_reach(curve, 2.8) == pytest.approx(300)
    assert steps_to_reach(curve, 3.5) == 200 and steps_to_reach(curve, 2.0) is None


def test_main_prints_the_table_and_writes_json(tmp_path, capsys) -> None:
    fake_study(tmp_path, "2bw", "sync", {0: 2.4})
    fake_study(tmp_path, "pipedream-4", "delayed", {0: 2.3})  # better than sync: sync never got there
    out = tmp_path / "rows.json"
    assert main([str(tmp_path), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| adamw | pipedream-4 | none | 1 | -0.1000 (one seed: no interval) |  | sync never got there |" in table
    assert math.isinf(json.loads(out.read_text())[0]["slowdown"])
    assert main([str(tmp_path / "nothing")]) == 2
    assert "is not a folder" in capsys.readouterr().err


ROWS = [DepthRow("adamw", "2bw", "none", 3, 0.05, 0.03, 0.07, None, 1.3),
        DepthRow("adamw", "2bw", "ef", 3, 0.01, 0.0, 0.02, 0.8, 1.05),
        DepthRow("adamw", "pipedream-8", "none", 3, 0.4, 0.3, 0.5, None, 3.0),
        DepthRow("adamw", "pipedream-8", "ef", 3, 0.2, 0.1, 0.3, 0.5, 2.0)]


def test_advice_names_the_best_measured_profile_and_correction() -> None:
    text = depth_advice(8, ROWS)
    assert "lowest measured gap: 2bw + Error Feedback (k-step form): gap to sync +0.010" in text
    assert "runner-up 2bw + no correction" in text and "The two intervals do not overlap." in text
    text = depth_advice(16, ROWS)
    assert "PipeDream's profile at p=16 is not measured (measured p: 8)" in text
    assert depth_advice(1, ROWS).startswith("p=1: one stage")
    alone = depth_advice(4, ROWS[:1])
    assert "the only measurement: 2bw + no correction" in alone and "runner-up" not in alone
    assert "no muon measurement" in depth_advice(8, ROWS, optimizer="muon")
    with pytest.raises(ValueError, match="stages must be a positive number"):
        depth_advice(0, ROWS)


def test_shipped_findings_load_and_plan_prints_them(capsys) -> None:
    findings = load_findings()
    assert findings and all(isinstance(r, DepthRow) and r.seeds >= 1 for r in findings)
    assert plan_main(["--compare", "--forward-ms", "10", "--stages", "4", "--microbatches", "4"]) == 0
    assert "convergence under staleness (measured only):\np=4 (adamw" in capsys.readouterr().out


def test_probe_prints_the_depth_advice(tmp_path, capsys) -> None:
    from lightning_async.tools.probe import probe_main
    from lightning_async.tools.study.runner import synthetic_runner

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: {optimizer: adamw}\n")
    args = ["--config", str(recipe), "--steps", "8", "--output", str(tmp_path / "p")]
    assert probe_main(args + ["--stages", "8"], runner=synthetic_runner) == 0
    assert "\nDepth: p=8 (adamw, docs/results.md, Depth): " in capsys.readouterr().out
    assert probe_main(args + ["--stages", "0"], runner=synthetic_runner) == 2
    assert "--stages must be a positive number of pipeline stages, got 0" in capsys.readouterr().err


def test_a_run_worse_than_sync_at_its_first_validation_gives_a_lower_bound(tmp_path, capsys) -> None:
    fake_study(tmp_path, "2bw", "sync", {0: 2.4})
    fake_study(tmp_path, "pipedream-32", "delayed", {0: 3.2})  # above sync's 3.0 at step 200
    (row,) = depth_rows(collect(tmp_path)[0])
    assert row.slowdown_is_bound and row.slowdown == pytest.approx(3.0)
    assert main([str(tmp_path)]) == 0 and "| >= 3.00x |" in capsys.readouterr().out
