"""The example scripts under docs/examples run and show what the docs say they show."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


@pytest.mark.usefixtures("one_thread")
def test_delayed_loop_trains_and_the_delay_costs(capsys) -> None:
    namespace = runpy.run_path(str(EXAMPLES / "delayed_loop.py"))
    namespace["main"](["--steps", "40", "--correction", "ef"])
    lines = capsys.readouterr().out.strip().splitlines()
    losses = {line.split(":")[0].strip(): float(line.rsplit(" ", 1)[1]) for line in lines}
    assert list(losses) == ["sync", "delayed", "delayed+ef"]
    assert all(loss < math.log(64) / 4 for loss in losses.values())  # every variant learns the task
    assert losses["delayed"] > losses["sync"]  # the one-step delay costs something here
