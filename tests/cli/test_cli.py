"""The ``lightning-async`` command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow  # the tests here start processes or run the CLI (README.md, Tests)

REPO = Path(__file__).resolve().parents[2]
SMALL_DATA = ["--data.max_chars", "400000", "--data.val_batches", "2", "--data.progress", "false"]


def run_cli(tmp_path: Path, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    cmd = [sys.executable, "-m", "lightning_async.cli", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


INVOCATIONS = """
import contextlib, io, json, sys
import lightning_async.cli as cli

results = {}
for name, args in json.loads(sys.argv[1]).items():
    sys.argv = [cli.__file__, *args]  # as `python -m lightning_async.cli ARGS` sees itself
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    results[name] = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(results))
"""


def run_cli_invocations(tmp_path: Path, commands: dict[str, list[str]], env: dict | None = None) -> dict[str, dict]:
    """Several ``lightning-async`` invocations that end before training (errors, help) in one process: each calls the
    console script's ``main`` with its arguments and captured output (one import of the CLI instead of one each)."""
    import json

    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run([sys.executable, "-c", INVOCATIONS, json.dumps(commands)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def read_scalars(run_dir: Path, tag: str) -> list[float]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [event.value for event in acc.Scalars(tag)]


def test_quickstart_fit_writes_tensorboard_and_lowers_the_loss(tmp_path):
    proc = run_cli(
        tmp_path, "fit", "--config", str(REPO / "recipes/quickstart.yaml"), "--trainer.max_steps", "40",
        "--trainer.val_check_interval", "20", "--trainer.log_every_n_steps", "5", "--trainer.enable_progress_bar", "false",
        "--data.cache_dir", str(tmp_path / "cache"), *SMALL_DATA,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs" / "quickstart").iterdir()] == ["sync-adamw"]  # the folder says what it is
    run_dir = tmp_path / "runs" / "quickstart" / "sync-adamw" / "version_0"
    assert list(run_dir.glob("events.out.tfevents.*")) and (run_dir / "config.yaml").exists() and (run_dir / "DONE").exists()
    train = read_scalars(run_dir, "train/loss")
    assert train[-1] < train[0] - 1.0, train
    assert len(read_scalars(run_dir, "val/loss")) == 3  # the untrained model (step 0, the sanity check), steps 20 and 40
    identity = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert (identity["optimizer"], identity["mode"], identity["delay"], identity["ef_strength"]) == ("adamw", "sync", 0, 0.0)


def test_recipes_compose_into_a_delayed_ef_muon_run(tmp_path):
    proc = run_cli(
        tmp_path, "fit", "--config", str(REPO / "recipes/quickstart.yaml"), "--config", str(REPO / "recipes/optimizers/muon.yaml"),
        "--config", str(REPO / "recipes/modes/delayed-ef.yaml"), "--trainer.max_steps", "6", "--trainer.val_check_interval", "6",
        "--trainer.enable_progress_bar", "false", "--data.cache_dir", str(tmp_path / "cache"), *SMALL_DATA,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "quickstart" / "delayed-ef-muon" / "version_0"
    identity = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert (identity["optimizer"], identity["mode"], identity["delay"], identity["ef_strength"]) == ("muon", "delayed", 1, 1.0)


CONSOLE_SCRIPT_REPORTING_EXIT = """
import atexit, os, sys

import torch.distributed as dist


def report() -> None:  # registered first, so it runs after every exit handler registered later
    rank = os.environ.get('LOCAL_RANK', '0')
    print(f"rank {rank}: process group alive at exit: {dist.is_initialized()}", flush=True)
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(f"rank {rank}: gloo threads alive at exit: {sum(name.startswith(('pt_gloo', 'gloo')) for name in threads)}", flush=True)


atexit.register(report)
from lightning_async.cli import main

sys.exit(main())
"""


def test_real_pipeline_from_the_cli(tmp_path):
    """Two processes through Lightning's own launcher: the console script is re-executed for rank 1 (here a copy of
    it that reports, as its very last act, whether a process group is still alive).

    Exit: before, Lightning left the groups open after fit, and gloo threads outliving them into interpreter
    shutdown aborted a rank now and then after a successful run ("terminate called without an active exception",
    SIGABRT). Every rank now destroys its groups at exit (before the fix both ranks reported ``True``), and frees them:
    ``destroy_process_group`` only shuts a group down, and while the trainer (which the CLI keeps until exit) still
    referenced the pipeline's groups, gloo's threads lived on into interpreter finalization and the abort stayed
    rare rather than gone (before that fix each rank reported 8 to 10 gloo threads alive here)."""
    script = tmp_path / "lightning-async"
    script.write_text(CONSOLE_SCRIPT_REPORTING_EXIT)
    args = ["fit", "--config", str(REPO / "recipes/quickstart.yaml"), "--config", str(REPO / "recipes/pipeline/async.yaml"),
            "--trainer.max_steps", "6", "--trainer.val_check_interval", "6", "--trainer.enable_progress_bar", "false",
            "--data.cache_dir", str(tmp_path / "cache"), *SMALL_DATA]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "quickstart" / "2bw-async-adamw" / "version_0"  # schedule, mode, optimizer
    identity = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    assert (identity["mode"], identity["schedule"]) == ("async_pipe", "2bw")
    printed = proc.stdout + proc.stderr  # the logs say what the folder says: schedule and mode, not "async_pipe"
    assert "pipeline: schedule=2bw, mode=async, stages=2" in printed and "pipeline memory, stage 1:" in printed
    assert "async_pipe" not in printed
    assert len(read_scalars(run_dir, "val/loss")) == 2  # the untrained model (the sanity check, step 0) and the end
    assert "terminate called" not in proc.stderr
    for rank in (0, 1):
        assert f"rank {rank}: process group alive at exit: False" in proc.stdout, proc.stdout[-2000:]
        assert f"rank {rank}: gloo threads alive at exit: 0" in proc.stdout, proc.stdout[-2000:]


BAD_INPUTS = {
    "huge": (["--model.model", "huge"], "Unknown model config 'huge'"),
    "sgdx": (["--model.optimizer", "sgdx"], "Unknown optimizer 'sgdx'"),
    "nowhere": (["--data.source", "nowhere"], "nowhere"),
    "ef-without-delay": (["--correction.method", "ef"], "DelayCorrection('ef') needs a delay source"),
    "error-feedback-section-removed": (["--error_feedback.strength", "1.0"],
                                       "section was removed in 0.2.0; write correction: {method: ef, strength: 1}"),
    "unknown-key": (["--trainer.no_such_key", "1"], "no_such_key"),
}


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bad-input")
    base = ["fit", "--config", str(REPO / "recipes/quickstart.yaml"), "--trainer.max_steps", "2",
            "--data.cache_dir", str(tmp_path / "cache"), *SMALL_DATA]
    return run_cli_invocations(tmp_path, {name: [*base, *args] for name, (args, _) in BAD_INPUTS.items()})


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_stops_with_a_clear_message(bad_input_runs, case):
    """Exit status 2 with an ``error:`` line, no traceback (before: an unknown optimizer surfaced as a traceback from
    ``configure_optimizers``, after the data was prepared)."""
    run, message = bad_input_runs[case], BAD_INPUTS[case][1]
    assert run["returncode"] == 2, run["stderr"][-2000:]
    assert message in run["stderr"] and "Traceback" not in run["stderr"]


def test_tools_run_from_any_directory(tmp_path):
    """study, probe, plan, recipes, compare and export by their module paths in TOOLS (and ``simulate``, removed in
    0.2.0, refused naming ``plan``)."""
    runs = run_cli_invocations(tmp_path, {
        "study": ["study", "--config", "quickstart", "--dry-run"], "probe": ["probe", "--config", "quickstart", "--dry-run"],
        "plan": ["plan", "--forward-ms", "10", "--stages", "2"], "simulate": ["simulate", "--forward-ms", "10", "--stages", "2"],
        "recipes": ["recipes"], "compare": ["compare", "nothing-here"], "export": ["export", "--help"],
    })
    codes = {name: run["returncode"] for name, run in runs.items()}
    assert codes == {"study": 0, "probe": 0, "plan": 0, "simulate": 2, "recipes": 0, "compare": 2, "export": 0}, runs
    assert "study quickstart: 21 runs -> studies/quickstart" in runs["study"]["stdout"]
    assert not any("not found" in run["stdout"] for run in runs.values())
    assert "use `lightning-async plan`" in runs["simulate"]["stderr"] and runs["simulate"]["stdout"] == ""
    assert not (tmp_path / "studies").exists()


def test_plan_without_arguments_prints_a_nominal_plan_of_the_135m_shape(capsys):
    from lightning_async.tools.plan import plan_main

    assert plan_main([]) == 0
    out = capsys.readouterr().out
    assert "nominal costs, nothing measured: smollm2-135m, seq 2048 x micro-batch 1, bfloat16, FLOP counts at 100 TFLOP/s" in out
    rows = [line.split("|")[1:3] for line in out.splitlines() if line.startswith("| ") and "recommendation" not in line]
    assert [(int(p), int(m)) for p, m in rows] == [(p, k * p) for p in (4, 8, 16) for k in (1, 2, 4)]
    assert "skipped p=32: 30 layers cannot fill 32 stages" in out


def test_nominal_costs_count_flops_and_parameters_exactly():
    from lightning_async.lm import CausalLM
    from lightning_async.pipeline.measure import measure_model
    from lightning_async.tools.stage_costs import nominal_model

    nominal = nominal_model("tiny", 64, micro_batch_size=2, dtype="float32", tflops=1.0)
    model = CausalLM("tiny", vocab_size=257)
    block, head = nominal["units"]["block"], nominal["units"]["head"]
    assert block["params"] == sum(p.numel() for p in model.model.blocks[0].parameters())
    assert block["forward_s"] == pytest.approx(128 * (2 * block["params"] + 4 * 64 * 128) / 1e12)
    assert block["backward_s"] == pytest.approx(2 * block["forward_s"])
    assert head["forward_s"] == pytest.approx(128 * 2 * head["params"] / 1e12)
    # the activation estimate of a block is within 20% of what autograd saves
    measured = measure_model("tiny", 64, 2, "cpu", "float32", reps=1)["units"]["block"]["activation_bytes"]
    assert 0.8 * measured < block["activation_bytes"] < 1.2 * measured


@pytest.mark.slow
def test_top_level_help_lists_every_command_and_leaves_theirs_alone(tmp_path):
    """Before: `lightning-async --help` listed fit, validate, test and predict only, two descriptions cut mid-sentence,
    and took 7-10 s (it imported torch and Lightning)."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_async.cli import TOOL_SUMMARIES, TOOLS, TRAINING_SUMMARIES

    assert set(TOOL_SUMMARIES) == set(TOOLS)
    assert list(TRAINING_SUMMARIES) == list(LightningCLI.subcommands())
    runs = run_cli_invocations(tmp_path, {"top": ["--help"], "own": ["test", "--help"], "none": []}, env={"COLUMNS": "80"})
    top, own = runs["top"], runs["own"]
    assert top["returncode"] == 0, top["stderr"][-2000:]
    usage = top["stdout"].split("\n\n")[0]
    assert usage.replace("\n", " ").split() == ["usage:", "lightning-async", "[-h]", "{" + ",".join([*TRAINING_SUMMARIES, *TOOL_SUMMARIES]) + "}", "..."]
    for command, summary in {**TRAINING_SUMMARIES, **TOOL_SUMMARIES}.items():
        assert f"\n  {command:<10}{summary}\n" in top["stdout"]  # one line each, whole
    assert max(len(line) for line in top["stdout"].splitlines()) <= 80
    assert runs["none"]["returncode"] == 2 and runs["none"]["stderr"].startswith("error: give a command: fit, validate")
    assert own["returncode"] == 0 and own["stdout"].startswith("usage: cli.py [options] test")
    assert "more commands" not in own["stdout"] and "make sure you never run on your\n" in own["stdout"]  # LightningCLI's own


def test_the_top_level_help_imports_neither_torch_nor_lightning(tmp_path):
    """`lightning-async --help` through the console script's own name: the package skips its torch imports for it."""
    script = ("import sys; sys.argv = ['/venv/bin/lightning-async', '--help']\n"
              "from lightning_async.cli import main\n"
              "assert main() == 0\n"
              "heavy = sorted(m for m in ('torch', 'lightning', 'jsonargparse') if m in sys.modules)\n"
              "print('imported:', heavy)\n"
              "import lightning_async\n"
              "print('export:', lightning_async.AsyncPipelineStrategy.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported: []" in proc.stdout and "export: AsyncPipelineStrategy" in proc.stdout, proc.stdout
