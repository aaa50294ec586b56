"""The sweep tables (tools/sweep_study) on synthetic run folders: gaps paired by seed, the update statistics read
back from the runs, the steps between settings, and the least-squares fit against a known line."""

from __future__ import annotations

import pytest

from lightning_async.compare.synthetic import write_fake_run
from lightning_async.tools.sweep_study import batch_settings, least_squares, main, momentum_settings

SYNC = {0: 2.0, 1: 2.1, 2: 2.2}


def fake(root, folder: str, optimizer: str, mode: str, finals: dict[int, float], cosine: dict[int, float] | None = None):
    for seed, final in finals.items():
        scalars = {"update/cosine": {100: cosine[seed]}} if cosine else None
        write_fake_run(root / folder / "runs" / f"{optimizer}-{mode}-lr0.01-s{seed}", val_loss={50: 3.0, 100: final},
                       scalars=scalars)


def test_least_squares_recovers_a_line_and_its_interval_narrows_with_less_noise() -> None:
    xs = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    exact = least_squares(xs, [1.0 + 2.0 * x for x in xs])
    assert exact.slope == pytest.approx(2.0) and exact.intercept == pytest.approx(1.0) and exact.r_squared == pytest.approx(1.0)
    noisy = least_squares(xs, [1.0 + 2.0 * x + (0.3 if i % 2 else -0.3) for i, x in enumerate(xs)])
    assert noisy.interval.low < 2.0 < noisy.interval.high and noisy.r_squared < 1.0
    flat = least_squares(xs, [1.0 + (0.3 if i % 2 else -0.3) for i in range(6)])
    assert not flat.interval.excludes(0.0)
    assert least_squares([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None and least_squares([1.0, 2.0], [1.0, 2.0]) is None


def test_a_fit_within_groups_reads_the_slope_inside_each_group_not_across_them() -> None:
    """Two settings whose means fall with x (across: negative) while inside each y rises as 5 x (within: +5)."""
    xs = [0.0, 0.1, 0.2, 0.3, 1.0, 1.1, 1.2, 1.3]
    groups = ["a"] * 4 + ["b"] * 4
    noise = [0.01, -0.01, -0.01, 0.01] * 2
    ys = [5 * x - (20.0 if g == "b" else 0.0) + e for x, g, e in zip(xs, groups, noise)]
    across, within = least_squares(xs, ys), least_squares(xs, ys, groups=groups)
    assert across.slope < 0 and across.interval.high < 0
    assert within.slope == pytest.approx(5.0, abs=0.2) and within.interval.low > 4 and within.r_squared > 0.99
    assert least_squares([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], groups=["a", "b", "c"]) is None  # no freedom left


def test_momentum_settings_pair_by_seed_and_read_the_measured_statistics(tmp_path, capsys) -> None:
    for value, gap, cos in ((0.8, 0.3, 0.80), (0.9, 0.2, 0.85), (0.99, 0.1, 0.95)):
        sync_cos = 1.5 - cos  # the sync runs' own statistic falls where the 2BW runs' rises
        fake(tmp_path, f"momentum-adamw-{value}", "adamw", "sync", SYNC, cosine={s: sync_cos + 0.001 * s for s in SYNC})
        fake(tmp_path, f"momentum-adamw-{value}", "adamw", "delayed", {s: v + gap + 0.01 * s for s, v in SYNC.items()},
             cosine={s: cos + 0.001 * s for s in SYNC})
    write_fake_run(tmp_path / "momentum-adamw-0.9" / "runs" / "adamw-delayed-lr0.01-s3", done=False)  # unfinished
    diverged = write_fake_run(tmp_path / "momentum-adamw-0.99" / "runs" / "adamw-delayed-lr0.01-s4")
    (diverged / "DIVERGED").write_text("{}")
    settings = momentum_settings(tmp_path)
    assert [s.value for s in settings] == [0.8, 0.9, 0.99]
    assert settings[0].gaps() == pytest.approx({0: 0.3, 1: 0.31, 2: 0.32})
    assert settings[2].statistic("cosine") == pytest.approx({0: 0.95, 1: 0.951, 2: 0.952})
    assert main(["momentum", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| nano | adamw | 0.8 | 3 | 2.100 ± 0.100 | 2.410 ± 0.110 | +0.310 (" in out
    assert "diverged (left out of the gaps, not a result to average): nano adamw 0.99: adamw-delayed-lr0.01-s4" in out
    assert "| nano | adamw | 0.8 -> 0.9 | 3 | -0.100 (" in out and "| nano | adamw | 0.8 -> 0.99 | 3 | -0.200 (" in out
    on_delayed, on_sync = out.split("its sync run's")
    slopes = [float(next(line for line in part.splitlines() if line.startswith("| adamw | cos(u_t, u_t-1) | 9 |"))
                    .split("|")[4].split()[0]) for part in (on_delayed, on_sync)]
    assert slopes[0] < 0 < slopes[1]  # a larger 2BW cosine, a smaller gap; each fit reads its own runs' statistic


def test_batch_settings_take_nano_16_from_the_family_study_for_the_swept_optimizers(tmp_path, capsys) -> None:
    fake(tmp_path, "batch-nano-64", "adamw", "sync", SYNC)
    fake(tmp_path, "batch-nano-64", "adamw", "delayed", {s: v + 0.4 for s, v in SYNC.items()})
    fake(tmp_path, "family-2bw", "adamw", "sync", SYNC)
    fake(tmp_path, "family-2bw", "adamw", "delayed", {s: v + 0.2 for s, v in SYNC.items()})
    fake(tmp_path, "family-2bw", "soap", "sync", SYNC)  # not swept: left out
    fake(tmp_path, "family-2bw", "soap", "delayed", SYNC)
    settings = batch_settings(tmp_path)
    assert [(s.group, s.optimizer, s.value) for s in settings] == [("nano", "adamw", 16.0), ("nano", "adamw", 64.0)]
    assert main(["batch", str(tmp_path)]) == 0
    assert "| nano | adamw | 16 -> 64 | 3 | +0.200 (" in capsys.readouterr().out
    assert main(["batch", str(tmp_path / "missing")]) == 2
