"""``LIGHTNING_ASYNC_MAX_STEPS`` / ``LIGHTNING_ASYNC_MAX_RUNS``: the one rule that shortens every run a command
starts (what ``tests/cli/test_docs.py`` runs the documentation under)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lightning_async.cli import EXIT_BAD_INPUT, main
from lightning_async.run_limits import (
    MAX_RUNS_VARIABLE,
    MAX_STEPS_VARIABLE,
    first_runs,
    limit_from_environment,
    shorten_trainer_settings,
)
from lightning_async.tools.study import load_study, run_study

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "given, expected",
    [
        ({}, {"max_steps": 3, "val_check_interval": 3, "check_val_every_n_epoch": None, "limit_val_batches": 3,
              "limit_test_batches": 3, "log_every_n_steps": 3}),
        ({"max_steps": 300, "val_check_interval": 100, "check_val_every_n_epoch": None, "limit_val_batches": 8,
          "log_every_n_steps": 10},  # the quick start
         {"max_steps": 3, "val_check_interval": 3, "check_val_every_n_epoch": None, "limit_val_batches": 3,
          "limit_test_batches": 3, "log_every_n_steps": 3}),
        ({"max_steps": 2, "val_check_interval": 1, "check_val_every_n_epoch": 1, "limit_val_batches": 0.25,
          "limit_test_batches": 0, "log_every_n_steps": 1},  # already short: kept; fractions become counts
         {"max_steps": 2, "val_check_interval": 1, "check_val_every_n_epoch": 1, "limit_val_batches": 3,
          "limit_test_batches": 0, "log_every_n_steps": 1}),
        ({"max_steps": -1, "val_check_interval": 0.5, "limit_val_batches": 0},  # epochs; validation switched off
         {"max_steps": 3, "val_check_interval": 3, "check_val_every_n_epoch": None, "limit_val_batches": 0,
          "limit_test_batches": 3, "log_every_n_steps": 3}),
    ],
    ids=["defaults", "quickstart", "already-short", "epochs"],
)
def test_trainer_settings_are_lowered_to_the_cap_and_lightning_accepts_them(given, expected):
    settings = dict(given)
    shorten_trainer_settings(settings, 3)
    assert settings == expected
    trainer = Trainer(**settings, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert trainer.max_steps == settings["max_steps"]


def test_the_limits_come_from_the_environment_and_bad_values_are_refused():
    assert limit_from_environment(MAX_STEPS_VARIABLE, {}) is None
    assert limit_from_environment(MAX_STEPS_VARIABLE, {MAX_STEPS_VARIABLE: " "}) is None
    assert limit_from_environment(MAX_STEPS_VARIABLE, {MAX_STEPS_VARIABLE: "7"}) == 7
    for bad in ("0", "-2", "ten", "1.5"):
        with pytest.raises(ValueError, match=f"{MAX_STEPS_VARIABLE}='{bad}': give a positive number"):
            limit_from_environment(MAX_STEPS_VARIABLE, {MAX_STEPS_VARIABLE: bad})
    assert first_runs("abcde", {}) == (list("abcde"), None)
    assert first_runs("abcde", {MAX_RUNS_VARIABLE: "9"}) == (list("abcde"), None)
    assert first_runs("abcde", {MAX_RUNS_VARIABLE: "2"}) == (
        ["a", "b"], f"{MAX_RUNS_VARIABLE}=2: training the first 2 of 5 runs")


def test_a_bad_limit_is_one_error_line_of_the_cli(capsys, monkeypatch):
    monkeypatch.setenv(MAX_STEPS_VARIABLE, "many")
    assert main(["fit", "--config", "quickstart"]) == EXIT_BAD_INPUT
    assert f"error: {MAX_STEPS_VARIABLE}='many'" in capsys.readouterr().err


def test_a_study_trains_only_its_first_runs(tmp_path, monkeypatch, capsys):
    from test_study import FakeRunner

    study = load_study("quickstart")
    study.output = tmp_path / "study"
    monkeypatch.setenv(MAX_RUNS_VARIABLE, "3")
    runner = FakeRunner()
    result = run_study(study, runner=runner)
    assert runner.calls == ["adamw-sync-s0", "adamw-delayed-s0", "adamw-delayed-ef-s0"]  # seed 0 of the first optimizer
    assert [s.name for s in result.specs] == runner.calls and result.compare_error is None
    assert f"{MAX_RUNS_VARIABLE}=3: training the first 3 of 21 runs" in capsys.readouterr().out
    run_study(study, runner=runner, dry_run=True)
    assert capsys.readouterr().out.count("\n  ") == 21  # the dry run still lists the whole matrix


@pytest.mark.slow
def test_a_fit_trains_the_capped_steps_and_validates_once(tmp_path, monkeypatch):
    from test_cli import SMALL_DATA, read_scalars

    monkeypatch.setenv(MAX_STEPS_VARIABLE, "3")
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", "quickstart", "--trainer.enable_progress_bar", "false", *SMALL_DATA]) == 0
    run_dir = tmp_path / "runs/quickstart/sync-adamw/version_0"
    assert json.loads((run_dir / "DONE").read_text())["global_step"] == 3  # the recipe says 300
    # one validation at the capped end, beside the sanity check's loss of the untrained model (logged at step 0)
    assert len(read_scalars(run_dir, "val/loss")) == 2 and len(read_scalars(run_dir, "train/loss")) >= 1
