"""What a user sees in TensorBoard, read from a real ``tensorboard`` server's HTTP data endpoints (the ones its web
page calls): the run list of a ``runs/`` folder names each run by what it is, and compare's output draws, in every
comparison chart, two or more series of more than one point each. (The training runs also show the CLI's progress
lines.)"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trains two short runs and starts two TensorBoard servers

STARTED = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+/)")


@contextlib.contextmanager
def tensorboard(logdir: Path, timeout: float = 90.0):
    """A ``tensorboard`` server on 127.0.0.1 at a port the OS picks (``--port 0``: no race for a free one); yields its
    base URL and always kills it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0",
         "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    found: list[str] = []
    lines: list[str] = []

    def watch() -> None:
        for line in proc.stdout:
            lines.append(line)
            match = STARTED.search(line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=watch, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while not found and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found, f"tensorboard did not start: {''.join(lines)[-2000:]}"
        yield found[0]
    finally:
        proc.kill()
        proc.wait(timeout=30)


def get(base: str, path: str, **query):
    url = base + path + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def wait_for_runs(base: str, expected: int, timeout: float = 60.0) -> list[str]:
    """The run list once TensorBoard has loaded ``expected`` runs (it reads the logdir in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        runs = get(base, "data/runs")
        if len(runs) >= expected or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A sync run and a delayed+EF run of the quick start (20 steps, validated twice), and compare's output on them."""
    from test_cli import REPO, SMALL_DATA, run_cli_invocations

    tmp_path = tmp_path_factory.mktemp("tensorboard")
    short = ["fit", "--config", str(REPO / "recipes/quickstart.yaml"), "--trainer.max_steps", "20", "--trainer.val_check_interval", "10",
             "--trainer.log_every_n_steps", "2", "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
             "--data.cache_dir", str(tmp_path / "cache"), *SMALL_DATA]
    results = run_cli_invocations(tmp_path, {
        "sync": short,  # with the default progress: StepProgress's lines
        "delayed-ef": [*short, "--config", str(REPO / "recipes/modes/delayed-ef.yaml"), "--trainer.enable_progress_bar", "false"],
        "compare": ["compare", "runs", "--output", "compare", "--no-plots"],
    })
    for name, result in results.items():
        assert result["returncode"] == 0, (name, result["stderr"][-3000:])
    lines = results["sync"]["stdout"].splitlines()
    assert [line.split(" |")[0] for line in lines if line.startswith("step ")] == [f"step {n}/20" for n in range(2, 21, 2)]
    assert "validation at step 10: val/loss" in results["sync"]["stdout"] and "v_num" not in results["sync"]["stdout"]
    assert not any(line.startswith("step ") for line in results["delayed-ef"]["stdout"].splitlines())
    return tmp_path


def test_the_run_list_of_a_runs_folder_says_what_each_run_is(trained):
    with tensorboard(trained / "runs") as base:
        runs = wait_for_runs(base, 2)
        assert sorted(runs) == ["quickstart/delayed-ef-adamw/version_0", "quickstart/sync-adamw/version_0"]
        tags = get(base, "data/plugin/scalars/tags")
        assert all("val/loss" in tags[run] and "train/loss" in tags[run] for run in runs), tags
        assert not any({"epoch", "hp_metric"} & set(tags[run]) for run in runs), tags  # no flat series opens the page


def test_every_comparison_chart_draws_two_series_of_several_points(trained):
    with tensorboard(trained / "compare" / "tensorboard") as base:
        runs = wait_for_runs(base, 2)
        assert sorted(runs) == ["async+EF", "sync"], runs  # the series only: no run "." for the layout's folder
        layout = get(base, "data/plugin/custom_scalars/layout")
        charts = [chart for category in layout["category"] for chart in category["chart"]]
        assert [c["title"] for c in layout["category"]] == ["compare: adamw"]
        assert [chart["title"] for chart in charts] == ["adamw: val/loss, sync vs async+EF", "adamw: train/loss, sync vs async+EF"]
        for chart in charts:
            (pattern,) = chart["multiline"]["tag"]
            drawn = {}
            for run in runs:
                found = get(base, "data/plugin/custom_scalars/scalars", run=run, tag=pattern)
                assert found["regex_valid"], found
                for tag, events in found["tag_to_events"].items():
                    drawn[(run, tag)] = events
            assert {run for run, _ in drawn} == {"sync", "async+EF"}, (chart["title"], drawn)
            assert all(len(events) > 1 for events in drawn.values()), (chart["title"], drawn)
            tag = pattern.strip("^$")
            steps = [step for _, step, _ in drawn[("sync", tag)]]  # the whole curve, not the last point
            assert steps == ([9, 19] if tag == "adamw/val_loss" else list(range(1, 20, 2))), (tag, steps)
