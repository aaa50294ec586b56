"""Shared fixtures. The shared workloads are plain modules next to this file (``workload.py``,
``_pipeline_harness.py``), imported by the tests that need them."""

from __future__ import annotations

import pytest
import torch

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
