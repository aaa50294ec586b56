"""``run_local``, the multi-process harness of the tests and benchmarks: no port race, fresh groups on demand."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from lightning_async.pipeline import local

pytestmark = pytest.mark.slow  # the tests here start processes or run the CLI (README.md, Tests)


def _sums_over_three_groups() -> list[float]:
    sums = []
    for _ in range(3):  # the group run_local made, then two fresh ones through the same store
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        sums.append(float(value))
        local.join_default_group(timeout=30)
    return sums


@pytest.mark.slow
def test_no_port_is_chosen_before_it_is_bound(monkeypatch):
    """Before: run_local asked for a free port, then the workers bound it seconds later; another process taking it
    in between (simulated: the port handed out is held by this test) failed the run with EADDRINUSE."""
    with socket.socket() as taken:
        taken.bind((local.HOST, 0))
        taken.listen()
        monkeypatch.setattr(local, "free_port", lambda: taken.getsockname()[1], raising=False)
        monkeypatch.setattr(local, "_start_method", "spawn")  # the default path (the suite's other runs fork)
        assert local.run_local(2, _sums_over_three_groups, timeout=120) == [[3.0, 3.0, 3.0]] * 2


def _imported_before_start() -> bool:
    import sys

    return "lightning_async.cli" in sys.modules


@pytest.mark.slow
def test_forkserver_workers_start_with_the_preloaded_modules(monkeypatch):
    """The suite's conftest calls ``start_from_forkserver``: workers arrive with the CLI module imported; under
    spawn they do not (a spawned worker imports only what unpickling this module's function needs)."""
    assert local.run_local(2, _imported_before_start) == [True, True]
    monkeypatch.setattr(local, "_start_method", "spawn")
    assert local.run_local(2, _imported_before_start) == [False, False]


def test_join_default_group_outside_run_local_says_so():
    with pytest.raises(RuntimeError, match="only inside a run_local worker"):
        local.join_default_group()
