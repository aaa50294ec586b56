"""The transport frees what it sent: NCCL-like works once they report completion, gloo-like works (which
never report completion before ``wait()``) two training calls after they were posted. With fake works and a
fake ``batch_isend_irecv``: no processes."""

from __future__ import annotations

import pytest
import torch

from lightning_async.pipeline import p2p
from lightning_async.pipeline.p2p import StageTransport


class FakeWork:
    """A send: ``completes_by_itself`` like NCCL (its kernel ran), otherwise like gloo (complete once waited)."""

    def __init__(self, completes_by_itself: bool) -> None:
        self.completes_by_itself, self.waited, self.ran = completes_by_itself, False, False

    def is_completed(self) -> bool:
        return self.waited or (self.completes_by_itself and self.ran)

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def fake_sends(monkeypatch):
    """Every ``batch_isend_irecv`` returns fresh fake works, recorded in order."""
    made: list[FakeWork] = []
    state = {"nccl_like": False}

    def batch_isend_irecv(ops):
        works = [FakeWork(state["nccl_like"]) for _ in ops]
        made.extend(works)
        return works

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(p2p.dist, "P2POp", lambda *args, **kwargs: args)
    return made, state


def _transport() -> StageTransport:
    t = StageTransport(group=None, device=torch.device("cpu"), rank_of_piece=lambda k: k, stage_of_rank=lambda r: r)
    return t


def _send_grad_like(t: StageTransport, n: int) -> None:
    for _ in range(n):
        t.exchange(([torch.ones(2, 3)], "grad", 1))  # piece 1's gradient to piece 0 (the peer does not matter to the fake)


def test_gloo_like_sends_are_freed_two_calls_later(fake_sends):
    made, _ = fake_sends
    t = _transport()
    held = []
    for call in range(6):
        t.begin_call()
        _send_grad_like(t, 4)
        held.append(len(t._pending_sends))
    # calls c-1 and c are held (8 sends), everything older is waited and freed
    assert held == [4, 8, 8, 8, 8, 8]
    assert all(w.waited for w in made[: 4 * 4]) and not any(w.waited for w in made[4 * 4 :])
    t.flush()
    assert t._pending_sends == [] and all(w.waited for w in made)


def test_without_calls_gloo_like_sends_accumulate(fake_sends):
    """The defect this guards against: gloo works never complete by themselves, so reaping alone keeps them all."""
    t = _transport()
    for _ in range(5):
        _send_grad_like(t, 4)
    assert len(t._pending_sends) == 20


def test_nccl_like_sends_are_freed_once_complete(fake_sends):
    made, state = fake_sends
    state["nccl_like"] = True
    t = _transport()
    _send_grad_like(t, 3)
    assert len(t._pending_sends) == 3  # kernels not run yet: kept alive
    for w in made:
        w.ran = True
    _send_grad_like(t, 1)  # the next exchange reaps the completed ones
    assert len(t._pending_sends) == 1 and not any(w.waited for w in made)


def test_a_peer_whose_connection_resets_while_posting_is_named(monkeypatch):
    """gloo raises from ``batch_isend_irecv`` itself (not from ``wait``) once a dead peer's connection has reset."""

    def reset(ops):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8578: Connection reset by peer")

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", reset)
    monkeypatch.setattr(p2p.dist, "P2POp", lambda *args, **kwargs: args)
    t = StageTransport(group=None, device=torch.device("cpu"), rank_of_piece=lambda k: k + 4, stage_of_rank=lambda r: r - 4)
    with pytest.raises(p2p.PeerFailure, match=r"stage 0 \(global rank 4\) stopped answering: .*Connection reset"):
        t.exchange(([torch.ones(2, 3)], "grad", 1))
