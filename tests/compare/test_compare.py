"""``lightning-async compare``: numbers in the table against values written into event files."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import yaml

from lightning_async.compare import (
    ASYNC,
    ASYNC_EF,
    SYNC,
    CompareError,
    build_rows,
    compare,
    compare_main,
    find_run_dirs,
    load_run,
    load_runs,
)
from lightning_async.compare.paper import PAPER_REFERENCE
from lightning_async.compare.render import HEADERS, fmt_recovered, table_cells, table_headers
from lightning_async.compare.synthetic import write_fake_run

# final val losses: optimizer -> seed -> (sync, async, async+EF)
FINALS = {
    "adamw": {0: (2.600, 2.900, 2.640), 1: (2.620, 2.880, 2.650), 2: (2.610, 2.910, 2.630)},
    "muon": {0: (2.580, 2.590, 2.584), 1: (2.576, 2.592, 2.580), 2: (2.579, 2.588, 2.585)},
}


def make_study(root: Path, finals=FINALS, modes=(SYNC, ASYNC, ASYNC_EF)) -> Path:
    spec = {SYNC: ("sync", 0.0), ASYNC: ("delayed", 0.0), ASYNC_EF: ("delayed", 1.0)}
    for optimizer, by_seed in finals.items():
        for seed, values in by_seed.items():
            for category, final in zip((SYNC, ASYNC, ASYNC_EF), values):
                if category not in modes:
                    continue
                mode, ef = spec[category]
                name = f"{optimizer}-{category.replace('+', '_')}-s{seed}"
                # an early, worse point first: the table must use the LAST step, not the min or first
                write_fake_run(root / "runs" / name, optimizer=optimizer, mode=mode, ef_strength=ef, seed=seed,
                               lr=1e-3, val_loss={10: 4.0, 50: final + 0.3, 100: final})
    return root / "runs"


def test_table_numbers_match_event_files(tmp_path):
    runs_dir = make_study(tmp_path)
    result = compare([runs_dir])
    assert len(result.runs) == 18
    rows = {row.optimizer: row for row in result.rows}
    assert set(rows) == {"adamw", "muon"}
    for optimizer, by_seed in FINALS.items():
        row = rows[optimizer]
        sync = [v[0] for v in by_seed.values()]
        asyn = [v[1] for v in by_seed.values()]
        ef = [v[2] for v in by_seed.values()]
        assert row.sync.mean == pytest.approx(statistics.fmean(sync), abs=1e-6)
        assert row.async_.mean == pytest.approx(statistics.fmean(asyn), abs=1e-6)
        assert row.async_ef.mean == pytest.approx(statistics.fmean(ef), abs=1e-6)
        assert row.sync.std == pytest.approx(statistics.stdev(sync), abs=1e-6)
        assert row.async_.n == 3 and row.seeds == 3
        gap = statistics.fmean(asyn) - statistics.fmean(sync)
        assert row.gap == pytest.approx(gap, abs=1e-6)
        assert row.gap_pct == pytest.approx(100 * gap / statistics.fmean(sync), abs=1e-4)
        share = (statistics.fmean(asyn) - statistics.fmean(ef)) / gap
        assert row.recovered == pytest.approx(share, abs=1e-4)
        per_seed = [(a - e) / (a - s) for s, a, e in by_seed.values()]
        assert row.recovered_seeds.mean == pytest.approx(statistics.fmean(per_seed), abs=1e-4)
        assert row.recovered_seeds.std == pytest.approx(statistics.stdev(per_seed), abs=1e-4)
        assert row.recovered_seeds.min == pytest.approx(min(per_seed), abs=1e-4)
        per_seed_gap = [a - s for s, a, _ in by_seed.values()]
        assert row.gap_seeds.std == pytest.approx(statistics.stdev(per_seed_gap), abs=1e-5)
    table = result.table()
    assert "adamw" in table and "muon" in table
    assert f"{statistics.fmean([2.6, 2.62, 2.61]):.3f} ± " in table
    assert f"{100 * rows['adamw'].recovered:.0f}%" in table


def test_single_seed_reader_reads_last_step_and_identity(tmp_path):
    run = write_fake_run(tmp_path / "r", optimizer="soap", mode="async_pipe", ef_strength=0.5, delay=1, seed=7,
                         lr=3e-3, val_loss={5: 3.0, 15: 2.25, 10: 2.0})
    loaded = load_run(run)
    assert loaded.final_val_loss == pytest.approx(2.25)
    assert loaded.identity.optimizer == "soap" and loaded.identity.mode == "async_pipe"
    assert loaded.identity.category == ASYNC_EF and loaded.identity.seed == 7
    assert loaded.identity.lr == pytest.approx(3e-3) and loaded.done
    assert [s for s, _ in loaded.series("val/loss")] == [5, 10, 15]
    assert {"train/loss", "train/tokens", "val/loss_by_tokens"} <= set(loaded.scalars)


def test_reader_keeps_every_point(tmp_path):
    """EventAccumulator's default reservoir keeps 10k scalars per tag: size_guidance must disable that."""
    points = {s: 5.0 - s * 1e-4 for s in range(0, 12_000)}
    run = write_fake_run(tmp_path / "long", val_loss=points, train_loss={0: 1.0})
    loaded = load_run(run)
    assert len(loaded.series("val/loss")) == 12_000
    assert loaded.final_val_loss == pytest.approx(points[11_999], abs=1e-6)


def test_written_outputs(tmp_path):
    runs_dir = make_study(tmp_path)
    out = tmp_path / "report"
    rc = compare_main([str(runs_dir), "--output", str(out), "--paper"])
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "### adamw" in report and "### muon" in report and "## Runs" in report and "## Commands" in report
    assert "adamw-async_EF-s2" in report  # run list
    assert "2.890" in report and "Paper reference" in report  # paper numbers side by side
    for png in ("val_loss_adamw.png", "val_loss_muon.png", "val_loss_grid.png", "train_loss_adamw.png", "train_loss_grid.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    from lightning_async.compare.layout import read_layout
    from lightning_async.compare.events import read_scalars

    layout = read_layout(out / "tensorboard")
    assert layout is not None
    titles = [c.title for c in layout.category]
    assert "compare: adamw" in titles and "compare: muon" in titles
    charts = layout.category[titles.index("compare: adamw")].chart
    assert [chart.multiline.tag[0] for chart in charts] == ["^adamw/val_loss$", "^adamw/train_loss$"]
    assert "original tags" not in " ".join(titles)  # only the compared runs are in this logdir
    series = sorted(p.name for p in (out / "tensorboard").iterdir() if p.is_dir())
    assert series == sorted(f"{c}-s{seed}" for c in ("sync", "async", "async+EF") for seed in (0, 1, 2))
    overlay = read_scalars(out / "tensorboard" / "async+EF-s0")
    original = read_scalars(runs_dir / "adamw-async_EF-s0")
    assert overlay["adamw/val_loss"] == original["val/loss"] and overlay["adamw/val_loss"][-1] == (100, pytest.approx(2.640))
    assert overlay["adamw/train_loss"] == original["train/loss"] and len(overlay["adamw/train_loss"]) > 1
    # the report dir is not mistaken for a run when comparing a parent of both
    assert len(compare([tmp_path]).runs) == 18


def test_paper_reference_values():
    assert PAPER_REFERENCE["adamw"] == (2.612, 2.890, 2.640)
    assert PAPER_REFERENCE["muon"] == (2.578, 2.590, 2.583)
    assert PAPER_REFERENCE["soap"] == (2.581, 2.608, 2.590)
    assert PAPER_REFERENCE["adan"][:2] == (2.641, 2.651)


def test_hparams_plugin_fallback(tmp_path):
    """No hparams.yaml: identity comes from the TensorBoard hparams plugin, as Lightning writes it (nested)."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    run = tmp_path / "exp" / "muon-delayed"
    writer = SummaryWriter(str(run))
    params = {"model/optimizer": "muon", "model/mode": "delayed", "model/ef_strength": 1.0, "model/delay": 1,
              "seed": 3, "model/lr": 0.02}
    exp, ssi, sei = hparams(params, {"hp_metric": -1})
    fw = writer._get_file_writer()
    for summary in (exp, ssi, sei):
        fw.add_summary(summary)
    writer.add_scalar("val/loss", 3.5, 10)
    writer.close()
    assert not (run / "hparams.yaml").exists()
    ident = load_run(run).identity
    assert (ident.optimizer, ident.mode, ident.ef_strength, ident.delay, ident.seed, ident.lr) == (
        "muon", "delayed", 1.0, 1, 3, pytest.approx(0.02))


def test_nested_hparams_yaml(tmp_path):
    run = write_fake_run(tmp_path / "n", hparams_yaml=False)
    (run / "hparams.yaml").write_text(yaml.safe_dump({"model": {"optimizer": "lion", "lr": 1e-4},
                                                      "mode": "sync", "seed": 1}))
    ident = load_run(run).identity
    assert (ident.optimizer, ident.mode, ident.seed) == ("lion", "sync", 1)


def test_bad_inputs(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    with pytest.raises(CompareError, match="no TensorBoard event files"):
        find_run_dirs([empty])
    assert compare_main([str(empty)]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err
    assert compare_main([str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err

    write_fake_run(tmp_path / "anon" / "run1", hparams_yaml=False)
    with pytest.raises(CompareError, match=r"anon/run1.*missing optimizer, mode"):
        load_runs([tmp_path / "anon"])
    assert compare_main([str(tmp_path / "anon")]) == 2
    assert "run1" in capsys.readouterr().err

    bad_mode = write_fake_run(tmp_path / "badmode" / "r", mode="sync")
    (bad_mode / "hparams.yaml").write_text(yaml.safe_dump({"optimizer": "adamw", "mode": "turbo"}))
    with pytest.raises(CompareError, match="unknown mode 'turbo'"):
        load_run(bad_mode)

    only_sync = make_study(tmp_path / "onlysync", modes=(SYNC,))
    assert compare_main([str(only_sync)]) == 2
    err = capsys.readouterr().err
    assert "cannot build a gap table" in err and "adamw: sync" in err

    # one invalid run next to good ones: fatal by default, skipped with --skip-invalid
    mixed = make_study(tmp_path / "mixed")
    write_fake_run(mixed / "zz-anon", hparams_yaml=False)
    assert compare_main([str(mixed)]) == 2
    assert compare_main([str(mixed), "--skip-invalid"]) == 0
    assert "skipping" in capsys.readouterr().err


def test_missing_mode_and_zero_gap_are_na(tmp_path):
    finals = {"adan": {0: (2.641, 2.651, None)}, "lion": {0: (2.5, 2.5, 2.49)}}
    for optimizer, by_seed in finals.items():
        for seed, (s, a, e) in by_seed.items():
            write_fake_run(tmp_path / f"{optimizer}-sync", optimizer=optimizer, mode="sync", seed=seed,
                           val_loss={10: s})
            write_fake_run(tmp_path / f"{optimizer}-async", optimizer=optimizer, mode="delayed", seed=seed,
                           val_loss={10: a})
            if e is not None:
                write_fake_run(tmp_path / f"{optimizer}-ef", optimizer=optimizer, mode="delayed", ef_strength=1,
                               seed=seed, val_loss={10: e})
    result = compare([tmp_path])
    rows = {r.optimizer: r for r in result.rows}
    assert rows["adan"].gap == pytest.approx(0.010, abs=1e-6)
    assert rows["adan"].recovered is None and fmt_recovered(rows["adan"]) == "n/a"
    assert rows["lion"].gap_is_zero and rows["lion"].recovered is None
    assert fmt_recovered(rows["lion"]) == "n/a (gap ~0)"
    assert any("adan: no finished runs with val/loss for async+EF" in w for w in result.warnings)


def test_a_gap_within_seed_noise_gets_no_recovered_share(tmp_path):
    """Lion-like: per-seed gaps of both signs (mean +0.01, std ~0.09): the share of that is noise, n/a.
    AdamW-like: a clear gap keeps its share; its per-seed shares count only seeds whose own gap is positive."""
    finals = {
        "lion": {0: (2.00, 2.11, 2.12), 1: (2.10, 2.00, 2.02), 2: (2.05, 2.07, 2.08)},
        "adamw": {0: (1.60, 1.90, 1.70), 1: (1.62, 1.88, 1.75), 2: (1.61, 1.89, 1.72)},
    }
    for optimizer, by_seed in finals.items():
        for seed, (s, a, e) in by_seed.items():
            for mode, ef, loss in (("sync", 0, s), ("delayed", 0, a), ("delayed", 1, e)):
                write_fake_run(tmp_path / f"{optimizer}-{mode}-{ef}-s{seed}", optimizer=optimizer, mode=mode,
                               ef_strength=ef, seed=seed, val_loss={10: loss})
    rows = {r.optimizer: r for r in compare([tmp_path]).rows}
    lion, adamw = rows["lion"], rows["adamw"]
    assert lion.gap == pytest.approx(0.01, abs=1e-6) and lion.gap_within_noise
    assert lion.recovered is None and fmt_recovered(lion).startswith("n/a (gap within seed noise: 95% CI -0.2")
    assert lion.recovered_seeds.n == 2  # seed 1's gap is negative: its "share" is left out
    assert not adamw.gap_within_noise
    assert adamw.recovered == pytest.approx((1.89 - 1.7233333) / (1.89 - 1.61), abs=1e-6)
    assert fmt_recovered(adamw).startswith("60% (95% CI ") and fmt_recovered(adamw).endswith(", n=3)")


def test_groups_by_lr_and_ef_strength(tmp_path):
    for lr, s, a in ((1e-3, 2.7, 2.9), (3e-3, 2.6, 2.95)):
        write_fake_run(tmp_path / f"s{lr}", optimizer="adamw", mode="sync", lr=lr, val_loss={10: s})
        write_fake_run(tmp_path / f"a{lr}", optimizer="adamw", mode="delayed", lr=lr, val_loss={10: a})
        for ef, e in ((0.5, a - 0.1), (1.0, a - 0.2)):
            write_fake_run(tmp_path / f"e{lr}-{ef}", optimizer="adamw", mode="delayed", ef_strength=ef, lr=lr,
                           val_loss={10: e})
    rows = build_rows(load_runs([tmp_path]))
    assert [r.label for r in rows] == ["adamw lr=0.001 EF=0.5", "adamw lr=0.001 EF=1",
                                       "adamw lr=0.003 EF=0.5", "adamw lr=0.003 EF=1"]
    by_label = {r.label: r for r in rows}
    assert by_label["adamw lr=0.001 EF=1"].recovered == pytest.approx(0.2 / 0.2, abs=1e-5)
    assert by_label["adamw lr=0.003 EF=0.5"].recovered == pytest.approx(0.1 / 0.35, abs=1e-5)
    assert by_label["adamw lr=0.003 EF=0.5"].gap == pytest.approx(0.35, abs=1e-6)


def test_diverged_run_is_not_hidden(tmp_path):
    """A non-finite val/loss marks the run DIVERGED: not averaged, not replaced by its last finite 3.2."""
    write_fake_run(tmp_path / "s", mode="sync", val_loss={10: 3.0, 20: 2.5})
    write_fake_run(tmp_path / "a", mode="delayed", val_loss={10: 3.2, 20: float("nan")})
    result = compare([tmp_path])
    (row,) = result.rows
    assert row.async_ is None and row.gap is None  # never used as a result (neither nan nor 3.2)
    assert [r.name for r in row.diverged_runs(ASYNC)] == ["a"]
    assert any("a: diverged at step 20 (train/loss = nan)" in w for w in result.warnings)
    table = result.table()
    assert "DIVERGED at step 20" in table and "n/a (async diverged)" in table


def write_diverged_study(root: Path) -> Path:
    """adamw, two seeds: sync fine; async diverged twice (a marker without DONE; a NaN train/loss without
    a marker); async+EF fine for seed 0 and diverged for seed 1 (a marker next to DONE: --keep-going)."""
    for seed, final in ((0, 2.60), (1, 2.62)):
        write_fake_run(root / f"sync-s{seed}", mode="sync", seed=seed, val_loss={10: 3.0, 20: final})
    stopped = write_fake_run(root / "async-s0", mode="delayed", seed=0, val_loss={5: 3.4}, done=False)
    (stopped / "DIVERGED").write_text('{"step": 7, "metric": "train/grad_norm", "value": "inf"}')  # as the guard
    write_fake_run(root / "async-s1", mode="delayed", seed=1, val_loss={10: 3.1, 20: 2.9},
                   train_loss={10: 3.0, 15: float("nan"), 20: float("nan")})
    write_fake_run(root / "ef-s0", mode="delayed", ef_strength=1.0, seed=0, val_loss={10: 3.0, 20: 2.65})
    kept_going = write_fake_run(root / "ef-s1", mode="delayed", ef_strength=1.0, seed=1,
                                val_loss={10: 3.0, 20: 2.10})
    (kept_going / "DIVERGED").write_text('{"step": 12, "metric": "train/loss", "value": NaN}')
    return root


def test_diverged_runs_marked_and_left_out(tmp_path):
    root = write_diverged_study(tmp_path / "runs")
    out = tmp_path / "report"
    result = compare([root], out, plots=False)
    (row,) = result.rows
    assert row.async_ is None and row.gap is None
    assert row.async_ef.values == [pytest.approx(2.65)]  # ef-s1 (2.10 at step 20) is not used
    assert row.step == 20  # the stopped run's lone point at step 5 does not pull the row back
    assert row.sync.values == [pytest.approx(2.60), pytest.approx(2.62)]
    cells = dict(zip(HEADERS, table_cells([row])[0]))
    assert cells["async"] == "DIVERGED (n=2)"
    assert cells["async+EF"] == "2.650, 1 DIVERGED"
    assert cells["gap (async-sync)"] == "n/a (async diverged)" and cells["EF recovered"] == "n/a (async diverged)"
    assert not any("no DONE file" in w for w in result.warnings)  # a guard-stopped run is a result, not a crash
    assert sum("marked DIVERGED in the table" in w for w in result.warnings) == 3
    report = (out / "report.md").read_text()
    assert "DIVERGED (n=2)" in report
    assert "diverged at step 7 (train/grad_norm = inf)" in report  # the run list's status column
    assert "diverged at step 15 (train/loss = nan)" in report

    marker = load_run(root / "async-s0").divergence
    assert (marker.step, marker.metric, marker.value, marker.source) == (7, "train/grad_norm", float("inf"),
                                                                          "DIVERGED")
    curve = load_run(root / "async-s1").divergence
    assert (curve.step, curve.metric, curve.source) == (15, "train/loss", "loss curve")
    assert load_run(root / "sync-s0").divergence is None


def test_duplicate_runs_prefer_the_finished_one(tmp_path):
    """An interrupted rerun of the same optimizer/mode/seed used to replace the finished run silently."""
    write_fake_run(tmp_path / "adamw-sync", mode="sync", seed=0, val_loss={10: 3.0, 20: 2.5})
    write_fake_run(tmp_path / "adamw-delayed", mode="delayed", seed=0, val_loss={10: 3.1, 20: 2.9})
    write_fake_run(tmp_path / "zz-adamw-delayed-rerun", mode="delayed", seed=0, val_loss={10: 2.0}, done=False)
    result = compare([tmp_path])
    (row,) = result.rows
    assert row.async_.values == [pytest.approx(2.9)] and row.step == 20
    assert row.gap == pytest.approx(0.4, abs=1e-6)
    assert sorted(r.name for r in result.runs) == ["adamw-delayed", "adamw-sync"]
    (warning,) = [w for w in result.warnings if "ignoring the unfinished" in w]
    assert "adamw async (lr 0.001, seed 0, delay 1)" in warning
    assert str(tmp_path / "adamw-delayed") in warning and "zz-adamw-delayed-rerun" in warning


def test_two_finished_duplicates_are_refused(tmp_path, capsys):
    write_fake_run(tmp_path / "a" / "adamw-sync", mode="sync", seed=0, val_loss={10: 2.5})
    write_fake_run(tmp_path / "a" / "adamw-delayed", mode="delayed", seed=0, val_loss={10: 2.9})
    write_fake_run(tmp_path / "b" / "adamw-delayed", mode="delayed", seed=0, val_loss={10: 2.7})
    with pytest.raises(CompareError, match=r"2 finished runs fill the same slot of the table, adamw async .*seed 0"):
        compare([tmp_path])
    assert compare_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "a" / "adamw-delayed") in err and str(tmp_path / "b" / "adamw-delayed") in err
    assert "pass only the one you mean" in err
    # two unfinished attempts and no finished one: refused too
    for name in ("x", "y"):
        write_fake_run(tmp_path / "c" / name, mode="delayed", seed=3, val_loss={10: 2.9}, done=False)
    write_fake_run(tmp_path / "c" / "sync", mode="sync", seed=3, val_loss={10: 2.5})
    with pytest.raises(CompareError, match=r"2 unfinished \(none finished\) runs fill the same slot"):
        compare([tmp_path / "c"])
    # a pipeline sync run and a single-device sync run of one seed would also share a slot
    write_fake_run(tmp_path / "d" / "sync", mode="sync", seed=0, val_loss={10: 2.5})
    write_fake_run(tmp_path / "d" / "sync-pipe", mode="sync_pipe", seed=0, val_loss={10: 2.6})
    write_fake_run(tmp_path / "d" / "async", mode="delayed", seed=0, val_loss={10: 2.9})
    with pytest.raises(CompareError, match=r"one device, sync, done.*pipeline, sync, done"):
        compare([tmp_path / "d"])


def test_runs_of_different_lengths_compared_at_a_common_step(tmp_path):
    """A 20-step sync run against a 40-step async run: compared at step 20, not at each one's end
    (at the ends, async 2.5 < sync 2.8 looked better). Steps as Lightning files them (the validation after step 20
    at TensorBoard step 19); compare reports the runs' own steps."""
    write_fake_run(tmp_path / "sync", mode="sync", val_loss={9: 3.0, 19: 2.8})
    write_fake_run(tmp_path / "async", mode="delayed", val_loss={9: 3.1, 19: 2.9, 29: 2.7, 39: 2.5})
    out = tmp_path / "report"
    result = compare([tmp_path / "sync", tmp_path / "async"], out, plots=False)
    (row,) = result.rows
    assert row.gap == pytest.approx(0.1, abs=1e-6)
    assert (row.step, row.optimizer_step) == (19, 20)
    assert ("adamw: runs end at different steps (sync 20, async 40); compared at step 20, the last step at which "
            "every run of the row logged val/loss") in result.warnings
    cells = dict(zip(table_headers(()), table_cells(result.rows)[0]))
    assert cells["step"] == "20" and cells["async"] == "2.900"
    report = (out / "report.md").read_text()
    assert "| adamw | 20 | 2.800 | 2.900 |" in report and "runs end at different steps" in report
    last_steps = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[9] for line in report.splitlines()
                  if line.startswith(("| sync |", "| async |"))}
    assert last_steps == {"sync": "20", "async": "40"}  # the run list's last step: the run's, as the table's

    # different validation intervals (20 steps every 4, 40 steps every 8): the last shared step is 16
    other = tmp_path / "intervals"
    write_fake_run(other / "sync", mode="sync", val_loss={s - 1: 3.0 - s / 100 for s in (4, 8, 12, 16, 20)})
    write_fake_run(other / "async", mode="delayed", val_loss={s - 1: 3.1 - s / 100 for s in (8, 16, 24, 32, 40)})
    (row,) = compare([other]).rows
    assert row.gap == pytest.approx(0.1, abs=1e-6) and row.optimizer_step == 16

    # no shared step at all: n/a with a warning saying how to fix it
    none = tmp_path / "disjoint"
    write_fake_run(none / "sync", mode="sync", val_loss={4: 3.0})
    write_fake_run(none / "async", mode="delayed", val_loss={6: 3.1})
    result = compare([none])
    assert result.rows[0].step is None and result.rows[0].gap is None
    assert any("share no step with a val/loss (last steps: sync 5, async 7)" in w for w in result.warnings)


def test_runs_of_equal_length_give_no_length_warning(tmp_path):
    runs_dir = make_study(tmp_path)
    result = compare([runs_dir])
    assert all(row.step == 100 for row in result.rows)
    assert not any("different steps" in w for w in result.warnings)


# ---- corrections other than EF ----------------------------------------------------------------
def write_corrections_study(root: Path, finals: dict[str, dict[int, float]], optimizer: str = "adamw") -> Path:
    """Runs of one optimizer: category -> seed -> final val loss (``sync``, ``async``, ``ef``, ``nesterov``...)."""
    for name, by_seed in finals.items():
        for seed, final in by_seed.items():
            kwargs = {"sync": dict(mode="sync"), "async": dict(mode="delayed")}.get(
                name, dict(mode="delayed", correction=name, correction_strength=1.0))
            write_fake_run(root / f"{optimizer}-{name}-s{seed}", optimizer=optimizer, seed=seed,
                           val_loss={10: final + 1.0, 20: final}, **kwargs)
    return root


def test_old_hparams_without_the_new_keys_are_read(tmp_path):
    """A run directory written before corrections existed: no correction, correction_strength, delay_profile."""
    run = write_fake_run(tmp_path / "old-ef", hparams_yaml=False)
    (run / "hparams.yaml").write_text(yaml.safe_dump({"optimizer": "adamw", "mode": "delayed", "ef_strength": 0.5,
                                                      "delay": 1, "seed": 2, "lr": 0.001}))
    ident = load_run(run).identity
    assert (ident.correction, ident.correction_strength, ident.delay_profile) == ("ef", 0.5, "uniform")
    assert ident.category == ASYNC_EF
    bad = write_fake_run(tmp_path / "typo", hparams_yaml=False)
    (bad / "hparams.yaml").write_text(yaml.safe_dump({"optimizer": "adamw", "mode": "delayed", "correction": "nag"}))
    with pytest.raises(CompareError, match=r"typo: unknown correction 'nag'; expected one of none, ef"):
        load_run(bad)


def test_write_fake_run_records_the_correction(tmp_path):
    run = write_fake_run(tmp_path / "r", mode="async_pipe", correction="dc-asgd", correction_strength=0.5,
                         delay_profile="pipedream-4")
    record = yaml.safe_load((run / "hparams.yaml").read_text())
    assert (record["correction"], record["correction_strength"], record["ef_strength"]) == ("dc-asgd", 0.5, 0.0)
    assert record["delay_profile"] == "pipedream-4" and load_run(run).category == "async+dc-asgd"
    old_style = yaml.safe_load((write_fake_run(tmp_path / "e", mode="delayed", ef_strength=1.0) / "hparams.yaml")
                               .read_text())
    assert (old_style["correction"], old_style["correction_strength"]) == ("ef", 1.0)


def test_runs_differing_only_in_correction_fill_different_slots(tmp_path):
    """Before: compare ignored the correction, so a nesterov run was filed as plain async (and, next to the async
    run of its seed, refused as a duplicate)."""
    from lightning_async.compare.selection import slot

    root = write_corrections_study(tmp_path, {"sync": {0: 2.0}, "async": {0: 2.4}, "nesterov": {0: 2.1},
                                              "dc-asgd": {0: 2.3}})
    runs = load_runs([root])
    assert len({slot(r) for r in runs}) == 4
    (row,) = compare([root]).rows
    assert [r.name for r in row.runs["async+nesterov"]] == ["adamw-nesterov-s0"]
    assert [r.name for r in row.runs[ASYNC]] == ["adamw-async-s0"]
    # the same correction at two strengths, or under two delay profiles: never one slot either
    write_fake_run(tmp_path / "adamw-nesterov-half", mode="delayed", correction="nesterov", correction_strength=0.5,
                   val_loss={20: 2.2})
    write_fake_run(tmp_path / "adamw-async-pd", mode="delayed", delay_profile="pipedream-4", val_loss={20: 2.5})
    result = compare([tmp_path])
    assert len(result.runs) == 6
    assert sorted(r.label for r in result.rows) == [
        "adamw profile=pipedream-4 nesterov=0.5", "adamw profile=pipedream-4 nesterov=1",
        "adamw profile=uniform nesterov=0.5", "adamw profile=uniform nesterov=1"]
    by_label = {r.label: r for r in result.rows}
    assert by_label["adamw profile=uniform nesterov=0.5"].recovered_by("nesterov") == pytest.approx(0.5, abs=1e-5)
    assert by_label["adamw profile=pipedream-4 nesterov=1"].gap == pytest.approx(0.5, abs=1e-5)
    # two finished runs of one correction, strength and seed are still refused, and the message names it
    write_fake_run(tmp_path / "again" / "adamw-nesterov-s0", mode="delayed", correction="nesterov", val_loss={20: 2.0})
    with pytest.raises(CompareError, match=r"adamw async\+nesterov \(lr 0.001, seed 0, delay 1, nesterov 1\)"):
        compare([root, tmp_path / "again"])


def test_recovered_share_of_each_correction(tmp_path):
    """sync 2.0, async 2.4: nesterov 2.1 recovers 75%, EF 2.2 50%, dc-asgd 2.5 -25% (it hurts)."""
    root = write_corrections_study(tmp_path, {"sync": {0: 2.0}, "async": {0: 2.4}, "ef": {0: 2.2},
                                              "nesterov": {0: 2.1}, "dc-asgd": {0: 2.5}})
    (row,) = compare([root]).rows
    assert row.corrections == ("ef", "nesterov", "dc-asgd")
    assert row.recovered_by("nesterov") == pytest.approx(0.75, abs=1e-5)
    assert row.recovered_by("ef") == pytest.approx(0.5, abs=1e-5) == pytest.approx(row.recovered, abs=1e-9)
    assert row.recovered_by("dc-asgd") == pytest.approx(-0.25, abs=1e-5)
    assert row.recovered_by("weight-prediction") is None
    cells = dict(zip(table_headers(row.corrections), table_cells([row])[0]))
    one_seed = "(n=1, no interval)"
    assert (cells["EF recovered"], cells["nesterov recovered"], cells["dc-asgd recovered"]) == (
        f"50% {one_seed}", f"75% {one_seed}", f"-25% {one_seed}")
    assert cells["gap (async-sync)"] == f"+0.400 (+20.0%) {one_seed}"
    assert cells["async+nesterov"] == "2.100" and cells["async+EF"] == "2.200"


def test_recovered_share_spread_over_two_seeds(tmp_path):
    finals = {"sync": {0: 2.0, 1: 2.1}, "async": {0: 2.4, 1: 2.5}, "nesterov": {0: 2.1, 1: 2.25}}
    (row,) = compare([write_corrections_study(tmp_path, finals)]).rows
    per_seed = [(2.4 - 2.1) / 0.4, (2.5 - 2.25) / 0.4]  # 75%, 62.5%
    shares = row.recovered_seeds_by("nesterov")
    assert shares.n == 2 and shares.mean == pytest.approx(statistics.fmean(per_seed), abs=1e-5)
    assert shares.std == pytest.approx(statistics.stdev(per_seed), abs=1e-5)
    assert row.recovered_by("nesterov") == pytest.approx((2.45 - 2.175) / 0.4, abs=1e-5)  # on the means: 69%
    # Fieller with a constant gap (0.4 in both seeds) is the t interval of the mean won back over 0.4:
    # 0.6875 +- t(0.975, 1) * sd([0.3, 0.25]) / sqrt(2) / 0.4 = 0.6875 +- 12.706 * 0.025 / 0.4 = [-0.107, 1.482]
    assert fmt_recovered(row, "nesterov") == "69% (95% CI -11% to 148%, n=2)"
    assert fmt_recovered(row) == "n/a"  # no EF runs: the EF column stays, as n/a


def test_best_correction_per_optimizer(tmp_path):
    """The correction whose column shows the highest share: nesterov for adamw, EF for muon."""
    from lightning_async.compare import best_corrections

    write_corrections_study(tmp_path, {"sync": {0: 2.0, 1: 2.0}, "async": {0: 2.4, 1: 2.4},
                                       "ef": {0: 2.2, 1: 2.3}, "nesterov": {0: 2.1, 1: 2.0}})
    write_corrections_study(tmp_path, {"sync": {0: 2.5}, "async": {0: 2.6}, "ef": {0: 2.52}, "dc-asgd": {0: 2.55}},
                            optimizer="muon")
    write_corrections_study(tmp_path, {"sync": {0: 2.5}, "async": {0: 2.6}}, optimizer="lion")
    best = best_corrections(compare([tmp_path]).rows)
    assert set(best) == {"adamw", "muon"}  # lion ran no correction
    adamw = best["adamw"]
    assert (adamw.correction, adamw.n, adamw.row) == ("nesterov", 2, "adamw")
    assert adamw.mean == pytest.approx((2.4 - 2.05) / 0.4, abs=1e-5)  # 87.5%, as the nesterov column shows it
    assert adamw.std == pytest.approx(statistics.stdev([0.75, 1.0]), abs=1e-5)
    muon = best["muon"]
    assert (muon.correction, muon.n, muon.std) == ("ef", 1, None) and muon.mean == pytest.approx(0.8, abs=1e-4)


def test_report_plots_and_layout_show_the_corrections(tmp_path, capsys):
    root = write_corrections_study(tmp_path / "runs", {"sync": {0: 2.0, 1: 2.02}, "async": {0: 2.4, 1: 2.42},
                                                       "ef": {0: 2.2, 1: 2.21}, "nesterov": {0: 2.1, 1: 2.12},
                                                       "weight-prediction": {0: 2.3, 1: 2.31}})
    out = tmp_path / "report"
    assert compare_main([str(root), "--output", str(out), "--paper"]) == 0
    printed = capsys.readouterr().out
    assert "async+nesterov" in printed and "weight-prediction recovered" in printed and "EF recovered" in printed
    report = (out / "report.md").read_text()
    assert report.startswith("# Sync vs async vs async+EF vs async+nesterov vs async+weight-prediction")
    header = ("| run group | step | sync | async | async+EF | async+nesterov | async+weight-prediction | "
              "gap (async-sync) | EF recovered | nesterov recovered | weight-prediction recovered |")
    assert report.count(header) == 2  # the adamw block (with the paper's adamw line) and the paper block
    paper = "| adamw (paper, 360M) | end | 2.612 | 2.890 | 2.640 | n/a | n/a | +0.278 (+10.6%) | 90% | n/a | n/a |"
    assert paper in report
    assert "nesterov recovered" in report and "| nesterov 1 |" in report  # the run list's correction column
    png = (out / "val_loss_adamw.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    from lightning_async.compare.events import read_scalars
    from lightning_async.compare.layout import read_layout

    chart = read_layout(out / "tensorboard").category[0].chart[0]
    assert chart.title == "adamw: val/loss, sync vs async vs async+EF vs async+nesterov vs async+weight-prediction"
    overlay = read_scalars(out / "tensorboard" / "async+nesterov-s1")
    assert overlay["adamw/val_loss"][-1] == (20, pytest.approx(2.12))


# ---- the example of docs/compare.md ------------------------------------------------------------
#: docs/compare.md's example: category -> final val loss of seeds 0, 1, 2
EXAMPLE_FINALS = {"sync": (2.596, 2.624, 2.610), "async": (2.866, 2.914, 2.890), "ef": (2.638, 2.652, 2.645),
                  "nesterov": (2.690, 2.700, 2.695)}


def test_the_example_table_of_compare_md_is_what_compare_prints(tmp_path):
    """docs/compare.md ("Reading the table") shows the table of three synthetic seeds validated at TensorBoard steps 99
    and 199, as the quick-start study's 200-step runs are: its lines are exactly what ``compare`` prints for them
    (step 200: the runs' own count of the step TensorBoard files at 199)."""
    from _doc_blocks import REPO, read_blocks

    for category, finals in EXAMPLE_FINALS.items():
        mode = {"sync": dict(mode="sync"), "async": dict(mode="delayed")}.get(
            category, dict(mode="delayed", correction=category, correction_strength=1.0))
        for seed, final in enumerate(finals):
            write_fake_run(tmp_path / f"adamw-{category}-s{seed}", seed=seed, val_loss={99: final + 0.3, 199: final},
                           **mode)
    printed = [line.rstrip() for line in compare([tmp_path]).table().splitlines()]
    doc = REPO / "docs/compare.md"
    heading = doc.read_text().splitlines().index("### Reading the table") + 1
    example = next(block for block in read_blocks(doc) if block.line > heading)
    assert example.text.splitlines() == printed


# ---- the common case: two runs, sync and async, one seed each -------------------------------------
def test_two_runs_give_sync_async_and_the_gap_only(tmp_path, monkeypatch, capsys):
    """The README's pipeline pair (300 steps, validated every 100, filed by Lightning at 99/199/299): no async+EF
    column or warning, the runs' own last step, no interval paragraph, a TensorBoard folder of the two series only;
    and without matplotlib (the plots extra) the table and report still come, with one line saying how to get PNGs."""
    from lightning_async.compare.events import EVENT_PREFIX
    from lightning_async.compare.layout import read_layout

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    write_fake_run(tmp_path / "1f1b-sync-adamw", mode="sync_pipe", schedule="1f1b", val_loss={99: 3.0, 199: 2.5, 299: 2.24})
    write_fake_run(tmp_path / "2bw-async-adamw", mode="async_pipe", schedule="2bw", delay=1,
                   val_loss={99: 3.3, 199: 3.2, 299: 3.13})
    out = tmp_path / "compare-pipeline"
    assert compare_main([str(tmp_path / "2bw-async-adamw"), str(tmp_path / "1f1b-sync-adamw"), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    table = captured.out.split("\n\n")[1].splitlines()
    assert table[1].split() == ["run", "group", "step", "sync", "async", "gap", "(async-sync)"]
    assert table[3].split()[:4] == ["adamw", "300", "2.240", "3.130"]
    assert "async+EF" not in captured.out + captured.err and "EF recovered" not in captured.out
    assert 'plots:  no PNG curves: matplotlib is not installed (pip install -e ".[plots]" adds them)' in captured.out
    assert not list(out.glob("*.png"))
    report = (out / "report.md").read_text()
    assert report.startswith("# Sync vs async\n") and "Fieller" not in report and "Student t" not in report
    assert "async+EF" not in report and "## Warnings" not in report
    assert 'matplotlib is not installed (pip install -e ".[plots]" adds them)' in report
    # the run list in the words of the logs and folders: the schedule and the mode, not the recorded sync_pipe
    assert "| run | optimizer | schedule | mode | lr |" in report and "_pipe" not in report
    assert "| 2bw-async-adamw | adamw | 2bw | async | 0.001 | 1 | uniform | none | 0 | 300 | 3.1300 |" in report
    assert "| 1f1b-sync-adamw | adamw | 1f1b | sync | 0.001 | 0 | uniform | none | 0 | 300 | 2.2400 |" in report
    # TensorBoard's run list: the two series, no run named "." (the layout lives in the first series' folder)
    tensorboard = out / "tensorboard"
    assert sorted(p.name for p in tensorboard.iterdir()) == ["async", "sync"]
    assert not any(p.name.startswith(EVENT_PREFIX) for p in tensorboard.iterdir())
    assert [c.title for c in read_layout(tensorboard).category] == ["compare: adamw"]


def test_runs_written_by_0_1_read_with_their_schedule_when_their_config_names_it(tmp_path):
    """0.1 recorded no ``schedule`` (and its folders were ``2bw-adamw``): the recorded ``mode`` still reads, and the
    schedule comes from the run's ``config.yaml`` (the strategy's ``schedule``); without one it reads ``pipeline``."""
    for name, mode, schedule in (("1f1b-adamw", "sync_pipe", "gpipe"), ("2bw-adamw", "async_pipe", None)):
        run = write_fake_run(tmp_path / name, mode=mode, delay=int(mode == "async_pipe"), val_loss={10: 2.5})
        record = yaml.safe_load((run / "hparams.yaml").read_text())
        del record["schedule"]
        (run / "hparams.yaml").write_text(yaml.safe_dump(record))
        if schedule:
            (run / "config.yaml").write_text(yaml.safe_dump(
                {"trainer": {"strategy": {"class_path": "lightning_async.strategies.AsyncPipelineStrategy",
                                          "init_args": {"schedule": schedule}}}}))
    result = compare([tmp_path / "2bw-adamw", tmp_path / "1f1b-adamw"], tmp_path / "out", plots=False)
    assert {r.name: (r.identity.mode, r.identity.schedule_name, r.category) for r in result.runs} == {
        "1f1b-adamw": ("sync_pipe", "gpipe", "sync"), "2bw-adamw": ("async_pipe", "pipeline", "async")}
    report = result.report.read_text()
    assert "| 1f1b-adamw | adamw | gpipe | sync |" in report and "| 2bw-adamw | adamw | pipeline | async |" in report


def test_the_interval_paragraph_comes_with_seeds(tmp_path):
    result = compare([make_study(tmp_path)], tmp_path / "report", plots=False)
    report = result.report.read_text()
    assert report.startswith("# Sync vs async vs async+EF\n")
    assert "Fieller's 95% interval" in report and "95% Student t interval" in report
