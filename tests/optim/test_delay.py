"""``DelayedOptimizer`` and the Error-Feedback correction against an independent few-line reference.

The reference below shares no code with ``lightning_async.optim.delay`` / ``delayed_step`` /
``error_feedback``: it keeps the list of weight snapshots ``x(0), x(1), ...``, evaluates each batch at
the snapshot the rule says, and obtains the bare optimizer's update ``u`` by stepping a *separate copy*
of the model and optimizer at the newest weights (``u = before - after``). Then it applies
``x(t+1) = x(t) - u - lam (u - u_(t-k))`` itself (``u_prev`` at ``k = 1``).

Rules (docs/delay.md):

* ``pairing="2bw"``: batch t is evaluated at ``x(max(t - k, 0))``; its update lands on ``x(t)``.
* ``pairing="fifo"``: batch t is evaluated at the current ``x(t)``; the update applied at step t comes
  from the gradient of step ``t - k``; the first ``k`` steps apply nothing.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import lightning_async.optim.corrections.base as correction_base

from lightning_async.optim import DelayedOptimizer, ErrorFeedbackCorrection
from lightning_async.optim.zoo import OPTIMIZER_NAMES
from workload import BATCHES, STEPS, lr_lambda, loss_of, make_model, make_optimizer, max_diff, snapshot

TOL = 1e-6

pytestmark = [
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),
    pytest.mark.usefixtures("one_thread"),
]


# ---- the independent reference -------------------------------------------------------------------
def reference_delayed(
    evaluator,
    stepper,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    delay: int,
    lam: float,
    pairing: str = "2bw",
    scheduler=None,
    clip: float | None = None,
    extrapolate_weight_decay: bool = True,
) -> list[dict[str, torch.Tensor]]:
    """Return the weight snapshots ``x(0), ..., x(T)`` of the delayed rule, by parameter name.

    ``evaluator`` and ``stepper`` are two models with the same initial weights; ``optimizer`` (and
    ``scheduler``) drive ``stepper``. Gradients are taken on ``evaluator`` loaded with the stashed
    weights; ``stepper`` only ever holds the newest weights and yields ``u``.
    """
    names = {p: n for n, p in stepper.named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]  # the optimizer's parameter order
    evaluator_params = dict(evaluator.named_parameters())
    stepper_params = dict(stepper.named_parameters())
    history = [snapshot(stepper)]
    applied = {n: [] for n in history[0]}  # the (extrapolated) updates applied so far, oldest first
    queue: list[dict[str, torch.Tensor]] = []

    def gradient(weights: dict[str, torch.Tensor], batch: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for n, p in evaluator_params.items():
                p.copy_(weights[n])
                p.grad = None
        loss_of(evaluator, batch).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([evaluator_params[n] for n in order], clip)
        return {n: p.grad.clone() for n, p in evaluator_params.items()}

    for t, batch in enumerate(batches):
        if pairing == "2bw":
            grads = gradient(history[max(t - delay, 0)], batch)
        else:
            queue.append(gradient(history[t], batch))
            grads = queue.pop(0) if len(queue) > delay else None
        if grads is None:  # FIFO warm-up: nothing old enough to apply
            history.append(history[-1])
        else:
            newest = history[-1]
            with torch.no_grad():
                for n, p in stepper_params.items():
                    p.copy_(newest[n])
                    p.grad = grads[n].clone()
            optimizer.step()
            following = {}
            with torch.no_grad():
                for group in optimizer.param_groups:
                    decay = 0.0 if extrapolate_weight_decay else group["lr"] * group["weight_decay"]
                    for p in group["params"]:
                        n = names[p]
                        u = newest[n] - p  # the bare optimizer's full update at the newest weights
                        extrapolated = u - decay * newest[n]
                        # EF's k-step form subtracts the update of k = delay steps ago (zero before there is one);
                        # p is x(t) - u; written from p (not x(t) - u) so lam = 0 is exact
                        earlier = applied[n][-delay] if 0 < delay <= len(applied[n]) else torch.zeros_like(u)
                        following[n] = p.detach() - lam * (extrapolated - earlier)
                        applied[n].append(extrapolated)
                    p.grad = None
            history.append(following)
        if scheduler is not None:
            scheduler.step()
    return history


def reference_run(name: str, delay: int, lam: float, pairing: str, steps: int = STEPS, **kwargs):
    stepper = make_model()
    optimizer = make_optimizer(name, stepper)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return reference_delayed(make_model(), stepper, optimizer, BATCHES[:steps], delay, lam, pairing, scheduler, **kwargs)


# ---- the library under test ----------------------------------------------------------------------
def build(name: str, delay: int = 1, lam: float = 0.0, pairing: str = "2bw", seed: int = 0, **kwargs):
    model = make_model(seed)
    optimizer = make_optimizer(name, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    wrapped = DelayedOptimizer(optimizer, delay=delay, error_feedback=lam, pairing=pairing, **kwargs)
    return model, wrapped, scheduler


def train(model, optimizer, scheduler, batches) -> None:
    for batch in batches:
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def newest_by_name(model, wrapped: DelayedOptimizer) -> dict[str, torch.Tensor]:
    newest = {id(p): w for p, w in zip(wrapped.params, wrapped.newest_weights())}
    return {n: newest[id(p)].detach().clone() for n, p in model.named_parameters()}


def library_run(name: str, delay: int, lam: float, pairing: str, steps: int = STEPS, **kwargs):
    model, wrapped, scheduler = build(name, delay, lam, pairing, **kwargs)
    train(model, wrapped, scheduler, BATCHES[:steps])
    return model, wrapped


# ---- parity with the reference -------------------------------------------------------------------
CASES = [(name, 1, lam) for name in OPTIMIZER_NAMES for lam in (0.0, 1.0)]
CASES += [("adamw", 2, 1.0), ("muon", 2, 1.0), ("soap", 2, 0.0)]


def test_error_feedback_in_small_chunks_is_identical(monkeypatch) -> None:
    """The correction runs over groups of parameters (bounded temporaries); the grouping must not matter."""
    model, wrapped = library_run("adamw", 1, 1.0, "2bw")
    whole = newest_by_name(model, wrapped)
    monkeypatch.setattr(correction_base, "CHUNK_ELEMENTS", 2000)  # most tensors alone, small ones grouped
    model, wrapped = library_run("adamw", 1, 1.0, "2bw")
    assert all(torch.equal(whole[n], t) for n, t in newest_by_name(model, wrapped).items())
    sizes = [t.numel() for t in model.parameters()]
    chunks = correction_base.chunks(list(model.parameters()), 2000)
    assert [t.numel() for c in chunks for t in c] == sizes  # every tensor once, in order
    assert all(len(c) == 1 or sum(t.numel() for t in c) <= 2000 for c in chunks) and len(chunks) < len(sizes)


@pytest.mark.parametrize("pairing", ["2bw", "fifo"])
@pytest.mark.parametrize("name,delay,lam", CASES)
def test_matches_independent_reference(name: str, delay: int, lam: float, pairing: str) -> None:
    expected = reference_run(name, delay, lam, pairing)
    model, wrapped = library_run(name, delay, lam, pairing)
    assert max_diff(newest_by_name(model, wrapped), expected[-1]) <= TOL
    # what the parameters show after step(): the weights the next batch is evaluated at
    shown = snapshot(model)
    forward_index = max(STEPS - delay, 0) if pairing == "2bw" else STEPS
    assert max_diff(shown, expected[forward_index]) <= TOL


def test_reference_moves_and_rules_differ() -> None:
    """Negative controls: the comparisons above would notice a wrong rule."""
    sync = library_run("adamw", 0, 0.0, "2bw")[0]
    sync = snapshot(sync)
    delayed = reference_run("adamw", 1, 0.0, "2bw")[-1]
    corrected = reference_run("adamw", 1, 1.0, "2bw")[-1]
    fifo = reference_run("adamw", 1, 0.0, "fifo")[-1]
    start = snapshot(make_model())
    assert max_diff(sync, start) > 1e-3  # training moves the weights
    assert max_diff(delayed, sync) > 1e-4  # the delay changes the trajectory
    assert max_diff(corrected, delayed) > 1e-4  # EF changes it again
    assert max_diff(fifo, delayed) > 1e-4  # the two pairings are different rules
    # the synchronous reference (delay 0) is the bare optimizer
    assert max_diff(reference_run("adamw", 0, 0.0, "2bw")[-1], sync) <= TOL


@pytest.mark.parametrize("name", ["muon", "soap"])
def test_delayed_differs_from_sync_for_other_optimizers(name: str) -> None:
    sync = snapshot(library_run(name, 0, 0.0, "2bw", steps=12)[0])
    model, wrapped = library_run(name, 1, 0.0, "2bw", steps=12)
    assert max_diff(newest_by_name(model, wrapped), sync) > 1e-4


# ---- delay 0 is the bare optimizer, bit for bit --------------------------------------------------
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_delay_zero_is_bit_identical(name: str) -> None:
    bare_model = make_model()
    bare = make_optimizer(name, bare_model)
    bare_sched = torch.optim.lr_scheduler.LambdaLR(bare, lr_lambda)
    train(bare_model, bare, bare_sched, BATCHES[:12])
    model, wrapped, scheduler = build(name, delay=0, lam=0.0)
    train(model, wrapped, scheduler, BATCHES[:12])
    for (n, a), (_, b) in zip(bare_model.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), n


# ---- Error Feedback telescopes -------------------------------------------------------------------
@pytest.mark.parametrize("name,pairing,lam", [("adamw", "2bw", 1.0), ("muon", "fifo", 1.0), ("lion", "2bw", 0.5)])
def test_error_feedback_telescopes(name: str, pairing: str, lam: float) -> None:
    """Record u (the inner optimizer's own step) and the applied displacement d of every step.

    d_t = u_t + lam (u_t - u_(t-1)), so sum d = sum u + lam * u_last: no drift, one boundary term.
    """
    model, wrapped, scheduler = build(name, 1, lam, pairing)
    params = wrapped.params
    updates: list[list[torch.Tensor]] = []
    before: list[torch.Tensor] = []

    def pre(optimizer, args, kwargs):
        before[:] = [p.detach().double() for p in params]

    def post(optimizer, args, kwargs):  # runs before the correction is applied
        updates.append([b - p.detach().double() for b, p in zip(before, params)])

    wrapped.optimizer.register_step_pre_hook(pre)
    wrapped.optimizer.register_step_post_hook(post)
    displacements = []
    for batch in BATCHES:
        old = [w.detach().double() for w in wrapped.newest_weights()]
        loss_of(model, batch).backward()
        wrapped.step()
        wrapped.zero_grad()
        scheduler.step()
        displacements.append([o - w.detach().double() for o, w in zip(old, wrapped.newest_weights())])

    skipped = STEPS - len(updates)
    assert skipped == (1 if pairing == "fifo" else 0)
    for d in displacements[:skipped]:  # FIFO warm-up: nothing applied
        assert all(d_i.abs().max() == 0 for d_i in d)
    displacements = displacements[skipped:]
    for t, (d, u) in enumerate(zip(displacements, updates)):
        u_prev = updates[t - 1] if t else [torch.zeros_like(x) for x in u]
        for d_i, u_i, v_i in zip(d, u, u_prev):
            torch.testing.assert_close(d_i, u_i + lam * (u_i - v_i), rtol=0, atol=TOL)
    for i in range(len(params)):
        total_d = sum(d[i] for d in displacements)
        total_u = sum(u[i] for u in updates)
        torch.testing.assert_close(total_d, total_u + lam * updates[-1][i], rtol=0, atol=2 * TOL)
    # and the boundary term is really there (the check is not vacuous)
    assert max(u.abs().max().item() for u in updates[-1]) > 10 * TOL


# ---- weight decay kept out of the extrapolation --------------------------------------------------
@pytest.mark.parametrize("name,pairing", [("adamw", "2bw"), ("muon", "2bw"), ("lion", "fifo"), ("adan", "2bw")])
def test_error_feedback_without_weight_decay(name: str, pairing: str) -> None:
    expected = reference_run(name, 1, 1.0, pairing, extrapolate_weight_decay=False)
    model, wrapped = library_run(name, 1, 1.0, pairing, extrapolate_weight_decay=False)
    got = newest_by_name(model, wrapped)
    assert max_diff(got, expected[-1]) <= TOL
    with_decay = reference_run(name, 1, 1.0, pairing)[-1]
    assert max_diff(got, with_decay) > 1e-7  # the option changes something


# ---- checkpoints ---------------------------------------------------------------------------------
RESUME_CASES = [(name, pairing) for name in ("adamw", "muon", "adan", "soap") for pairing in ("2bw", "fifo")]
RESUME_CASES += [("mars", "2bw"), ("normuon", "2bw"), ("lion", "fifo")]


@pytest.mark.parametrize("name,pairing", RESUME_CASES)
def test_resume_is_exact(name: str, pairing: str) -> None:
    delay, lam = 1, 1.0
    model, wrapped = library_run(name, delay, lam, pairing)
    uninterrupted = newest_by_name(model, wrapped)

    model, wrapped, scheduler = build(name, delay, lam, pairing)
    train(model, wrapped, scheduler, BATCHES[:7])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": wrapped.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    del model, wrapped, scheduler

    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model, wrapped, scheduler = build(name, delay, lam, pairing, seed=123)  # other weights: all must come from the state
    model.load_state_dict(state["model"])
    wrapped.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    train(model, wrapped, scheduler, BATCHES[7:])
    resumed = newest_by_name(model, wrapped)
    for n in uninterrupted:
        assert torch.equal(resumed[n], uninterrupted[n]), n


def test_resume_from_deep_copied_state() -> None:
    """An in-memory ``copy.deepcopy`` of ``state_dict()`` is as good as a file (2BW, EF, Muon)."""
    model, wrapped = library_run("muon", 1, 1.0, "2bw")
    uninterrupted = newest_by_name(model, wrapped)
    model, wrapped, scheduler = build("muon", 1, 1.0, "2bw")
    train(model, wrapped, scheduler, BATCHES[:7])
    state = copy.deepcopy({"model": model.state_dict(), "optimizer": wrapped.state_dict(), "scheduler": scheduler.state_dict()})
    train(model, wrapped, scheduler, BATCHES[7:9])  # keep using the old objects: the copy must not change
    model, wrapped, scheduler = build("muon", 1, 1.0, "2bw", seed=5)
    model.load_state_dict(state["model"])
    wrapped.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    train(model, wrapped, scheduler, BATCHES[7:])
    resumed = newest_by_name(model, wrapped)
    for n in uninterrupted:
        assert torch.equal(resumed[n], uninterrupted[n]), n


# ---- bad input -----------------------------------------------------------------------------------
def _bare() -> torch.optim.Optimizer:
    return torch.optim.AdamW(make_model().parameters(), lr=1e-3)


@pytest.mark.parametrize("delay", [-1, -3])
def test_negative_delay_is_rejected(delay: int) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        DelayedOptimizer(_bare(), delay=delay)


@pytest.mark.parametrize("delay", [1.5, 1.0, "1", None])
def test_non_integer_delay_is_rejected(delay) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        DelayedOptimizer(_bare(), delay=delay)


def test_negative_error_feedback_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"error_feedback.*>= 0"):
        DelayedOptimizer(_bare(), delay=1, error_feedback=-0.5)
    wrapped = DelayedOptimizer(_bare(), delay=1, error_feedback=1.0)
    with pytest.raises(ValueError, match=">= 0"):
        wrapped.error_feedback = -1.0
    with pytest.raises(ValueError, match="strength must be a number >= 0"):
        ErrorFeedbackCorrection(-0.1)


def test_error_feedback_needs_a_delay() -> None:
    with pytest.raises(ValueError, match="no delay source") as info:
        DelayedOptimizer(_bare(), delay=0, error_feedback=1.0)
    message = str(info.value)
    assert "delay >= 1" in message and "DelaySimulation" in message and "async_pipe" in message
    wrapped = DelayedOptimizer(_bare(), delay=0)
    with pytest.raises(ValueError, match="no delay source"):
        wrapped.error_feedback = 1.0


def test_unknown_pairing_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Unknown pairing 'gpipe'.*fifo.*2bw"):
        DelayedOptimizer(_bare(), delay=1, pairing="gpipe")


def test_wrapping_a_non_optimizer_is_rejected() -> None:
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer"):
        DelayedOptimizer(make_model().parameters(), delay=1)


@pytest.mark.parametrize("other", [dict(delay=2, pairing="2bw"), dict(delay=1, pairing="fifo")])
def test_load_state_dict_with_other_delay_settings_is_rejected(other: dict) -> None:
    model, wrapped, scheduler = build("adamw", 1, 1.0, "2bw")
    train(model, wrapped, scheduler, BATCHES[:3])
    state = wrapped.state_dict()
    _, fresh, _ = build("adamw", other["delay"], 1.0, other["pairing"])
    with pytest.raises(ValueError, match=r"saved with delay=1, pairing='2bw'.*Resume with the same delay settings"):
        fresh.load_state_dict(state)


def test_error_feedback_state_with_wrong_parameter_count_is_rejected() -> None:
    model, wrapped, scheduler = build("adamw", 1, 1.0, "2bw")
    train(model, wrapped, scheduler, BATCHES[:2])
    state = wrapped.correction.state_dict(wrapped.params)
    with pytest.raises(ValueError, match="buffers for"):
        ErrorFeedbackCorrection(1.0).load_state_dict(state, wrapped.params[:-1])


# ---- memory --------------------------------------------------------------------------------------
def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("pairing,delay", [("2bw", 1), ("2bw", 2), ("fifo", 1), ("fifo", 3)])
def test_memory_held(pairing: str, delay: int) -> None:
    model, wrapped, scheduler = build("adamw", delay, 1.0, pairing)
    train(model, wrapped, scheduler, BATCHES[:6])
    params = wrapped.params
    n = len(params)

    # Error Feedback: exactly `delay` parameter-sized buffers per parameter (one ring of the last `delay`
    # updates for the k-step form), nothing else
    correction = wrapped.correction
    buffers = (correction.previous_update if delay == 1 else correction.update_history).tensors
    assert len(buffers) == n and len(correction.buffers()) == n * (1 if delay == 1 else 2)
    assert all(buffers[p].shape == (*([delay] if delay > 1 else []), *p.shape) and buffers[p].dtype == p.dtype
               for p in params)
    assert len(_storages(buffers.values())) == n
    assert not (_storages(buffers.values()) & _storages(p.data for p in params))

    state = wrapped.state_dict()["delay"]
    if pairing == "2bw":
        rings = wrapped._rings
        assert all(len(r) == delay + 1 for r in rings) and all(len(r) == delay + 1 for r in state["rings"])
        held = [t for r in rings for t in r]
        assert len(_storages(held)) == (delay + 1) * n  # delay + 1 distinct weight copies...
        assert _storages(p.data for p in params) <= _storages(held)  # ...one of which the parameters show
        assert len(wrapped._grad_queue) == 0 and state["grad_queue"] == []
    else:
        assert len(wrapped._grad_queue) == delay and len(state["grad_queue"]) == delay
        assert all(len(grads) == n for grads in wrapped._grad_queue)
        assert wrapped._rings is None and state["rings"] is None


def test_no_error_feedback_no_buffer() -> None:
    model, wrapped, scheduler = build("adamw", 1, 0.0, "2bw")
    train(model, wrapped, scheduler, BATCHES[:3])
    assert wrapped.correction.buffers() == []


@pytest.mark.parametrize("pairing", ["2bw", "fifo"])
def test_gradient_buffers_are_owned(pairing: str) -> None:
    """After step() no parameter keeps a .grad: the wrapper owns the stale gradient it will apply."""
    model, wrapped, scheduler = build("adamw", 1, 0.0, pairing)
    loss_of(model, BATCHES[0]).backward()
    wrapped.step()
    assert all(p.grad is None for p in model.parameters())
