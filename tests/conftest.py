"""Shared fixtures. The shared workloads are plain modules next to this file (``workload.py``,
``_pipeline_harness.py``), imported by the tests that need them."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread is fastest and immune to a busy machine's oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
