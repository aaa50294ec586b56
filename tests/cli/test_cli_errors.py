"""The ``lightning-async`` command on bad input: one clear ``error:`` line and a non-zero exit, never a
traceback or a silently wrong run; and the ``model`` section taking any LightningModule."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lightning_async.cli import (
    EXIT_BAD_INPUT,
    EXIT_SIGTERM,
    check_sequence_length,
    main,
    run_cli,
    stop_on_sigterm_until_lightning_handles_it,
)
from lightning_async.lm import CausalLM

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "recipes/quickstart.yaml")
PIPELINE = str(REPO / "recipes/pipeline/async.yaml")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> list[str]:
    cache = tmp_path_factory.mktemp("cache")
    return ["--data.max_chars", "400000", "--data.val_batches", "2", "--data.progress", "false",
            "--data.cache_dir", str(cache), "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false"]


def run_main(capsys, *args: str) -> tuple[int, str]:
    try:
        rc = main(list(args))
    except SystemExit as exit_:  # jsonargparse's own parse errors
        rc = exit_.code
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def fit(tmp_path: Path, small_data: list[str], *args: str) -> list[str]:
    return ["fit", "--config", QUICKSTART, "--trainer.max_steps", "2",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *small_data, *args]


# ---- errors raised while building the classes of the config ------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", PIPELINE, "--trainer.strategy.init_args.schedule", "zzz"],
         "AsyncPipelineStrategy: Unknown pipeline schedule 'zzz'. Choose one of: gpipe, 1f1b, zbh1, interleaved, zbv, 2bw, 2bw-split"),
        (["--model.model", "huge"], "CausalLM: Unknown model config 'huge'"),
        (["--data.source", "nowhere"], "TextDataModule: unknown data source 'nowhere'"),
    ],
    ids=["schedule", "model", "data"],
)
def test_constructor_errors_reach_the_user_as_their_own_message(tmp_path, capsys, small_data, args, message):
    rc, output = run_main(capsys, *fit(tmp_path, small_data, *args))
    assert rc == EXIT_BAD_INPUT
    assert f"error: {message}" in output
    assert "Namespace(" not in output and "Traceback" not in output and "Union subtypes" not in output


def test_the_traceback_of_a_constructor_error_on_request(tmp_path, small_data, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ASYNC_TRACEBACK", "1")
    with pytest.raises(ValueError, match="Unknown pipeline schedule 'zzz'") as info:
        main(fit(tmp_path, small_data, "--config", PIPELINE, "--trainer.strategy.init_args.schedule", "zzz"))
    frames = [str(entry.path) for entry in info.traceback]
    assert "lightning_async" in frames[-1] and not frames[-1].endswith("cli.py")  # where the strategy raised it


# ---- checks after the classes are built, before any rank or data -------------------------------
CORRECTIONS = str(REPO / "recipes/corrections")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", PIPELINE, "--config", f"{CORRECTIONS}/weight-prediction.yaml"],
         "The 'weight-prediction' correction changes the weights the forward reads; the 2BW pipeline keeps two"),
        (["--config", str(REPO / "recipes/pipeline/sync.yaml"), "--config", f"{CORRECTIONS}/nesterov.yaml"],
         "The 'nesterov' correction corrects the one-step delay of schedule '2bw', but schedule '1f1b' is synchronous"),
        (["--config", f"{CORRECTIONS}/dc-asgd.yaml"], "DelayCorrection('dc-asgd') needs a delay source"),
        (["--config", str(REPO / "recipes/modes/delayed.yaml"), "--config", f"{CORRECTIONS}/nesterov.yaml",
          "--trainer.callbacks+=lightning_async.callbacks.ErrorFeedback"],  # (a callback beside the correction section)
         "Two staleness corrections are switched on"),
        (["--config", PIPELINE, "--trainer.strategy.init_args.n_microbatches", "1"],
         "schedule '2bw' needs at least as many micro-batches per batch as pipeline stages"),
        (["--config", str(REPO / "recipes/delay/pipedream-4.yaml"), "--delay.stages", "8"],  # tiny: 6 units
         "DelaySimulation (delay profile pipedream-8): Cannot split 6 pipeline units into 8 stages"),
    ],
    ids=["prediction-under-pipeline", "correction-on-1f1b", "no-delay-source", "two-corrections", "microbatches",
         "profile-stages"],
)
def test_refused_settings_stop_before_any_rank_starts(tmp_path, capsys, small_data, args, message):
    rc, output = run_main(capsys, *fit(tmp_path, small_data, *args))
    assert rc == EXIT_BAD_INPUT
    assert f"error: {message}" in output and "Traceback" not in output
    assert not (tmp_path / "runs").exists()  # nothing was trained or logged


# ---- checks of the command line and the recipes ---------------------------------------------------
@pytest.mark.parametrize("flag", ["--model.vocab_size", "--model.init_args.vocab_size"])
def test_setting_the_model_vocabulary_points_to_the_data_module(tmp_path, capsys, small_data, flag):
    rc, output = run_main(capsys, *fit(tmp_path, small_data, flag, "100"))
    assert rc == EXIT_BAD_INPUT
    assert "always comes from the data module" in output and "--data.token_vocab_size" in output
    assert "is not callable" not in output


@pytest.mark.parametrize(
    "text, messages",
    [
        ("model:\n  vocab_size: 100\n", ["error: recipe {recipe} sets the model's vocab_size"]),
        ("model:\n  init_args:\n    vocab_size: 100\n", ["error: recipe {recipe} sets the model's vocab_size"]),
        ("model:\n  lr: [1, 2\n", ["error: recipe {recipe} is not valid YAML", 'in "{recipe}", line 2']),
        ("- a list\n", ["error: recipe {recipe} must be a mapping of sections"]),
    ],
    ids=["vocab", "vocab-init-args", "yaml-syntax", "not-a-mapping"],
)
def test_a_bad_recipe_is_refused_by_name(tmp_path, capsys, small_data, text, messages):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    rc, output = run_main(capsys, *fit(tmp_path, small_data, "--config", str(recipe)))
    assert rc == EXIT_BAD_INPUT
    for message in messages:
        assert message.format(recipe=recipe) in output


def test_seq_len_above_the_models_maximum_is_refused_before_training(tmp_path, capsys, small_data):
    rc, output = run_main(capsys, *fit(tmp_path, small_data, "--data.seq_len", "4096"))
    assert rc == EXIT_BAD_INPUT
    assert "data.seq_len = 4096 is longer than the model's maximum sequence length (CausalLM.max_seq_len = 512)" in output
    assert "--model.model_overrides '{max_seq_len: 4096}'" in output
    assert not (tmp_path / "runs").exists()  # refused before the trainer started


def test_seq_len_up_to_the_maximum_is_accepted():
    class Windows:
        seq_len = 512

    check_sequence_length(CausalLM("tiny", vocab_size=257), Windows())  # tiny: max_seq_len 512
    Windows.seq_len = 4096
    check_sequence_length(CausalLM("tiny", vocab_size=257, model_overrides={"max_seq_len": 4096}), Windows())


@pytest.mark.slow
def test_fit_stopped_by_sigterm_exits_non_zero(tmp_path):
    """Lightning turns SIGTERM into a SystemExit without a code (exit status 0): the CLI returns 143."""
    cmd = [sys.executable, "-m", "lightning_async.cli", "fit", "--config", QUICKSTART, "--trainer.max_steps", "100000",
           "--trainer.val_check_interval", "100000", "--trainer.enable_progress_bar", "false",
           "--data.max_chars", "400000", "--data.val_batches", "2", "--data.progress", "false",
           "--data.cache_dir", str(tmp_path / "cache")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((tmp_path / "runs").rglob("events.out.tfevents.*")):  # written once fit has begun
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr
    assert not list((tmp_path / "runs").rglob("DONE"))  # compare/study must not count it as finished


def test_a_sigterm_before_lightnings_handler_stops_the_cli_and_after_it_is_left_to_lightning():
    """The events file exists before Lightning installs its SIGTERM handler (after the strategy's setup):
    a SIGTERM in that window must still end as 'stopped' (143), not as a silent kill or a finished run."""
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm_until_lightning_handles_it)
    try:
        with pytest.raises(SIGTERMException):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the handler runs between bytecodes; it raises long before this ends
        lightnings_handler = lambda signum, frame: stop_on_sigterm_until_lightning_handles_it(signum, frame)
        signal.signal(signal.SIGTERM, lightnings_handler)  # Lightning's handler calls the previous one too
        os.kill(os.getpid(), signal.SIGTERM)  # ... which must then leave the stop to Lightning: no exception
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- any LightningModule in the model section -----------------------------------------------------------
class BagOfTokens(LightningModule):
    """The smallest model the CLI can train: an embedding and a read-out predicting the next token."""

    def __init__(self, vocab_size: int | None = None, width: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, width)
        self.out = nn.Linear(width, vocab_size)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.out(self.embed(batch[:, :-1]))
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


BAG = f"{BagOfTokens.__module__}.{BagOfTokens.__qualname__}"


def test_the_model_section_takes_any_lightning_module(tmp_path, small_data):
    recipe = tmp_path / "bag.yaml"
    recipe.write_text(f"model:\n  class_path: {BAG}\n  init_args:\n    width: 8\n")
    cli = run_cli(fit(tmp_path, small_data, "--config", str(recipe), "--model.lr", "0.1",
                      "--trainer.limit_val_batches", "0"))
    assert type(cli.model) is BagOfTokens
    assert (cli.model.hparams.vocab_size, cli.model.hparams.width, cli.model.hparams.lr) == (257, 8, 0.1)
    assert cli.model.embed.num_embeddings == 257  # linked from the byte tokenizer
    assert cli.trainer.global_step == 2


@pytest.mark.slow
def test_a_recipe_without_class_path_is_a_causal_lm(tmp_path, small_data):
    cli = run_cli(fit(tmp_path, small_data, "--config", str(REPO / "recipes/optimizers/muon.yaml"),
                      "--model.lr", "1e-3", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"))
    assert type(cli.model) is CausalLM
    hp = cli.model.hparams
    assert (hp.optimizer, hp.lr, hp.vocab_size, hp.optimizer_kwargs["adamw_lr"]) == ("muon", 1e-3, 257, 0.003)
    assert cli.trainer.global_step == 1


def test_a_class_path_given_on_the_command_line(tmp_path, small_data):
    cli = run_cli(fit(tmp_path, small_data, "--model", BAG, "--model.width", "4", "--trainer.max_steps", "1",
                      "--trainer.limit_val_batches", "0"))
    assert type(cli.model) is BagOfTokens and cli.model.hparams.width == 4 and cli.model.hparams.vocab_size == 257


@pytest.mark.slow
def test_fit_prints_no_warning_about_the_args_parameter(tmp_path, small_data, monkeypatch):
    """`main` hands sys.argv[1:] to LightningCLI itself; LightningCLI used to warn about `args` on every fit."""
    monkeypatch.setattr(sys, "argv", ["lightning-async", *fit(tmp_path, small_data, "--trainer.max_steps", "1",
                                                                "--trainer.limit_val_batches", "0")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main() == 0
    assert not [w for w in caught if "args parameter" in str(w.message)]


# ---- probe and plan ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, where",
    [(["--config", PIPELINE], f"recipe {PIPELINE}"),
     (["--set", "trainer.strategy=sync_pipe"], "--set trainer.strategy=sync_pipe")],
    ids=["recipe", "set"],
)
def test_probe_refuses_a_pipeline_recipe(tmp_path, capsys, args, where):
    from lightning_async.tools.probe import probe_main

    rc = probe_main(["--config", QUICKSTART, *args, "--dry-run", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"error: {where} trains with a pipeline strategy (AsyncPipelineStrategy)" in err
    assert "--set trainer.strategy=auto --set trainer.devices=1" in err


def test_probe_accepts_a_pipeline_recipe_switched_back_to_one_device(tmp_path, capsys):
    from lightning_async.tools.probe import probe_main

    rc = probe_main(["--config", QUICKSTART, "--config", PIPELINE, "--set", "trainer.strategy=auto",
                     "--set", "trainer.devices=1", "--dry-run", "--output", str(tmp_path)])
    assert rc == 0
    assert capsys.readouterr().out.count("--trainer.strategy=auto") == 3  # every leg on one device


@pytest.mark.parametrize(
    "args, message",
    [
        (["--forward-ms", "-5"], "--forward-ms must be > 0, got -5"),
        (["--forward-ms", "10", "--backward-ms", "-1"], "--backward-ms must be >= 0, got -1"),
        (["--forward-ms", "10", "--comm-ms", "-0.5"], "--comm-ms must be >= 0, got -0.5"),
        (["--forward-ms", "10", "--update-ms", "-2"], "--update-ms must be >= 0, got -2"),
        (["--forward-ms", "nan"], "--forward-ms must be > 0, got nan"),
        (["--tflops", "-1"], "--tflops must be > 0, got -1"),
        (["--backward-ms", "20"], "--backward-ms needs --forward-ms"),
        (["--forward-ms", "10", "--model", "tiny"], "give either --forward-ms"),
    ],
)
def test_plan_refuses_impossible_costs(capsys, args, message):
    from lightning_async.tools.plan import plan_main

    assert plan_main(args) == 2
    captured = capsys.readouterr()
    assert f"error: {message}" in captured.err
    assert "bubble" not in captured.out  # no table with negative bubbles


def test_plan_json_into_a_missing_directory_creates_it(tmp_path, capsys):
    from lightning_async.tools.plan import plan_main

    target = tmp_path / "plans" / "new" / "plan.json"
    assert plan_main(["--forward-ms", "10", "--stages", "2", "--json", str(target)]) == 0
    assert [(r["p"], r["m"]) for r in json.loads(target.read_text())["rows"]] == [(2, 2), (2, 4), (2, 8)]
    (tmp_path / "taken").write_text("")
    assert plan_main(["--forward-ms", "10", "--json", str(tmp_path / "taken" / "plan.json")]) == 2
    assert "cannot create its directory" in capsys.readouterr().err


def test_simulate_the_name_removed_in_0_2_points_to_plan(capsys):
    """``simulate`` was ``plan``'s old name until 0.2.0: now one error line naming ``plan``, and nothing planned."""
    assert main(["simulate", "--forward-ms", "10", "--stages", "2"]) == EXIT_BAD_INPUT
    removed = capsys.readouterr()
    assert removed.out == ""
    assert removed.err.splitlines() == ["error: `lightning-async simulate` was removed in 0.2.0: use `lightning-async plan` "
                                        "(the same options)"]


# ---- wired in from the fault handling -------------------------------------------------------------
def test_a_pipeline_checkpoint_given_to_a_single_device_fit_is_one_error_line(tmp_path, capsys, small_data):
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.mkdir()
    (checkpoint / "stage-00.ckpt").write_bytes(b"")
    rc, out = run_main(capsys, *fit(tmp_path, small_data, "--ckpt_path", str(checkpoint)))
    assert rc == EXIT_BAD_INPUT, out[-2000:]
    assert "error: " in out and "is a pipeline checkpoint" in out and "strategy=async_pipe" in out, out[-2000:]
    assert "Traceback" not in out


@pytest.mark.parametrize("stop", [True, False], ids=["stops", "keeps-going"])
@pytest.mark.slow
def test_a_diverging_fit_stops_by_default_and_is_marked(tmp_path, capsys, small_data, stop):
    args = fit(tmp_path, small_data, "--model.lr", "1e6", "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1",
               "--divergence.stop", str(stop).lower())
    if stop:
        with pytest.raises(Exception, match=r"Training diverged: train/(loss|grad_norm) = nan at step \d"):
            main(args)
    else:
        assert main(args) == 0
    (marker,) = (tmp_path / "runs").rglob("DIVERGED")
    assert json.loads(marker.read_text())["value"] == "nan"
    assert (marker.parent / "DONE").exists() != stop  # a stopped run never counts as finished


@pytest.mark.parametrize(
    "given, spelled",
    [
        (["--error_feedback.strength", "0.5"],
         "--error_feedback.strength: the error_feedback: section was removed in 0.2.0; write "
         "correction: {method: ef, strength: 0.5} instead (--correction.method ef --correction.strength 0.5"),
        (["--error_feedback.strength=0"], "write correction: {method: none} instead (--correction.method none"),
        (["--error_feedback", "{strength: 2, extrapolate_weight_decay: false}"],
         "write correction: {method: ef, strength: 2, options: {extrapolate_weight_decay: false}} instead"),
        ("error_feedback:\n  strength: 1.0\n",
         "recipe {recipe}: the error_feedback: section was removed in 0.2.0; write correction: {method: ef, strength: 1}"),
        ("fit:\n  error_feedback:\n    extrapolate_weight_decay: true\n",
         "write correction: {method: ef, strength: S, options: {extrapolate_weight_decay: true}}"),
    ],
    ids=["flag", "flag-off", "whole-section-flag", "recipe", "recipe-under-fit"],
)
def test_the_error_feedback_section_removed_in_0_2_names_the_correction_section(tmp_path, capsys, small_data, given,
                                                                                 spelled):
    """``error_feedback:`` (read into ``correction:`` until 0.2.0) is one error line with the new spelling of what was
    given, before anything is built; jsonargparse alone would report an unknown key and say nothing of ``correction:``."""
    recipe = tmp_path / "old.yaml"
    if isinstance(given, str):
        recipe.write_text(given)
        given = ["--config", str(recipe)]
    rc, output = run_main(capsys, *fit(tmp_path, small_data, "--config", str(REPO / "recipes/modes/delayed.yaml"), *given))
    assert rc == EXIT_BAD_INPUT
    (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert spelled.replace("{recipe}", str(recipe)) in line and "Traceback" not in output
    assert not (tmp_path / "runs").exists()


def test_a_recipe_with_callbacks_gets_the_progress_lines_and_a_bar_of_the_users_own_stays(tmp_path, capsys, small_data):
    """Lightning extends the configured callback list with the sections' callbacks and its default bar; before, that
    default bar (the HF recipes configure a checkpoint callback; here a learning-rate monitor) was taken for the user's own and kept, so the run
    showed Lightning's bar ("Epoch 0/-2") instead of the lines."""
    checkpoint = "lightning.pytorch.callbacks.LearningRateMonitor"
    rc, output = run_main(capsys, *fit(tmp_path, small_data, "--trainer.callbacks+", checkpoint,
                                       "--trainer.enable_progress_bar", "true"))
    assert rc == 0, output[-2000:]
    assert "training 2 steps from step 0" in output and "Epoch 0" not in output
    rc, output = run_main(capsys, *fit(tmp_path, small_data, "--trainer.callbacks+", checkpoint, "--trainer.callbacks+",
                                       "lightning.pytorch.callbacks.TQDMProgressBar", "--trainer.enable_progress_bar", "true"))
    assert rc == 0, output[-2000:]
    assert "training 2 steps" not in output and "Epoch 0" in output
