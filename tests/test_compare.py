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
from lightning_async.compare.report import PAPER_REFERENCE, fmt_recovered
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
    for png in ("val_loss_adamw.png", "val_loss_muon.png", "val_loss_grid.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    from lightning_async.compare.layout import read_layout
    from lightning_async.compare.events import read_scalars

    layout = read_layout(out / "tensorboard")
    assert layout is not None
    titles = [c.title for c in layout.category]
    assert "compare: adamw" in titles and "compare: muon" in titles
    chart = layout.category[titles.index("compare: adamw")].chart[0]
    assert chart.multiline.tag == ["^adamw/val_loss/"]
    overlay = read_scalars(out / "tensorboard")
    assert overlay["adamw/val_loss/async+EF/adamw-async_EF-s0"][-1] == (100, pytest.approx(2.640))
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

    anon = write_fake_run(tmp_path / "anon" / "run1", hparams_yaml=False)
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
    write_fake_run(tmp_path / "s", mode="sync", val_loss={10: 3.0, 20: 2.5})
    write_fake_run(tmp_path / "a", mode="delayed", val_loss={10: 3.2, 20: float("nan")})
    result = compare([tmp_path])
    (row,) = result.rows
    assert row.async_.mean != row.async_.mean  # nan, not the last finite 3.2
    assert any("diverged" in w for w in result.warnings)
    assert "nan" in result.table()
