"""What ``plan --compare`` and ``probe`` print from the shipped findings of the depth study (tools/depth_advice) and
of the family study (tools/family_advice): one run of each."""

from __future__ import annotations

from lightning_async.tools.plan import plan_main


def test_plan_prints_the_depth_and_the_family_advice(capsys) -> None:
    assert plan_main(["--compare", "--forward-ms", "10", "--stages", "4", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "convergence under staleness (measured only):\np=4 (adamw" in out
    assert "Established: best minus the runner-up -0.230" in out
    assert "quality by schedule, optimizer and correction (measured only):\nschedule x optimizer x correction" in out
    assert "\nadamw alone: smallest gap adamw + paci-4 + no correction" in out


def test_probe_prints_the_depth_advice_and_the_family_advice_for_its_optimizer(tmp_path, capsys) -> None:
    from lightning_async.tools.probe import probe_main
    from lightning_async.tools.study.runner import synthetic_runner

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: {optimizer: adamw}\n")
    args = ["--config", str(recipe), "--steps", "8", "--output", str(tmp_path / "p")]
    assert probe_main(args + ["--stages", "8"], runner=synthetic_runner) == 0
    out = capsys.readouterr().out
    assert "\nDepth: p=8 (adamw, docs/results.md, Depth, at the lrs tuned on nano): " in out and "n=3, paired by seed" in out
    assert "\nSchedules: adamw alone: smallest gap adamw + paci-4 + no correction" in out
    assert "Schedules: muon alone" not in out  # (only the probed optimizer's own ranking)
    assert "Schedules: adamw alone" in (tmp_path / "p" / "compare" / "verdict.md").read_text()
    assert probe_main(args + ["--stages", "0"], runner=synthetic_runner) == 2
    assert "--stages must be a positive number of pipeline stages, got 0" in capsys.readouterr().err
