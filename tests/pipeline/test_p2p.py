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


# ---- NCCL's rules on gloo: the mode's choices, its tags, its refusals (no processes) --------------------------
def test_the_transport_mode_names_its_choices():
    with pytest.raises(ValueError, match=r"transport must be one of 'auto', 'nccl-rules', got 'nccl'"):
        StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r, transport="nccl")
    assert p2p.check_transport("nccl-rules") == "nccl-rules"


def test_nccl_rules_tag_every_channel_zero_and_refuse_pre_posting(monkeypatch):
    """On a gloo group the mode takes NCCL's branch: tag 0 on every channel (gloo's rules tag each channel apart), and
    pre-posted receives are refused with the mode named."""
    monkeypatch.setattr(p2p.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    channels = [(piece, kind) for piece in range(4) for kind in ("act", "grad")]
    gloo = StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r)
    assert gloo.prepost_enabled and len({gloo._tag(*c) for c in channels}) == len(channels)
    rules = StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r, transport="nccl-rules")
    assert not rules.prepost_enabled and {rules._tag(*c) for c in channels} == {0}
    with pytest.raises(ValueError, match=r"Pre-posted receives need the gloo backend.*transport='nccl-rules'"):
        rules.prepost_enabled = True
    with pytest.raises(ValueError, match="transport='nccl-rules'"):
        StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r, prepost=True, transport="nccl-rules")


def test_nccl_rules_post_every_group_through_batch_isend_irecv(fake_sends, monkeypatch):
    made, _ = fake_sends
    monkeypatch.setattr(p2p.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    t = StageTransport(None, torch.device("cpu"), lambda k: k, lambda r: r, transport="nccl-rules")
    _send_grad_like(t, 3)
    assert t.groups_batched == 3 and len(made) == 3


def test_held_sends_leave_in_the_receivers_order_on_nccls_path_only(monkeypatch):
    """``order`` (a step's ``send_order``): on NCCL's path a held send waits in the peer's queue at its place and
    leaves after the releasing step's own output, each in its own group, the receive with the last; gloo's rules (a
    tag per channel) send at once."""
    posted: list[list[float]] = []

    def batch_isend_irecv(ops):
        posted.append([op[1].flatten()[0].item() for op in ops])
        return [FakeWork(True) for _ in ops]

    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(p2p.dist, "P2POp", lambda *args, **kwargs: args)
    monkeypatch.setattr(p2p.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    t = StageTransport(None, torch.device("cpu"), lambda k: k // 2, lambda r: r, transport="nccl-rules")
    grad = lambda v, piece: ([torch.full((2,), float(v))], "grad", piece)  # noqa: E731  (piece 1's gradient, to rank 0)
    t.exchange(grad(3, 1), order=("hold", 0))
    t.exchange(grad(2, 1), order=("hold", 0))  # consumed before the first one held
    assert posted == [] and len(t._held[0]) == 2
    with pytest.raises(RuntimeError, match="never released"):
        t.flush()
    t.exchange(grad(1, 1), order=("release", 2))
    assert posted == [[1.0], [2.0], [3.0]] and t._held[0] == []
    t.flush()

    sent = []
    monkeypatch.setattr(p2p.dist, "isend", lambda x, peer, group=None, tag=0: sent.append(x[0].item()) or FakeWork(False))
    gloo = StageTransport(None, torch.device("cpu"), lambda k: k // 2, lambda r: r)
    gloo.exchange(grad(3, 1), order=("hold", 0))
    gloo.exchange(grad(1, 1), order=("release", 1))
    assert sent == [3.0, 1.0] and not gloo._held


@pytest.mark.parametrize("schedule, stages, m", [
    ("zbv", 2, 4), ("zbv", 3, 4), ("zbv", 4, 8), ("zbv", 2, 2), ("zbh1", 2, 4), ("interleaved", 2, 4), ("2bw", 3, 3),
])
def test_nccl_rules_accept_every_schedule_once_its_sends_are_ordered(schedule, stages, m):
    """The order check passes every built-in schedule, ZB-V included (its sends ordered for NCCL by
    ``program.order_sends``), under the mode and on NCCL alike."""
    from lightning_async.pipeline import schedules
    from lightning_async.pipeline.run_checks import check_message_order

    spec = schedules.spec(schedule)
    check_message_order(spec, stages, m)  # gloo's rules: any order matches by tag
    check_message_order(spec, stages, m, "nccl-rules")
    check_message_order(spec, stages, m, backend="nccl", device_type="cuda")


def test_nccl_rules_still_refuse_action_lists_no_order_can_match():
    """What is left to refuse: a message one end never posts (no order of sends matches it), and ranks that would
    wait on each other (rank 0 of 1F1B running its first backward before the forward it needs)."""
    from lightning_async.pipeline import schedules
    from lightning_async.pipeline.run_checks import check_message_order

    spec = schedules.spec("1f1b")
    lists = [spec.run_actions(r, 2, 4, 1) for r in range(2)]
    dropped = [lists[0], [a for a in lists[1] if not (a.kind == "F" and a.microbatch == 3)]]
    with pytest.raises(ValueError, match=r"Schedule '1f1b' .*transport='nccl-rules'.*first pair that disagrees"):
        check_message_order(spec, 2, 4, "nccl-rules", lists=dropped)
    with pytest.raises(ValueError, match=r"Schedule '1f1b' .*NCCL \(no tags\)"):
        check_message_order(spec, 2, 4, backend="nccl", lists=dropped)
    backward_first = [[a for a in lists[0] if a.kind == "B" and a.microbatch == 0]
                      + [a for a in lists[0] if not (a.kind == "B" and a.microbatch == 0)], lists[1]]
    with pytest.raises(ValueError, match=r"Schedule '1f1b' posts its messages in matching order, but its stages "
                                         r"would wait on each other under transport='nccl-rules'.*no rank can go on"):
        check_message_order(spec, 2, 4, "nccl-rules", lists=backward_first)
    check_message_order(spec, 2, 4, lists=backward_first)  # gloo's rules: not this check's business


def test_building_a_rank_under_nccl_rules_checks_the_order_before_any_group(monkeypatch):
    """``pipeline.rank.build`` (the strategy's, the harness's and the benchmarks' one way to a runtime) checks the
    order before it makes a process group: no group exists in this process, so reaching one would fail otherwise.
    With the sends of ZB-V left in compute order (``program.order_sends`` taken out) the check refuses it there."""
    import torch.distributed as dist

    from _pipeline_harness import make_model, sgd
    from lightning_async.pipeline import program
    from lightning_async.pipeline.rank import build, plan_rank

    model = make_model()
    plan = plan_rank([(f"model.{n}", u) for n, u in model.pipeline_units()], "zbv", 4, rank=0, world_size=2)
    monkeypatch.setattr(program, "order_sends", lambda spec, p, programs: list(programs))
    with pytest.raises(ValueError, match=r"Schedule 'zbv' .*transport='nccl-rules'"):
        build(plan, sgd(plan.named_parameters), lambda b: b, lambda y, t: y, transport="nccl-rules")
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="transport must be one of"):
        build(plan, sgd(plan.named_parameters), lambda b: b, lambda y, t: y, transport="NCCL")
