"""Shared fixtures, for every folder below. The test folders mirror the packages of ``lightning_async/``
(``tests/pipeline/`` tests ``lightning_async/pipeline/``, ...; ``tests/cli/`` the command, its recipes and the
docs; the tests of the top-level modules sit here). The shared helpers are plain modules next to this file
(``workload.py``, ``_pipeline_harness.py``, ``_hf_oracle.py``, ...), imported by the tests that need them.

Test modules are imported by their basename (no ``__init__.py``; pytest's default ``prepend`` import mode), so
basenames stay unique across folders. This folder and every test folder are put on ``sys.path`` here, before any
test module is imported: the helpers, and the few names one test module takes from another
(``from test_strategy import TinyData``), import the same way whichever files a run selects, and so do the
multi-process workers, which unpickle their functions by module name with the parent's ``sys.path``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
for folder in [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from lightning_async.pipeline import local

# Multi-process tests start their ``run_local`` workers from one fork server that has imported these once: a
# spawned worker would import torch and Lightning again, ~6 s of CPU each. The multi-process modules took 305 s with
# spawned workers, about 150 s forked (2 cores). test_local.py still runs the plain "spawn" path, and so do the two tests of
# Lightning's spawn launcher (the notebooks' path).
WORKER_PRELOAD = ["torch", "torch.distributed", "lightning", "lightning_async.cli", "workload", "_pipeline_harness"]


def pytest_configure(config):
    local.start_from_forkserver(WORKER_PRELOAD)


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread is fastest and immune to a busy machine's oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Fixtures that start pipeline processes (one spawn shared by the module's tests) or build a wheel: every test that
# uses one belongs to the slow tier (`python -m pytest -m "not slow"` is the edit loop; README.md, Tests).
SLOW_FIXTURES = {"pipeline_results", "oracle_results", "pipeline_fits", "pipeline_divergence", "reported", "installed",
                 "nodes", "uninterrupted", "refusals", "habits"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
