"""The staleness corrections and delay profiles against an independent reference of each rule.

The reference shares no code with ``lightning_async.optim``: it keeps the list of weight snapshots
``x(0), x(1), ...``, evaluates each batch at the weights the rule says (per parameter: its own delay, or the
predicted weights), and gets the bare optimizer's update ``u`` by stepping a separate model at the newest
weights. Then it applies each correction's formula (docs/delay.md) itself:

* ``ef``:                ``x <- x - u - lam (u - u_(t-k))`` for a parameter ``k`` steps stale (``u_prev`` at ``k = 1``)
* ``adaptive-ef``:       the same with ``lam = clamp(c / s, 0, cap)``, ``c``, ``s`` running means of
                         ``<d_t, d_(t-1)>`` and ``|d_(t-1)|^2`` per tensor, ``d_t = u_t - u_(t-1)``
* ``nesterov``:          ``v <- b v + (1 - b) u``, ``x <- x - u - g (v - v_prev)``
* ``dc-asgd``:           ``g <- g + lam g^2 (x_new - x_stale) / sqrt(ms + eps)``, ``ms <- m ms + (1 - m) g^2``
* ``weight-prediction``: the batch is evaluated at ``x(t-k) + s k (x(t-k) - x(t-k-1))``
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from lightning_async.optim import DelayedOptimizer, build_correction
from lightning_async.optim.corrections import CORRECTIONS, UpdateCorrection
from lightning_async.pipeline.profiles import parameter_delays, unit_delays
from workload import BATCHES, STEPS, lr_lambda, loss_of, make_model, make_optimizer, max_diff, snapshot

pytestmark = [
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),
    pytest.mark.usefixtures("one_thread"),
]

TOL = 1e-6
OPTIONS = {
    "ef": {"strength": 1.0},
    "adaptive-ef": {"strength": 1.0, "decay": 0.9},
    "nesterov": {"strength": 1.0, "momentum": 0.8},
    "dc-asgd": {"strength": 2.0, "adaptive": True, "mean_square_decay": 0.9, "eps": 1e-7},
    "weight-prediction": {"strength": 1.0},
}


# ---- the independent reference -------------------------------------------------------------------
def reference(name: str, method: str | None, delays: dict[str, int], steps: int = STEPS, **options):
    """Weight snapshots ``x(0..T)`` by name, and the weights each batch was evaluated at."""
    evaluator, stepper = make_model(), make_model()
    optimizer = make_optimizer(name, stepper)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    by_param = {p: n for n, p in stepper.named_parameters()}
    evaluator_params, stepper_params = dict(evaluator.named_parameters()), dict(stepper.named_parameters())
    history = [snapshot(stepper)]
    evaluated = []
    state: dict[str, dict] = {key: {} for key in ("u", "d", "c", "s", "lam", "v", "ms", "applied")}
    strength = options.get("strength", 0.0)

    for t, batch in enumerate(BATCHES[:steps]):
        forward = {}
        for n, k in delays.items():
            x = history[max(t - k, 0)][n]
            if method == "weight-prediction" and k:
                x = x + strength * k * (x - history[max(t - k - 1, 0)][n])
            forward[n] = x
        evaluated.append(forward)
        with torch.no_grad():
            for n, p in evaluator_params.items():
                p.copy_(forward[n])
                p.grad = None
        loss_of(evaluator, batch).backward()
        grads = {n: p.grad.clone() for n, p in evaluator_params.items()}
        newest = history[-1]
        if method == "dc-asgd":
            m, eps = options["mean_square_decay"], options["eps"]
            for n, g in grads.items():
                ms = m * state["ms"].get(n, torch.zeros_like(g)) + (1 - m) * g * g
                state["ms"][n] = ms
                if delays[n]:
                    grads[n] = g + strength * g * g / torch.sqrt(ms + eps) * (newest[n] - forward[n])
        with torch.no_grad():
            for n, p in stepper_params.items():
                p.copy_(newest[n])
                p.grad = grads[n]
        optimizer.step()
        following = {}
        with torch.no_grad():
            for p in stepper.parameters():
                n = by_param[p]
                u = newest[n] - p
                extra = torch.zeros_like(u)
                applied = state["applied"].setdefault(n, [])
                if delays[n] and method == "ef":  # the k-step form: the update of k steps ago (zero before one)
                    k = 1 if options.get("k_step") is False else delays[n]
                    extra = strength * (u - (applied[-k] if len(applied) >= k else torch.zeros_like(u)))
                elif delays[n] and method == "nesterov":
                    b = options["momentum"]
                    v_prev = state["v"].get(n, torch.zeros_like(u))
                    v = b * v_prev + (1 - b) * u
                    extra = strength * (v - v_prev)
                    state["v"][n] = v
                elif delays[n] and method == "adaptive-ef":
                    extra = adaptive_step(state, n, u, strength, options["decay"])
                state["u"][n] = u
                applied.append(u)
                following[n] = p.detach() - extra
                p.grad = None
        history.append(following)
        scheduler.step()
    return history, evaluated


def adaptive_step(state: dict, n: str, u: torch.Tensor, cap: float, beta: float) -> torch.Tensor:
    """The adaptive-EF displacement ``lam * d`` for tensor ``n`` (updates its statistics in ``state``)."""
    d = u - state["u"][n] if n in state["u"] else u
    lam = state["lam"].get(n, 0.0)
    if n in state["d"]:
        prev = state["d"][n]
        c = beta * state["c"].get(n, 0.0) + (1 - beta) * float((d * prev).sum())
        s = beta * state["s"].get(n, 0.0) + (1 - beta) * float((prev * prev).sum())
        state["c"][n], state["s"][n] = c, s
        lam = min(max(c / s if s > 0 else 0.0, 0.0), cap)
        state["lam"][n] = lam
    if n in state["u"]:
        state["d"][n] = d
    return lam * d


# ---- the library under test ----------------------------------------------------------------------
def library(name: str, method: str | None, delays: dict[str, int] | int = 1, steps: int = STEPS, pairing="2bw",
            seed: int = 0, **options):
    model = make_model(seed)
    optimizer = make_optimizer(name, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    named = dict(model.named_parameters())
    per_param = {named[n]: k for n, k in delays.items()} if isinstance(delays, dict) else None
    wrapped = DelayedOptimizer(
        optimizer, delay=1 if per_param is None else 0, pairing=pairing, parameter_delays=per_param,
        correction=build_correction(method, **options) if method else None,
    )
    shown = []
    for batch in BATCHES[:steps]:
        shown.append(snapshot(model))
        loss_of(model, batch).backward()
        wrapped.step()
        wrapped.zero_grad()
        scheduler.step()
    return model, wrapped, shown


def newest_by_name(model, wrapped: DelayedOptimizer) -> dict[str, torch.Tensor]:
    newest = {id(p): w for p, w in zip(wrapped.params, wrapped.newest_weights())}
    return {n: newest[id(p)].detach().clone() for n, p in model.named_parameters()}


def uniform(delay: int = 1) -> dict[str, int]:
    return {n: delay for n, _ in make_model().named_parameters()}


# ---- every correction follows its formula --------------------------------------------------------
CASES = [(method, name) for method in CORRECTIONS for name in ("adamw", "muon", "lion")]


@pytest.mark.parametrize("method,name", CASES)
def test_correction_matches_its_reference(method: str, name: str) -> None:
    options = OPTIONS[method]
    history, evaluated = reference(name, method, uniform(), **options)
    model, wrapped, shown = library(name, method, **options)
    tol = 2e-5 if method == "adaptive-ef" else TOL
    assert max_diff(newest_by_name(model, wrapped), history[-1]) <= tol
    for t in (1, STEPS // 2, STEPS - 1):  # the weights each batch was evaluated at
        assert max_diff(shown[t], evaluated[t]) <= tol, f"batch {t}"


@pytest.mark.parametrize("method", list(CORRECTIONS))
def test_each_correction_changes_the_trajectory(method: str) -> None:
    """Negative control: the comparison above would notice a correction that does nothing."""
    plain, _ = reference("adamw", None, uniform())
    corrected, _ = reference("adamw", method, uniform(), **OPTIONS[method])
    assert max_diff(plain[-1], corrected[-1]) > 1e-6


def test_nesterov_without_momentum_is_error_feedback() -> None:
    ef_model, ef, _ = library("adamw", "ef", strength=0.7)
    ne_model, ne, _ = library("adamw", "nesterov", strength=0.7, momentum=0.0)
    a, b = newest_by_name(ef_model, ef), newest_by_name(ne_model, ne)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("method", ["ef", "adaptive-ef", "nesterov", "dc-asgd"])
def test_zero_strength_is_the_plain_delay(method: str) -> None:
    plain_model, plain, _ = library("adamw", None)
    off_model, off, _ = library("adamw", method, **{**OPTIONS[method], "strength": 0.0})
    a, b = newest_by_name(plain_model, plain), newest_by_name(off_model, off)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert off.correction.buffers() == []


# ---- adaptive EF chooses its strength from the update sequence -----------------------------------
def _fed_updates(updates: list[torch.Tensor], cap: float = 1.0) -> DelayedOptimizer:
    """SGD(lr=1) on one parameter: the update applied at step t is the gradient fed at step t - 1."""
    p = torch.nn.Parameter(torch.zeros(64))
    wrapped = DelayedOptimizer(torch.optim.SGD([p], lr=1.0), delay=1, pairing="fifo",
                               correction=build_correction("adaptive-ef", strength=cap, decay=0.5))
    for u in updates:
        p.grad = u.clone()
        wrapped.step()
    return wrapped


def test_adaptive_strength_follows_a_trend_and_ignores_sign_noise() -> None:
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=g)
    trending = [(t + 1) * direction for t in range(30)]  # d_t constant: extrapolation is exact
    assert _fed_updates(trending).correction.statistics()["strength"] == pytest.approx(1.0)
    assert _fed_updates(trending, cap=0.4).correction.statistics()["strength"] == pytest.approx(0.4)
    flips = [torch.sign(torch.randn(64, generator=g)) for _ in range(30)]  # Lion-like: d_t anti-correlated
    assert _fed_updates(flips).correction.statistics()["strength"] == 0.0
    assert _fed_updates(trending[:2]).correction.statistics()["strength"] == 0.0  # needs two differences first


# ---- delay profiles ------------------------------------------------------------------------------
def pipedream_delays(stages: int) -> dict[str, int]:
    model = make_model()
    units = list(model.pipeline_units())
    by_param = parameter_delays(units, unit_delays(units, "pipedream", stages, delay=1))
    return {n: by_param[p] for n, p in model.named_parameters()}


def test_uniform_profile_is_the_uniform_delay() -> None:
    model, wrapped, _ = library("adamw", "ef", delays=1, strength=1.0)
    profiled, wrapped_profiled, _ = library("adamw", "ef", delays=uniform(1), strength=1.0)
    a, b = newest_by_name(model, wrapped), newest_by_name(profiled, wrapped_profiled)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("pairing", ["2bw", "fifo"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_pipedream_profile_matches_reference(name: str, pairing: str) -> None:
    """Each unit's weights see exactly their own delay (stage s of 4: 3 - s steps; the tied embedding 3)."""
    delays = pipedream_delays(4)
    assert sorted(set(delays.values())) == [0, 1, 2, 3]
    assert delays["embed.weight"] == 3 and delays["head.norm.weight"] == 0
    if pairing == "fifo":
        expected = reference_fifo(name, delays)
    else:
        history, evaluated = reference(name, None, delays)
        expected = history[-1]
    model, wrapped, shown = library(name, None, delays=delays, pairing=pairing)
    assert max_diff(newest_by_name(model, wrapped), expected) <= TOL
    if pairing == "2bw":
        for t in range(STEPS):
            assert max_diff(shown[t], evaluated[t]) <= TOL, f"batch {t}"
    uniform_model, uniform_wrapped, _ = library(name, None, delays=1, pairing=pairing)
    assert max_diff(newest_by_name(uniform_model, uniform_wrapped), expected) > 1e-5  # the profile matters


def reference_fifo(name: str, delays: dict[str, int]) -> dict[str, torch.Tensor]:
    """Gradient FIFO per parameter: the gradient of step t (at the current weights) reaches parameter n at
    step t + k_n; a parameter with no gradient old enough is not stepped."""
    model = make_model()
    optimizer = make_optimizer(name, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    named = dict(model.named_parameters())
    queue = []
    for t, batch in enumerate(BATCHES):
        for p in named.values():
            p.grad = None
        loss_of(model, batch).backward()
        queue.append({n: p.grad.clone() for n, p in named.items()})
        for n, p in named.items():
            k = delays[n]
            p.grad = queue[t - k][n] if t >= k else None
        optimizer.step()
        scheduler.step()
    return snapshot(model)


@pytest.mark.parametrize("method", ["weight-prediction", "ef"])
def test_corrections_use_each_parameters_own_delay(method: str) -> None:
    """Weight prediction extrapolates over each unit's own delay; EF takes its k-step form (``u(t-k)``)."""
    delays = pipedream_delays(4)
    history, evaluated = reference("adamw", method, delays, strength=1.0)
    model, wrapped, shown = library("adamw", method, delays=delays, strength=1.0)
    assert max_diff(newest_by_name(model, wrapped), history[-1]) <= TOL
    assert all(max_diff(shown[t], evaluated[t]) <= TOL for t in range(STEPS))
    if method == "ef":  # the stalest unit (the embedding, 3 steps) keeps a ring of its last 3 updates
        assert wrapped.correction.update_history.tensors[dict(model.named_parameters())["embed.weight"]].shape[0] == 3


# ---- Error Feedback for k-step delays -------------------------------------------------------------
class FormerErrorFeedback(UpdateCorrection):
    """The one-step EF as it was before the k-step form, ``x <- x - u - lam (u - u_prev)`` for every delayed
    parameter, in the same floating-point operations: the bit-for-bit oracle of the k = 1 case."""

    method = "former-ef"

    def __init__(self, strength: float) -> None:
        super().__init__(strength)
        self.previous = {}

    def _correct_chunk(self, params, updates) -> None:
        previous = [self.previous.get(p, torch.zeros_like(p)) for p in params]
        torch._foreach_sub_(params, torch._foreach_sub(updates, previous), alpha=self.strength)
        self.previous.update(zip(params, updates))


def run_with(correction, delays, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = make_model()
    named = dict(model.named_parameters())
    wrapped = DelayedOptimizer(make_optimizer("adamw", model), delay=0, pairing="2bw",
                               parameter_delays={named[n]: k for n, k in delays.items()}, correction=correction)
    for batch in BATCHES[:steps]:
        loss_of(model, batch).backward()
        wrapped.step()
        wrapped.zero_grad()
    return newest_by_name(model, wrapped)


@pytest.mark.parametrize("profile", ["uniform-1", "pipedream-4"])
def test_one_step_error_feedback_is_bit_for_bit_the_former_rule(profile: str) -> None:
    """k = 1 (2BW's delay) takes the former code path exactly; ``k_step=False`` is the former rule under any
    profile; and under PipeDream's profile the k-step form really differs from it."""
    delays = uniform(1) if profile == "uniform-1" else pipedream_delays(4)
    former = run_with(FormerErrorFeedback(0.8), delays)
    rule = build_correction("ef", strength=0.8, k_step=profile == "uniform-1")
    assert all(torch.equal(former[n], t) for n, t in run_with(rule, delays).items())
    if profile == "pipedream-4":
        assert max_diff(run_with(build_correction("ef", strength=0.8), delays), former) > 1e-5


def test_k_step_error_feedback_resumes_exactly() -> None:
    delays = pipedream_delays(4)
    uninterrupted = run_with(build_correction("ef"), delays)
    model = make_model()
    named = dict(model.named_parameters())
    per_param = {named[n]: k for n, k in delays.items()}

    def wrap(m):
        return DelayedOptimizer(make_optimizer("adamw", m), delay=0, pairing="2bw", parameter_delays=per_param,
                                correction=build_correction("ef"))

    wrapped = wrap(model)
    for t, batch in enumerate(BATCHES):
        if t == 7:  # round-trip model and optimizer through a checkpoint into fresh objects' state
            state = {"model": model.state_dict(), "optimizer": wrapped.state_dict()}
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
            model.load_state_dict(state["model"])
            wrapped = wrap(model)
            wrapped.load_state_dict(state["optimizer"])
        loss_of(model, batch).backward()
        wrapped.step()
        wrapped.zero_grad()
    assert all(torch.equal(uninterrupted[n], t) for n, t in newest_by_name(model, wrapped).items())


def quadratic_tracking_error(delays: tuple[int, int], correction=None, steps: int = 300, lr: float = 0.02) -> float:
    """SGD on ``f(x) = sum_i h_i x_i^2 / 2`` (curvatures ``h`` in [0.2, 2]) in two parameter groups of their own
    delays: the mean relative distance, after the first ``2 max(k)`` steps, between the weights each gradient is
    taken at and the undelayed iterate ``(1 - lr h)^t x0`` of the same step."""
    g = torch.Generator().manual_seed(0)
    curvatures = [torch.linspace(0.5, 2.0, 8, dtype=torch.float64), torch.linspace(0.2, 1.0, 8, dtype=torch.float64)]
    starts = [torch.randn(8, generator=g, dtype=torch.float64) for _ in curvatures]
    params = [torch.nn.Parameter(x.clone()) for x in starts]
    wrapped = DelayedOptimizer(torch.optim.SGD(params, lr=lr), delay=0, pairing="2bw",
                               parameter_delays=dict(zip(params, delays)), correction=correction)
    errors = []
    for t in range(steps):
        undelayed = torch.cat([(1 - lr * h) ** t * x0 for h, x0 in zip(curvatures, starts)])
        shown = torch.cat([p.detach() for p in params])  # the weights this step's gradient is taken at
        if t >= 2 * max(delays):
            errors.append(((shown - undelayed).norm() / undelayed.norm()).item())
        sum(0.5 * (h * p * p).sum() for h, p in zip(curvatures, params)).backward()
        wrapped.step()
        wrapped.zero_grad()
    return sum(errors) / len(errors)


def test_k_step_error_feedback_tracks_the_undelayed_quadratic() -> None:
    """With per-group delays 2 and 5, the k-step form keeps the gradients' weights on the undelayed trajectory
    (the plain delay and the one-step rule do not: each would fail the first assertion)."""
    plain = quadratic_tracking_error((2, 5))
    one_step = quadratic_tracking_error((2, 5), build_correction("ef", k_step=False))
    k_step = quadratic_tracking_error((2, 5), build_correction("ef"))
    assert k_step < 0.25 * min(plain, one_step)
    assert one_step < plain  # the one-step rule helps a little, the k-step form most


# ---- checkpoints, memory, bad input --------------------------------------------------------------
@pytest.mark.parametrize("method", list(CORRECTIONS))
def test_resume_is_exact(method: str) -> None:
    options = OPTIONS[method]
    model, wrapped, _ = library("adamw", method, **options)
    uninterrupted = newest_by_name(model, wrapped)

    model, wrapped, _ = library("adamw", method, steps=7, **options)
    scheduler = torch.optim.lr_scheduler.LambdaLR(wrapped.optimizer, lr_lambda)
    scheduler.last_epoch = 6
    scheduler.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": wrapped.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model = make_model(seed=123)  # other weights: all must come from the state
    optimizer = make_optimizer("adamw", model)
    wrapped = DelayedOptimizer(optimizer, delay=1, pairing="2bw", correction=build_correction(method, **options))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    model.load_state_dict(state["model"])
    wrapped.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    for batch in BATCHES[7:]:
        loss_of(model, batch).backward()
        wrapped.step()
        wrapped.zero_grad()
        scheduler.step()
    resumed = newest_by_name(model, wrapped)
    assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)


BUFFERS = {"ef": 1, "adaptive-ef": 2, "nesterov": 1, "dc-asgd": 1, "weight-prediction": 1}


@pytest.mark.parametrize("method", list(CORRECTIONS))
def test_memory_is_what_the_docs_say(method: str) -> None:
    model, wrapped, _ = library("adamw", method, steps=4, **OPTIONS[method])
    params = list(model.parameters())
    sized = [t for t in wrapped.correction.buffers() if t.dim() > 0]
    assert sum(t.numel() for t in sized) == BUFFERS[method] * sum(p.numel() for p in params)
    storages = {t.untyped_storage().data_ptr() for t in sized}
    assert len(storages) == len(sized)  # no buffer shares storage with another...
    assert not storages & {p.untyped_storage().data_ptr() for r in wrapped._rings for p in r}  # ...or a weight version


@pytest.mark.parametrize("method", ["dc-asgd", "weight-prediction"])
def test_corrections_needing_versions_refuse_a_fifo(method: str) -> None:
    with pytest.raises(ValueError, match=rf"'{method}' correction reads the weight versions.*pairing='2bw'"):
        DelayedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), delay=1, pairing="fifo",
                         correction=build_correction(method))


def test_correction_without_delay_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'nesterov' correction corrects a delayed update.*delay >= 1"):
        DelayedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), delay=0,
                         correction=build_correction("nesterov"))


def test_bad_correction_names_and_options() -> None:
    with pytest.raises(ValueError, match=r"Unknown correction 'dcasgd'.*none, ef, adaptive-ef, nesterov, dc-asgd"):
        build_correction("dcasgd")
    with pytest.raises(ValueError, match=r"Correction 'nesterov'.*beta.*options are: strength, momentum"):
        build_correction("nesterov", beta=0.9)
    with pytest.raises(ValueError, match="momentum must be in"):
        build_correction("nesterov", momentum=1.0)
    with pytest.raises(ValueError, match="strength must be a number >= 0"):
        build_correction("dc-asgd", strength=-1)
    assert build_correction("none") is None


def test_resume_with_another_correction_is_refused() -> None:
    _, wrapped, _ = library("adamw", "ef", steps=3, strength=1.0)
    state = wrapped.state_dict()
    _, other, _ = library("adamw", "nesterov", steps=0)
    with pytest.raises(ValueError, match="checkpoint's correction is 'ef', this run's is 'nesterov'"):
        other.load_state_dict(state)


def test_profile_errors_name_the_fix() -> None:
    units = list(make_model().pipeline_units())
    with pytest.raises(ValueError, match="needs the number of stages"):
        unit_delays(units, "pipedream", None, 1)
    with pytest.raises(ValueError, match="lists 3 per-stage delays for 4 stages"):
        unit_delays(units, [2, 1, 0], 4, 1)
    with pytest.raises(ValueError, match=r"unknown unit\(s\) \['blocks.9'\]"):
        unit_delays(units, {"blocks.9": 2}, None, 1)
    with pytest.raises(ValueError, match="Unknown delay profile 'zigzag'"):
        unit_delays(units, "zigzag", 4, 1)
    with pytest.raises(ValueError, match="Cannot split 4 pipeline units into 8 stages"):
        unit_delays(units, "pipedream", 8, 1)
    assert math.isfinite(sum(unit_delays(units, {"blocks.0": 2}, None, 1).values()))
