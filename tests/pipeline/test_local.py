"""``run_local``, the multi-process harness of the tests and benchmarks: no port race, fresh groups on demand."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from lightning_async.pipeline import local

pytestmark = pytest.mark.slow  # the tests here start processes or run the CLI (README.md, Tests)


def _sums_over_three_groups() -> tuple[list[float], bool]:
    """The sums of the ranks over three successive groups, and whether the CLI module was imported at the start."""
    import sys

    preloaded = "lightning_async.cli" in sys.modules
    sums = []
    for _ in range(3):  # the group run_local made, then two fresh ones through the same store
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        sums.append(float(value))
        local.join_default_group(timeout=30)
    return sums, preloaded


@pytest.mark.slow
def test_no_port_is_chosen_before_it_is_bound(monkeypatch):
    """Before: run_local asked for a free port, then the workers bound it seconds later; another process taking it
    in between (simulated: the port handed out is held by this test) failed the run with EADDRINUSE."""
    with socket.socket() as taken:
        taken.bind((local.HOST, 0))
        taken.listen()
        monkeypatch.setattr(local, "free_port", lambda: taken.getsockname()[1], raising=False)
        monkeypatch.setattr(local, "_start_method", "spawn")  # the default path (the suite's other runs fork)
        # spawned workers import only what unpickling this module's function needs: not the CLI module
        assert local.run_local(2, _sums_over_three_groups, timeout=120) == [([3.0, 3.0, 3.0], False)] * 2


@pytest.mark.slow
def test_forkserver_workers_start_with_the_preloaded_modules():
    """The suite's conftest calls ``start_from_forkserver``: workers arrive with the CLI module imported (a spawned
    one does not: above), and groups work the same."""
    assert local.run_local(2, _sums_over_three_groups, timeout=120) == [([3.0, 3.0, 3.0], True)] * 2


def test_join_default_group_outside_run_local_says_so():
    with pytest.raises(RuntimeError, match="only inside a run_local worker"):
        local.join_default_group()


def _one_sided_join_failures(failures: int) -> tuple[int, float] | str:
    """Rank 1's next ``failures`` joins fail (as gloo's rendezvous once did on one side only) while rank 0's
    succeed; then ``_join_first_group`` on both. Its generation and a sum over the group it ends in, or the error."""
    real = local.join_default_group
    left = [failures if dist.get_rank() == 1 else 0]

    def flaky(*args, **kwargs):
        joined = real(*args, **kwargs)  # (rank 0's join completes)
        if left[0]:
            left[0] -= 1
            dist.destroy_process_group()
            raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")
        return joined

    local.join_default_group = flaky
    try:
        local._join_first_group(2, attempts=3)
    except RuntimeError as err:
        return str(err)
    finally:
        local.join_default_group = real
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return local._MEMBERSHIP.generation, float(value)


@pytest.mark.slow
def test_a_rank_that_could_not_join_makes_every_rank_join_again():
    """CI's gloo rendezvous failed once on rank 1 only ("Connection closed by peer") while rank 0 joined, failing a
    test before it began; now every rank starts a fresh group, and a third failure is reported on both."""
    assert local.run_local(2, _one_sided_join_failures, 2, timeout=120) == [(4, 3.0)] * 2  # (generation 1: run_local's)
    assert local.run_local(2, _one_sided_join_failures, 3, timeout=120) == [
        "another rank could not join the process group 3 times; see its error.",
        "Gloo connectFullMesh failed with ... Connection closed by peer",
    ]
