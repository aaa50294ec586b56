"""``lightning-async study`` and ``probe``: matrix, skip/resume, validation, verdicts, and one real run."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from lightning_async.compare import ASYNC, ASYNC_EF, SYNC, Row, load_runs
from lightning_async.compare.synthetic import write_fake_run
from lightning_async.optim import OPTIMIZER_NAMES
from lightning_async.tools.probe import probe_main, verdict
from lightning_async.tools.study import (
    MODES,
    RunSpec,
    StudyError,
    load_study,
    pid_alive,
    run_env,
    run_study,
    study_from_dict,
    study_main,
    subprocess_runner,
)

REPO = Path(__file__).resolve().parents[2]

# final val loss the fake runner writes: sync 2.6 + seed effect; async + gap; EF recovers 75%
GAPS = {"adamw": 0.28, "muon": 0.012, "lion": 0.02}


def fake_final(spec: RunSpec) -> float:
    base = 2.6 + 0.003 * (spec.seed or 0)
    if spec.mode == "sync":
        return base
    gap = GAPS[spec.optimizer or "adamw"]
    return base + (gap * 0.25 if spec.mode == "delayed-ef" else gap)


class FakeRunner:
    """Writes a run dir that follows the run conventions; can be told to fail or be interrupted."""

    def __init__(self, interrupt_at: int | None = None, fail: set[str] | None = None,
                 diverge: dict[str, str] | None = None):
        self.calls: list[str] = []
        self.commands: list[list[str]] = []
        self.locks: list[dict] = []
        self.interrupt_at = interrupt_at
        self.fail = fail or set()
        self.diverge = diverge or {}  # run name -> "guard" (stopped by DivergenceGuard) | "no-guard" (NaN, exit 0)

    def __call__(self, spec: RunSpec) -> int:
        self.calls.append(spec.name)
        self.commands.append(spec.command)
        self.locks.append(json.loads(spec.lock_path.read_text()))
        final = fake_final(spec)
        kwargs = dict(optimizer=spec.optimizer or "adamw", mode=spec.logged_mode,
                      ef_strength=1.0 if spec.uses_ef else 0.0, seed=spec.seed, lr=spec.lr,
                      val_loss={5: final + 1.0, 10: final})
        if self.diverge.get(spec.name) == "guard":  # what DivergenceGuard leaves: a marker, no DONE, exit 1
            write_fake_run(spec.run_dir, done=False, **{**kwargs, "val_loss": {}}, train_loss={1: 9.0, 2: 1e30})
            (spec.run_dir / "DIVERGED").write_text('{"step": 3, "metric": "train/loss", "value": NaN}')
            return 1
        if self.diverge.get(spec.name) == "no-guard":  # NaN from step 6 on, trained to the end, DONE, exit 0
            write_fake_run(spec.run_dir, **{**kwargs, "val_loss": {5: final, 10: float("nan")}},
                           train_loss={5: final, 6: float("nan"), 10: float("nan")})
            return 0
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            write_fake_run(spec.run_dir, done=False, **kwargs)  # half-written, then Ctrl-C
            raise KeyboardInterrupt
        if spec.name in self.fail:
            write_fake_run(spec.run_dir, done=False, **kwargs)
            return 1
        write_fake_run(spec.run_dir, **kwargs)
        return 0


def write_study(tmp_path: Path, **fields) -> Path:
    data = {"name": "t", "base": ["base.yaml"], "optimizers": ["adamw", "muon"],
            "modes": ["sync", "delayed", "delayed-ef"], "seeds": [0, 1], "max_steps": 10,
            "output": str(tmp_path / "out"), "launcher": ["lightning-async"]}
    data.update(fields)
    (tmp_path / "base.yaml").write_text("trainer: {}\n")
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_matrix_names_and_commands(tmp_path):
    study = load_study(write_study(tmp_path, lrs={"adamw": [1e-3, 3e-3]}))
    specs = study.expand()
    assert len(specs) == 2 * (2 + 1) * 3  # seeds x (adamw 2 lrs + muon) x modes
    names = [s.name for s in specs]
    assert names[:3] == ["adamw-sync-lr0.001-s0", "adamw-delayed-lr0.001-s0", "adamw-delayed-ef-lr0.001-s0"]
    assert "muon-delayed-ef-s1" in names and len(set(names)) == len(names)
    spec = specs[1]
    cmd = spec.command
    assert cmd[:2] == ["lightning-async", "fit"]
    assert cmd[cmd.index("--seed_everything") + 1] == "0"
    assert cmd[cmd.index("--model.optimizer") + 1] == "adamw"
    assert cmd[cmd.index("--model.lr") + 1] == "0.001"
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "10"
    assert cmd[cmd.index("--trainer.logger.init_args.version") + 1] == spec.name
    assert cmd[cmd.index("--trainer.logger.init_args.name") + 1] == "runs"
    configs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]
    assert configs[0].endswith("base.yaml") and configs[-1].endswith("modes/delayed.yaml")
    assert spec.run_dir == tmp_path / "out" / "runs" / spec.name


def test_rejects_unknown_optimizer_mode_and_keys(tmp_path, capsys):
    runner = FakeRunner()
    assert study_main(["--config", str(write_study(tmp_path, optimizers=["adamw", "sgdx"]))], runner=runner) == 2
    err = capsys.readouterr().err
    assert "unknown optimizer(s) sgdx" in err and all(o in err for o in OPTIMIZER_NAMES)
    assert study_main(["--config", str(write_study(tmp_path, modes=["sync", "fast"]))], runner=runner) == 2
    err = capsys.readouterr().err
    assert "unknown mode(s) fast" in err and all(m in err for m in MODES)
    with pytest.raises(StudyError, match="unknown study key"):
        study_from_dict({"optimizers": ["adamw"], "modez": ["sync"]})
    with pytest.raises(StudyError, match="not in optimizers"):
        study_from_dict({"optimizers": ["adamw"], "lrs": {"muon": 0.02}})
    assert study_main(["--config", str(tmp_path / "nope.yaml")], runner=runner) == 2
    assert runner.calls == []  # nothing ran


def test_resume_after_interruption(tmp_path):
    path = write_study(tmp_path)
    total = 2 * 2 * 3
    first = FakeRunner(interrupt_at=5)
    assert study_main(["--config", str(path), "--no-compare"], runner=first) == 130
    assert len(first.calls) == 5
    half = tmp_path / "out" / "runs" / first.calls[-1]
    assert half.exists() and not (half / "DONE").exists()

    second = FakeRunner()
    assert study_main(["--config", str(path)], runner=second) == 0
    # only the missing runs ran: the interrupted one again, then the rest; none of the four finished ones
    assert second.calls[0] == first.calls[-1]
    assert len(second.calls) == total - 4
    assert not set(second.calls) & set(first.calls[:4])
    # a third run does nothing
    third = FakeRunner()
    assert study_main(["--config", str(path)], runner=third) == 0
    assert third.calls == []
    # the compare at the end saw every run and its numbers
    report = (tmp_path / "out" / "compare" / "report.md").read_text()
    assert "### adamw" in report and "### muon" in report
    runs = load_runs([tmp_path / "out" / "runs"])
    assert len(runs) == total and all(r.done for r in runs)


def test_changed_arguments_rerun_and_failures_retry(tmp_path, capsys):
    path = write_study(tmp_path, optimizers=["adamw"], seeds=[0])
    fail = FakeRunner(fail={"adamw-delayed-s0"})
    assert study_main(["--config", str(path)], runner=fail) == 1
    assert "1 run(s) failed: adamw-delayed-s0" in capsys.readouterr().out
    retry = FakeRunner()
    assert study_main(["--config", str(path)], runner=retry) == 0
    assert retry.calls == ["adamw-delayed-s0"]
    # a different max_steps makes the finished runs stale: all rerun
    longer = FakeRunner()
    assert study_main(["--config", str(path), "--max-steps", "20"], runner=longer) == 0
    assert len(longer.calls) == 3
    assert "finished with different arguments" in capsys.readouterr().out


def test_dry_run_set_and_data_override(tmp_path, capsys):
    override = tmp_path / "gutenberg.yaml"
    override.write_text("data: {source: text}\n")
    path = write_study(tmp_path, optimizers=["lion"], overrides={"data.seq_len": 64})
    runner = FakeRunner()
    rc = study_main(["--config", str(path), "--dry-run", "--data-override", str(override),
                     "--set", "data.path=corpus.txt"], runner=runner)
    assert rc == 0 and runner.calls == []
    out = capsys.readouterr().out
    assert "[6/6] lion-delayed-ef-s1 (todo)" in out
    line = [x for x in out.splitlines() if "lion-sync-s0" in x and "fit" in x][0]
    cmd = shlex.split(line.strip())
    configs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]
    assert configs[-1] == str(override)
    assert cmd[-2:] == ["--data.seq_len=64", "--data.path=corpus.txt"]
    assert not (tmp_path / "out" / "runs").exists()
    assert study_main(["--config", str(path), "--set", "nokey"], runner=runner) == 2


def test_lr_override_replaces_one_optimizers_lrs(tmp_path, capsys):
    path = write_study(tmp_path, lrs={"adamw": [1e-2], "muon": [7e-3]}, seeds=[0], modes=["sync"])
    runner = FakeRunner()
    assert study_main(["--config", str(path), "--dry-run", "--lr", "adamw=3e-2,0.1"], runner=runner) == 0
    names = re.findall(r"\] (\S+) \(todo\)", capsys.readouterr().out)
    assert names == ["adamw-sync-lr0.03-s0", "adamw-sync-lr0.1-s0", "muon-sync-lr0.007-s0"]
    for bad, message in (("sgd=0.1", "one of the study's optimizers"), ("adamw=fast", "not a comma-separated list"),
                         ("adamw=-1", "must be positive"), ("adamw", "not a comma-separated list")):
        assert study_main(["--config", str(path), "--dry-run", "--lr", bad], runner=runner) == 2
        assert message in capsys.readouterr().err, bad
    assert runner.calls == []


def test_modes_option_runs_a_subset_of_the_modes(tmp_path, capsys):
    path = write_study(tmp_path, optimizers=["adamw"], seeds=[0])
    runner = FakeRunner()
    assert study_main(["--config", str(path), "--dry-run", "--modes", "delayed", "sync"], runner=runner) == 0
    assert re.findall(r"\] (\S+) \(todo\)", capsys.readouterr().out) == ["adamw-sync-s0", "adamw-delayed-s0"]
    assert study_main(["--config", str(path), "--dry-run", "--modes", "async"], runner=runner) == 2
    assert "--modes async: not in the study's modes ['sync', 'delayed', 'delayed-ef']" in capsys.readouterr().err


def test_ablation_keys(tmp_path):
    study = load_study(write_study(tmp_path, optimizers=["adamw"], seeds=[0], modes=["sync", "delayed-ef"],
                                   ef_strengths=[0.5, 1.0], delays=[1, 2]))
    names = [s.name for s in study.expand()]
    assert names == ["adamw-sync-s0", "adamw-delayed-ef-d1-ef0.5-s0", "adamw-delayed-ef-d1-ef1-s0",
                     "adamw-delayed-ef-d2-ef0.5-s0", "adamw-delayed-ef-d2-ef1-s0"]
    cmd = study.expand()[2].command
    assert cmd[cmd.index("--correction.strength") + 1] == "1" and cmd[cmd.index("--delay.delay") + 1] == "1"


#: every shipped study file: those with a ``name`` (the rest of study/ are fit configs and data overrides they compose)
SHIPPED_STUDIES = sorted(
    p.relative_to(REPO / "recipes" / "study").with_suffix("").as_posix()
    for p in (REPO / "recipes" / "study").rglob("*.yaml")
    if re.search(r"^name:", p.read_text(), re.MULTILINE)
)


@pytest.mark.parametrize("name", SHIPPED_STUDIES)
def test_shipped_studies_parse(name, monkeypatch):
    monkeypatch.chdir(REPO)
    study = load_study(REPO / "recipes" / "study" / f"{name}.yaml")
    specs = study.expand()
    assert specs and all(s.command[s.command.index("fit") - 1] for s in specs)
    assert len({s.name for s in specs}) == len(specs)  # no two runs share a folder
    for config in (c for s in specs for i, c in enumerate(s.command) if s.command[i - 1] == "--config"):
        assert Path(config).is_file(), f"{name}: --config {config} is not a shipped file"
    if name == "quickstart":
        paper_optimizers = set(OPTIMIZER_NAMES) - {"asyncpp", "basis_rotation"}  # the paper's seven (not AsyncPP, Jung et al.)
        assert sorted(study.optimizers) == sorted(paper_optimizers) and len(specs) == 21
        assert study.output == Path("studies/quickstart")


def test_fake_study_end_to_end(tmp_path, capsys):
    """``--fake`` rehearses a whole study: runs written, compared, the gap table printed."""
    path = write_study(tmp_path, optimizers=["adamw", "mars"], seeds=[0])
    assert study_main(["--config", str(path), "--fake"]) == 0
    out = capsys.readouterr().out
    assert "adamw" in out and "75%" in out  # synthetic EF recovers 75%


def test_diverged_runs_are_reported_and_not_retried(tmp_path, capsys):
    path = write_study(tmp_path, optimizers=["adamw"], seeds=[0])
    runner = FakeRunner(diverge={"adamw-delayed-s0": "guard", "adamw-delayed-ef-s0": "no-guard"})
    assert study_main(["--config", str(path)], runner=runner) == 0  # diverging is a result, not a failure
    out = capsys.readouterr().out
    assert "adamw-delayed-s0: DIVERGED at step 3 (train/loss = nan), exit 1 in" in out  # not "FAILED (exit 1)"
    assert "adamw-delayed-ef-s0: DIVERGED at step 6 (train/loss = nan) in" in out  # not "ok"
    assert "adamw-sync-s0: ok in" in out
    assert "2 run(s) diverged: adamw-delayed-s0, adamw-delayed-ef-s0" in out and "failed" not in out
    marker = json.loads((tmp_path / "out" / "runs" / "adamw-delayed-ef-s0" / "DIVERGED").read_text())
    assert marker == {"step": 6, "metric": "train/loss", "value": "nan", "source": "loss curve"}
    # the gap table marks both, and uses neither
    report = (tmp_path / "out" / "compare" / "report.md").read_text()
    assert "| adamw | 11 | 2.600 | DIVERGED at step 3 | DIVERGED at step 6 | n/a (async diverged) |" in report
    # a rerun keeps them (diverging again would teach nothing) and says so
    again = FakeRunner()
    assert study_main(["--config", str(path), "--no-compare"], runner=again) == 0
    assert again.calls == []
    assert "[2/3] adamw-delayed-s0: diverged, skipped" in capsys.readouterr().out


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_run_lock_refuses_a_live_run_and_takes_over_a_stale_one(tmp_path, capsys):
    path = write_study(tmp_path, optimizers=["adamw"], modes=["sync"], seeds=[0])
    run_dir = tmp_path / "out" / "runs" / "adamw-sync-s0"
    lock = run_dir.with_name("adamw-sync-s0.lock")
    run_dir.mkdir(parents=True)
    (run_dir / "events.out.tfevents.partial").write_text("")  # being written by the process holding the lock
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(json.dumps({"pid": _dead_pid(), "child_pid": sleeper.pid, "host": socket.gethostname(),
                                    "since": "earlier"}))
        runner = FakeRunner()
        assert study_main(["--config", str(path)], runner=runner) == 2
        err = capsys.readouterr().err
        assert "run adamw-sync-s0 is still in progress (pid" in err and f"child pid {sleeper.pid}" in err
        assert f"stop it (kill {sleeper.pid}), then rerun" in err and str(lock) in err
        assert runner.calls == [] and (run_dir / "events.out.tfevents.partial").exists()  # nothing deleted
        assert study_main(["--config", str(path), "--dry-run"], runner=runner) == 0
        assert "adamw-sync-s0 (in progress: pid" in capsys.readouterr().out
    finally:
        sleeper.kill()
        sleeper.wait()
    # a lock taken on another machine cannot be checked: refused too
    lock.write_text(json.dumps({"pid": os.getpid(), "host": "some-other-node", "since": "earlier"}))
    assert study_main(["--config", str(path)], runner=runner) == 2
    assert "on host some-other-node (cannot be checked from here)" in capsys.readouterr().err
    # the holder is gone: the lock is taken over, with a message, and the run trains under this study's pid
    lock.write_text(json.dumps({"pid": _dead_pid(), "child_pid": sleeper.pid, "host": socket.gethostname()}))
    assert study_main(["--config", str(path), "--no-compare"], runner=runner) == 0
    out = capsys.readouterr().out
    assert f"taking over the stale lock {lock} of run adamw-sync-s0" in out and "no such process now" in out
    assert runner.calls == ["adamw-sync-s0"] and runner.locks[0]["pid"] == os.getpid()
    assert not lock.exists()  # released when the run ended


# A stand-in for `lightning-async fit` that trains forever: writes into its run dir, records (in a state folder
# of its run) its pid, its OMP_NUM_THREADS and the study's lock, and on SIGTERM either shuts down gracefully in
# 0.5 s (FAKE_FIT=polite) or ignores it (stubborn).
FAKE_FIT = r"""
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
runs = Path(args[args.index("--trainer.logger.init_args.save_dir") + 1]) / "runs"
name = args[args.index("--trainer.logger.init_args.version") + 1]
state = Path(os.environ["FAKE_FIT_STATE"]) / name
state.mkdir(parents=True, exist_ok=True)
def on_term(signum, frame):
    (state / "got-sigterm").write_text("")
    if os.environ["FAKE_FIT"] == "stubborn":
        return
    time.sleep(0.5)
    (state / "stopped").write_text("")
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
(runs / name).mkdir(parents=True, exist_ok=True)
(runs / name / "events.out.tfevents.partial").write_text("")
lock = runs / (name + ".lock")
deadline = time.time() + 5
while time.time() < deadline and not (lock.exists() and "child_pid" in lock.read_text()):
    time.sleep(0.02)
(state / "lock").write_text(lock.read_text() if lock.exists() else "{}")
(state / "omp").write_text(os.environ.get("OMP_NUM_THREADS", "unset"))
(state / "pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""

# Runs study_main in a fresh process in well under a second: the package's __init__ (which imports torch and
# Lightning, seconds on a busy machine) is replaced by a bare package, and so is the optimizer-zoo lookup.
DRIVER = r"""
import sys, types
package_dir, config, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
package = types.ModuleType("lightning_async")
package.__path__ = [package_dir]
sys.modules["lightning_async"] = package
from lightning_async.tools.study import cli, parsing, runner
parsing.valid_optimizers = lambda recipes_dir=None: ["adamw"]
runner.STOP_GRACE_S = grace
sys.exit(cli.study_main(["--config", config, "--no-compare", *sys.argv[4:]]))
"""
RUN = "adamw-sync-s0"


def _wait_for(path: Path, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.02)
    time.sleep(0.05)  # written by write_text: let it finish
    return path.read_text()


def _start_study(tmp_path: Path, behaviour: str, grace: float, modes=("sync",), args=(),
                 env_without=()) -> tuple[subprocess.Popen, Path]:
    import lightning_async

    (tmp_path / "fake_fit.py").write_text(FAKE_FIT)
    (tmp_path / "driver.py").write_text(DRIVER)
    state = tmp_path / "state"
    state.mkdir()
    path = write_study(tmp_path, optimizers=["adamw"], modes=list(modes), seeds=[0],
                       launcher=[sys.executable, str(tmp_path / "fake_fit.py")])
    env = {k: v for k, v in os.environ.items() if k not in env_without}
    env.update(FAKE_FIT=behaviour, FAKE_FIT_STATE=str(state))
    package_dir = str(Path(lightning_async.__file__).parent)
    study = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), package_dir, str(path), str(grace), *args],
                             env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return study, state


@pytest.mark.parametrize("behaviour", ["polite", "stubborn"])
def test_sigterm_stops_the_run_and_waits_for_it(tmp_path, behaviour):
    """SIGTERM to a study used to kill it alone, leaving its training running as an orphan."""
    study, state = _start_study(tmp_path, behaviour, grace=1.0)
    child = None
    try:
        child = int(_wait_for(state / RUN / "pid"))
        t0 = time.monotonic()
        study.send_signal(signal.SIGTERM)
        rc = study.wait(timeout=20)
        output = study.stdout.read()
        assert rc == 128 + signal.SIGTERM, output
        assert (state / RUN / "got-sigterm").exists()  # passed on to the run
        assert not pid_alive(child)  # and waited for: nothing outlives the study
        if behaviour == "polite":
            assert (state / RUN / "stopped").exists()  # its graceful shutdown (0.5 s) was not cut short
        else:
            assert time.monotonic() - t0 >= 1.0 and "did not stop within 1s of SIGTERM; killing it" in output
        assert "interrupted (SIGTERM) during adamw-sync-s0; the run was stopped" in output
        lock = json.loads((state / RUN / "lock").read_text())  # what the run saw while it trained
        assert lock["pid"] == study.pid and lock["child_pid"] == child  # a later study can see both
        assert not (tmp_path / "out" / "runs" / "adamw-sync-s0.lock").exists()  # released
    finally:
        study.kill()
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("behaviour", ["polite", "stubborn"])
def test_sigterm_with_jobs_stops_every_running_run(tmp_path, behaviour):
    """With --jobs 2 both runs train at once, each with half the cores; SIGTERM reaches and waits for both."""
    runs = ["adamw-sync-s0", "adamw-delayed-s0"]
    study, state = _start_study(tmp_path, behaviour, grace=1.0, modes=("sync", "delayed"), args=("--jobs", "2"),
                                env_without=("OMP_NUM_THREADS",))
    children: list[int] = []
    try:
        children = [int(_wait_for(state / run / "pid")) for run in runs]  # both in flight at the same time
        study.send_signal(signal.SIGTERM)
        rc = study.wait(timeout=20)
        output = study.stdout.read()
        assert rc == 128 + signal.SIGTERM, output
        for run, child in zip(runs, children):
            assert (state / run / "got-sigterm").exists() and not pid_alive(child), output
            assert (state / run / "omp").read_text() == str(max(1, os.cpu_count() // 2))
            assert json.loads((state / run / "lock").read_text())["child_pid"] == child
            assert not (tmp_path / "out" / "runs" / f"{run}.lock").exists()
            log = (tmp_path / "out" / "logs" / f"{run}.log").read_text()
            assert "(stopped by the study: SIGTERM; exit" in log
            if behaviour == "polite":
                assert (state / run / "stopped").exists()
        if behaviour == "stubborn":
            assert "2 of the runs did not stop within 1s of SIGTERM; killing them" in output
        assert "interrupted (SIGTERM) during adamw-sync-s0, adamw-delayed-s0; the runs were stopped" in output
    finally:
        study.kill()
        for child in children:
            if pid_alive(child):
                os.kill(child, signal.SIGKILL)


def test_rerun_does_not_touch_a_run_still_training(tmp_path, capsys):
    """A study killed with SIGKILL cannot stop its run; the next study must not delete or retrain it."""
    study, state = _start_study(tmp_path, "polite", grace=1.0)
    child = None
    try:
        child = int(_wait_for(state / RUN / "pid"))
        study.kill()
        study.wait(timeout=10)
        assert pid_alive(child)  # the orphan trains on
        runner = FakeRunner()
        assert study_main(["--config", str(tmp_path / "study.yaml"), "--no-compare"], runner=runner) == 2
        err = capsys.readouterr().err
        assert f"run adamw-sync-s0 is still in progress (pid {study.pid} and child pid {child}" in err
        assert f"stop it (kill {child}), then rerun" in err  # the study's own pid is gone
        partial = tmp_path / "out" / "runs" / "adamw-sync-s0" / "events.out.tfevents.partial"
        assert runner.calls == [] and partial.exists()  # nothing deleted, nothing retrained
        os.kill(child, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        # once it is gone, the next study takes the lock over and trains the run again
        assert study_main(["--config", str(tmp_path / "study.yaml"), "--no-compare"], runner=runner) == 0
        assert "taking over the stale lock" in capsys.readouterr().out and runner.calls == ["adamw-sync-s0"]
    finally:
        study.kill()
        if child is not None and pid_alive(child):
            os.kill(child, signal.SIGKILL)


# ---- --jobs -----------------------------------------------------------------------------------
class SlowRunner(FakeRunner):
    """A :class:`FakeRunner` that takes ``seconds`` (per run name, else ``default``) and records when each run
    started and ended; safe to call from several threads."""

    def __init__(self, default: float = 0.3, seconds: dict[str, float] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.default, self.seconds = default, seconds or {}
        self.spans: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def __call__(self, spec: RunSpec) -> int:
        start = time.monotonic()
        time.sleep(self.seconds.get(spec.name, self.default))
        try:
            with self._lock:
                return super().__call__(spec)
        finally:
            self.spans[spec.name] = (start, time.monotonic())


def most_at_once(spans) -> int:
    """The largest number of the ``(start, end)`` spans that overlap (an end before a start at the same time)."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_jobs_overlap_runs_but_never_more_than_jobs(tmp_path, capsys):
    path = write_study(tmp_path, seeds=[0])  # 2 optimizers x 3 modes
    runner = SlowRunner(0.3)
    assert study_main(["--config", str(path), "--no-compare", "--jobs", "2"], runner=runner) == 0
    assert len(runner.spans) == 6 and most_at_once(runner.spans.values()) == 2
    out = capsys.readouterr().out
    assert "study t: 6 runs, 0 already done, 6 to run -> " in out and "(2 at a time)" in out
    for i, name in enumerate(["adamw-sync-s0", "adamw-delayed-s0", "adamw-delayed-ef-s0", "muon-sync-s0"], 1):
        assert f"[{i}/6] {name}: running (log: " in out and f"[{i}/6] {name}: ok in " in out
    # one at a time (the default) never overlaps
    one = SlowRunner(0.05)
    assert study_main(["--config", str(path), "--no-compare", "--output", str(tmp_path / "one")], runner=one) == 0
    assert most_at_once(one.spans.values()) == 1


def test_jobs_results_and_resume_equal_the_sequential_ones(tmp_path):
    path = write_study(tmp_path)
    outcomes = dict(fail={"adamw-delayed-s0"}, diverge={"muon-delayed-s1": "guard", "adamw-sync-s1": "no-guard"})
    results = {}
    for jobs in (1, 3):
        study = load_study(path)
        study.output = tmp_path / f"jobs{jobs}"
        result = run_study(study, runner=SlowRunner(0.02, **outcomes), jobs=jobs, compare=False, print_fn=lambda m: None)
        rerun = SlowRunner(0.02)
        again = run_study(study, runner=rerun, jobs=jobs, compare=False, print_fn=lambda m: None)
        done = sorted(p.parent.name for p in study.runs_dir.glob("*/DONE"))
        results[jobs] = (result.ran, result.skipped, result.failed, result.diverged, again.ran, again.skipped,
                         sorted(rerun.calls), done, sorted(p.name for p in study.runs_dir.glob("*.lock")))
    assert results[3] == results[1]
    assert results[1][2] == ["adamw-delayed-s0"] and results[1][6] == ["adamw-delayed-s0"]  # failures retried
    assert results[1][3] == ["adamw-sync-s1", "muon-delayed-s1"] and results[1][8] == []  # no lock left behind


def test_jobs_resume_after_interruption(tmp_path, capsys):
    path = write_study(tmp_path)
    first = SlowRunner(0.1, interrupt_at=3)
    assert study_main(["--config", str(path), "--no-compare", "--jobs", "2"], runner=first) == 130
    out = capsys.readouterr().out
    interrupted = first.calls[2]
    (note,) = [line for line in out.splitlines() if line.startswith("interrupted during ")]
    assert interrupted in note and "Rerun the same command to resume" in note
    runs = tmp_path / "out" / "runs"
    assert not list(runs.glob("*.lock"))  # every lock released, the other run in flight waited for
    finished = {p.parent.name for p in runs.glob("*/DONE")}
    assert interrupted not in finished and len(finished) == len(first.calls) - 1  # the other run in flight ended
    second = SlowRunner(0.02)
    assert study_main(["--config", str(path), "--no-compare", "--jobs", "2"], runner=second) == 0
    assert sorted(second.calls) == sorted({s.name for s in load_study(path).expand()} - finished)
    assert f"{interrupted}: removing half-finished run" in capsys.readouterr().out


def test_jobs_fail_fast_stops_launching_and_lets_running_runs_finish(tmp_path, capsys):
    path = write_study(tmp_path, optimizers=["adamw"])  # 3 modes x 2 seeds
    runner = SlowRunner(0.5, seconds={"adamw-sync-s0": 0.05}, fail={"adamw-sync-s0"})
    assert study_main(["--config", str(path), "--no-compare", "--fail-fast", "--jobs", "2"], runner=runner) == 1
    assert sorted(runner.calls) == ["adamw-delayed-s0", "adamw-sync-s0"]  # no third run was launched
    out = capsys.readouterr().out
    stop = out.index("stopping at the first failure (--fail-fast); waiting for the 1 run(s) in flight")
    assert out.index("[2/6] adamw-delayed-s0: ok in") > stop  # the run in flight finished
    # one at a time, the study stops at the failure itself
    alone = SlowRunner(0.01, fail={"adamw-sync-s0"})
    assert study_main(["--config", str(path), "--no-compare", "--fail-fast", "--output", str(tmp_path / "one")],
                      runner=alone) == 1
    assert alone.calls == ["adamw-sync-s0"]


def test_jobs_from_the_study_file_and_the_command_line(tmp_path, capsys):
    assert load_study(write_study(tmp_path)).jobs == 1
    assert load_study(write_study(tmp_path, jobs=3)).jobs == 3
    with pytest.raises(StudyError, match="jobs must be a positive integer"):
        load_study(write_study(tmp_path, jobs=0))
    runner = FakeRunner()
    path = write_study(tmp_path, jobs=4)
    assert study_main(["--config", str(path), "--dry-run", "--jobs", "2"], runner=runner) == 0
    assert "(2 at a time)" in capsys.readouterr().out
    assert study_main(["--config", str(path), "--jobs", "0"], runner=runner) == 2
    assert "--jobs must be a positive integer" in capsys.readouterr().err and runner.calls == []


def test_run_env_shares_the_cores_among_the_jobs(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_env(1)["PYTHONUNBUFFERED"] == "1" and "OMP_NUM_THREADS" not in run_env(1)  # as without --jobs
    assert [run_env(jobs)["OMP_NUM_THREADS"] for jobs in (2, 3, 8, 16)] == ["4", "2", "1", "1"]
    assert run_env(4, {"OMP_NUM_THREADS": "6"})["OMP_NUM_THREADS"] == "6"  # the user's setting wins
    # and it reaches the training process
    script = "import os; print('threads', os.environ.get('OMP_NUM_THREADS', 'unset'))"
    for jobs, expected in ((2, "threads 4"), (1, "threads unset")):
        spec = RunSpec(name=f"r{jobs}", optimizer=None, mode="sync", lr=None, seed=0, ef_strength=None, delay=None,
                       run_dir=tmp_path / "runs" / f"r{jobs}", log_path=tmp_path / "logs" / f"r{jobs}.log",
                       command=[sys.executable, "-c", script])
        assert subprocess_runner(spec, jobs=jobs) == 0
        assert expected in spec.log_path.read_text().splitlines()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert subprocess_runner(spec, jobs=2) == 0 and "threads 3" in spec.log_path.read_text()


def autogroups_settable() -> bool:
    """Whether this kernel has scheduler autogroups whose nice value we may set (writing our own value back)."""
    try:
        own = Path("/proc/self/autogroup").read_text().split()[-1]
        Path("/proc/self/autogroup").write_text(own)
    except (OSError, IndexError):
        return False
    return True


@pytest.mark.skipif(not autogroups_settable(), reason="no scheduler autogroups to set on this kernel")
def test_a_niced_study_runs_its_trainings_niced(tmp_path, monkeypatch):
    """A run starts its own session, hence its own autogroup; ``nice lightning-async study`` must still reach it."""
    # the run reports its autogroup's nice once it changes (or after 10 s)
    script = ("import time\nfor _ in range(200):\n    group = open('/proc/self/autogroup').read().strip()\n"
              "    if not group.endswith(' nice 0'): break\n    time.sleep(0.05)\nprint('group', group)")
    spec = RunSpec(name="niced", optimizer=None, mode="sync", lr=None, seed=0, ef_strength=None, delay=None,
                   run_dir=tmp_path / "runs" / "niced", log_path=tmp_path / "logs" / "niced.log",
                   command=[sys.executable, "-c", script])
    monkeypatch.setattr(os, "getpriority", lambda which, who: 7)  # as if started by `nice -n 7`
    assert subprocess_runner(spec) == 0
    (line,) = [s for s in spec.log_path.read_text().splitlines() if s.startswith("group ")]
    assert line.endswith(" nice 7")
    mine = Path("/proc/self/autogroup").read_text().split()[0]
    assert line.split()[1] != mine  # its own group (the study's own was left alone)


# ---- probe ------------------------------------------------------------------------------------
def synthetic_row(tmp_path: Path, finals: dict[str, list[float]]) -> Row:
    spec = {SYNC: ("sync", 0.0), ASYNC: ("delayed", 0.0), ASYNC_EF: ("delayed", 1.0)}
    for category, values in finals.items():
        mode, ef = spec[category]
        for seed, value in enumerate(values):
            write_fake_run(tmp_path / f"{category}-{seed}", mode=mode, ef_strength=ef, seed=seed, val_loss={10: value})
    from lightning_async.compare import build_rows

    (row,) = build_rows(load_runs([tmp_path]))
    return row


def test_verdict_clear_gap_ef_closes(tmp_path):
    row = synthetic_row(tmp_path, {SYNC: [2.60, 2.61, 2.59], ASYNC: [2.90, 2.89, 2.91], ASYNC_EF: [2.63, 2.64, 2.62]})
    v = verdict(row)
    assert v.confidence == "high" and v.seeds == 3
    assert "async costs 0.3000 in final loss (11.54%)" in v.text
    # per-seed gaps 0.30, 0.28, 0.32: mean 0.30, sd 0.02, half-width t(0.975, 2) 0.02 / sqrt(3) = 4.303 * 0.01155
    assert "(95% CI +0.2503 to +0.3497, n=3)" in v.text
    assert "EF recovers 90% (95% CI 88% to 91%, n=3) of it (EF closes (nearly) all of it)" in v.text
    assert "with 3 seeds the gap's 95% interval excludes zero" in v.text
    assert "EF's change of the final loss, -0.2700 (95% CI -0.3197 to -0.2203, n=3), is significant" in v.text


def test_verdict_gap_within_noise(tmp_path):
    # per-seed gaps +0.03, -0.02, +0.02: mean +0.01, its 95% interval includes 0 (and so does the 80% one)
    row = synthetic_row(tmp_path, {SYNC: [2.60, 2.64, 2.56], ASYNC: [2.63, 2.62, 2.58], ASYNC_EF: [2.62, 2.60, 2.58]})
    v = verdict(row)
    assert v.confidence == "low"
    assert "the gap's 95% interval includes zero: the delay's cost is not told apart from seed noise" in v.text
    # a constant gap of 0.01 in every seed is no noise, however far apart the seeds' own losses are
    row = synthetic_row(tmp_path / "paired", {SYNC: [2.60, 2.64, 2.56], ASYNC: [2.61, 2.65, 2.57]})
    assert verdict(row).confidence == "high"


def test_verdict_one_seed_and_no_gap(tmp_path):
    row = synthetic_row(tmp_path / "a", {SYNC: [2.6], ASYNC: [2.65], ASYNC_EF: [2.66]})
    v = verdict(row)
    assert v.confidence == "low" and "with 1 seed there is no interval for the gap" in v.text
    assert "EF makes it worse" in v.text
    row = synthetic_row(tmp_path / "b", {SYNC: [2.6], ASYNC: [2.6], ASYNC_EF: [2.6]})
    assert "costs nothing measurable" in verdict(row).text
    row = synthetic_row(tmp_path / "c", {SYNC: [2.6]})
    assert verdict(row).confidence == "none"


def test_verdict_names_a_diverged_run(tmp_path):
    row = synthetic_row(tmp_path, {SYNC: [2.6], ASYNC: [float("nan")]})
    v = verdict(row)
    assert v.confidence == "none"
    assert v.text.startswith("cannot judge: the async run diverged (non-finite loss)"), v.text


def test_probe_with_injected_runner(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: {optimizer: adamw}\n")
    runner = FakeRunner()
    rc = probe_main(["--config", str(recipe), "--steps", "7", "--seeds", "2", "--output", str(tmp_path / "p")],
                    runner=runner)
    assert rc == 0
    assert runner.calls == ["sync-s0", "delayed-s0", "delayed-ef-s0", "sync-s1", "delayed-s1", "delayed-ef-s1"]
    cmd = runner.commands[0]
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "7" and "--model.optimizer" not in cmd
    out = capsys.readouterr().out
    assert "async costs 0.2800 in final loss" in out and "EF recovers 75%" in out and "Confidence: high" in out
    assert (tmp_path / "p" / "compare" / "verdict.md").exists()
    assert probe_main(["--config", str(tmp_path / "missing.yaml")], runner=runner) == 2


def test_probe_tries_the_corrections_and_recommends_the_best(tmp_path, capsys):
    from lightning_async.tools.study.runner import synthetic_runner

    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: {optimizer: adamw}\n")
    rc = probe_main(["--config", str(recipe), "--steps", "8", "--seeds", "2", "--corrections", "all",
                     "--output", str(tmp_path / "p")], runner=synthetic_runner)
    assert rc == 0
    runs = sorted(p.name for p in (tmp_path / "p" / "runs").iterdir() if p.is_dir())
    assert len(runs) == 2 * 7 and "delayed-weight-prediction-s1" in runs
    out = capsys.readouterr().out
    assert "nesterov recovered" in out and "dc-asgd recovered" in out  # a column per correction
    # the synthetic runs differ by the same amount in both seeds: zero-width intervals, EF (75%) beats adaptive EF
    # (gap 0.015: EF wins back 0.75 x 0.015 = 0.0113, adaptive EF 0.70 x 0.015)
    assert "Recommendation: ef: its final loss differs by -0.0113 (95% CI -0.0113 to -0.0113, n=2) against no " \
        "correction and -0.0007 (95% CI" in out
    assert "against the runner-up, adaptive-ef, both below zero at 95%" in out
    assert "corrections/ef" in (tmp_path / "p" / "compare" / "verdict.md").read_text()


def test_probe_modes_and_bad_corrections(tmp_path):
    from lightning_async.tools.probe import probe_modes

    assert probe_modes(["nesterov", "ef", "nesterov"]) == ["sync", "delayed", "delayed-nesterov", "delayed-ef"]
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model: {optimizer: adamw}\n")
    assert probe_main(["--config", str(recipe), "--corrections", "dcasgd", "--dry-run"]) == 2


# ---- the real thing ---------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("lightning_async.cli") is None,
                    reason="lightning_async.cli (the training CLI) is not importable yet")
@pytest.mark.slow
def test_real_probe_end_to_end(tmp_path, monkeypatch):
    """Three real tiny trainings through the CLI (sync, delayed, delayed+EF), two at a time, then compare."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "probe"
    rc = probe_main(["--config", "recipes/quickstart.yaml", "--steps", "6", "--output", str(out), "--jobs", "2"])
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert rc == 0, logs
    runs = load_runs([out / "runs"])
    assert sorted(r.category for r in runs) == sorted([SYNC, ASYNC, ASYNC_EF])
    assert all(r.done and r.final_val_loss is not None for r in runs)
    assert (out / "compare" / "report.md").exists()
