"""The optimizer zoo: grouping, the composite Muon+AdamW optimizer, and parity of each library
optimizer with a few-line reference written from its paper's equations."""

from __future__ import annotations

import copy
import io
import logging
import math

import pytest
import torch
from torch import nn

from lightning_async.models import SmolLM2, model_config
from lightning_async.optim import DelayedOptimizer
from lightning_async.optim.zoo import (
    OPTIMIZER_NAMES,
    CompositeOptimizer,
    UnknownOptimizerArgument,
    build_optimizer,
    effective_learning_rates,
    group_parameters,
)

REQUIRED = ("adamw", "muon", "normuon", "adan", "soap", "lion", "mars")


# ---- helpers -------------------------------------------------------------------------------------
class Toy(nn.Module):
    """Two hidden matrices (one tall, one square), a norm gain and a bias: names like the real model."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(5, 5, generator=g) * 0.3)
        self.w2 = nn.Parameter(torch.randn(6, 4, generator=g) * 0.3)
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(5, generator=g))
        self.bias = nn.Parameter(0.1 * torch.randn(6, generator=g))

    def named_parameters(self, *args, **kwargs):  # stable, model-like names
        names = {"w1": "blocks.0.attn.q_proj.weight", "w2": "blocks.0.mlp.up_proj.weight",
                 "gain": "blocks.0.attn_norm.weight", "bias": "blocks.0.mlp.up_proj.bias"}
        for n, p in super().named_parameters(*args, **kwargs):
            yield names[n], p


def toy_grads(steps: int, seed: int = 1, scale: float = 1.0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 5), (6, 4), (5,), (6,)]
    return [[scale * torch.randn(*s, generator=g) for s in shapes] for _ in range(steps)]


def run_zoo(name: str, grads, lr: float, weight_decay: float = 0.1, **kwargs) -> list[torch.Tensor]:
    model = Toy()
    opt = build_optimizer(name, model.named_parameters(), lr=lr, weight_decay=weight_decay, **kwargs)
    params = [p for _, p in model.named_parameters()]
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def initial() -> list[torch.Tensor]:
    return [p.detach().clone() for _, p in Toy().named_parameters()]


def assert_all_close(ours, ref, rtol=1e-5, atol=1e-7):
    start = initial()
    for o, r, s in zip(ours, ref, start):
        assert not torch.equal(o, s)
        torch.testing.assert_close(o, r, rtol=rtol, atol=atol)


def lm_batch(seed: int = 0, vocab: int = 257) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(seed))


def lm_step(model: nn.Module, opt, seed: int) -> float:
    batch = lm_batch(seed)
    loss = nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def tiny_model(seed: int = 0, **overrides) -> SmolLM2:
    torch.manual_seed(seed)
    return SmolLM2(model_config("tiny", num_layers=2, hidden_size=64, ffn_size=128, **overrides))


# ---- API -----------------------------------------------------------------------------------------
def test_names_and_errors():
    assert set(REQUIRED) <= set(OPTIMIZER_NAMES)
    with pytest.raises(ValueError, match="Choose one of: adamw, muon"):
        build_optimizer("adam", Toy().named_parameters(), lr=1e-3)
    with pytest.raises(UnknownOptimizerArgument, match="momentom"):
        build_optimizer("muon", Toy().named_parameters(), lr=1e-3, momentom=0.9)
    with pytest.raises(TypeError, match="Valid keyword arguments: .*betas"):
        build_optimizer("lion", Toy().named_parameters(), lr=1e-3, gamma=0.1)  # MARS's knob, not Lion's
    with pytest.raises(ValueError):
        build_optimizer("normuon", Toy().named_parameters(), lr=1e-3, muon_impl="torch")
    with pytest.raises(TypeError, match="named_parameters"):
        build_optimizer("adamw", Toy().parameters(), lr=1e-3)


def test_a_model_refuses_an_unknown_optimizer_when_it_is_made():
    """Before: the name was first read in ``configure_optimizers``, after data preparation and the ranks' start."""
    from lightning_async.lm import CausalLM

    with pytest.raises(ValueError, match="Unknown optimizer 'adam'"):
        CausalLM(vocab_size=257, optimizer="adam")
    with pytest.raises(UnknownOptimizerArgument, match="momentom"):
        CausalLM(vocab_size=257, optimizer="muon", optimizer_kwargs={"momentom": 0.9})


def test_grouping_of_the_model():
    model = tiny_model()
    groups = group_parameters(model.named_parameters())
    names = {k: [n for n, _ in v] for k, v in groups.items()}
    assert names["embedding"] == ["embed.weight"]  # the tied head is the same tensor: listed once
    assert all(n.startswith("blocks.") and n.endswith("_proj.weight") for n in names["matrix"])
    assert len(names["matrix"]) == 2 * 7
    assert set(names["no_decay"]) == {n for n, p in model.named_parameters() if p.ndim == 1}
    total = sum(p.numel() for v in groups.values() for _, p in v)
    assert total == sum(p.numel() for p in model.parameters())  # parameters() de-duplicates too

    untied = tiny_model(tie_embeddings=False)
    emb = [n for n, _ in group_parameters(untied.named_parameters())["embedding"]]
    assert emb == ["embed.weight", "head.proj.weight"]
    # a LightningModule prefix and a pipeline stage's subset are grouped the same way
    stage = [(f"model.{n}", p) for n, p in untied.named_parameters() if n.startswith(("blocks.1", "head"))]
    g = group_parameters(stage)
    assert [n for n, _ in g["embedding"]] == ["model.head.proj.weight"]
    assert len(g["matrix"]) == 7 and len(g["no_decay"]) == 3


@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_muon_family_groups(name):
    model = tiny_model()
    opt = build_optimizer(name, model.named_parameters(), lr=0.02, weight_decay=0.1, adamw_lr=1e-3)
    assert isinstance(opt, CompositeOptimizer) and isinstance(opt, torch.optim.Optimizer)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert list(by_name) == [name, "adamw", "adamw_no_decay"]
    assert by_name[name]["lr"] == 0.02 and by_name[name]["weight_decay"] == 0.1 and by_name[name]["kind"] == "matrix"
    assert by_name["adamw"]["lr"] == 1e-3 and by_name["adamw"]["weight_decay"] == 0.1
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in by_name[name]["params"])
    assert by_name["adamw"]["params"] == [model.embed.weight]
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert isinstance(opt.optimizers[-1], torch.optim.AdamW)


@pytest.mark.parametrize("name", [n for n in OPTIMIZER_NAMES if n not in ("muon", "normuon")])
def test_plain_groups_decay_only_matrices(name):
    opt = build_optimizer(name, tiny_model().named_parameters(), lr=1e-3, weight_decay=0.1)
    for g in opt.param_groups:
        assert "lr" in g and "weight_decay" in g
        assert g["weight_decay"] == (0.1 if all(p.ndim >= 2 for p in g["params"]) else 0.0)


def test_non_matrix_routed_to_adamw_with_a_log_record(caplog):
    conv = nn.Parameter(torch.randn(4, 3, 3))  # a 3-D hidden weight: Muon cannot take it
    named = list(Toy().named_parameters()) + [("blocks.0.conv.weight", conv)]
    with caplog.at_level(logging.INFO, logger="lightning_async.optim.zoo"):
        opt = build_optimizer("muon", named, lr=0.02)
    assert any("blocks.0.conv.weight" in r.getMessage() for r in caplog.records)
    owner = [g["name"] for g in opt.param_groups if any(p is conv for p in g["params"])]
    assert owner == ["adamw"]
    conv.grad = torch.ones_like(conv)
    for _, p in named[:-1]:
        p.grad = torch.ones_like(p)
    opt.step()  # no crash


def test_torch_and_batched_muon_agree():
    grads = toy_grads(4)
    torch.testing.assert_close(
        run_zoo("muon", grads, lr=0.02, muon_impl="torch"), run_zoo("muon", grads, lr=0.02), rtol=0, atol=1e-4
    )


def test_effective_learning_rates():
    opt = build_optimizer("muon", tiny_model().named_parameters(), lr=0.02, adamw_lr=1e-3)
    rates = effective_learning_rates(opt)
    assert rates["adamw"] == rates["adamw_no_decay"] == 1e-3
    assert math.isclose(rates["muon/128x64"], 0.02 * math.sqrt(2))  # tall: sqrt(rows / cols)
    assert rates["muon/64x128"] == 0.02 and rates["muon"] in {0.02, 0.02 * math.sqrt(2)}
    wrapped = DelayedOptimizer(opt, delay=1)
    assert effective_learning_rates(wrapped) == rates
    opt = build_optimizer("muon", tiny_model().named_parameters(), lr=0.02, adjust_lr_fn="match_rms_adamw")
    assert math.isclose(effective_learning_rates(opt)["muon/32x64"], 0.02 * 0.2 * math.sqrt(64))


# ---- behaviour shared by every optimizer ---------------------------------------------------------
@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_weight_decay_form(name):
    """With zero gradients every update is zero, so one step is pure decay: p *= 1 - lr * wd."""
    model = Toy()
    lr, wd = 0.05, 0.3
    opt = build_optimizer(name, model.named_parameters(), lr=lr, weight_decay=wd, adamw_lr=lr) if name in ("muon", "normuon") \
        else build_optimizer(name, model.named_parameters(), lr=lr, weight_decay=wd)
    params = [p for _, p in model.named_parameters()]
    start = [p.detach().clone() for p in params]
    steps = 2 if name in ("soap", "basis_rotation") else 1  # SOAP skips its first step entirely (no decay either)
    # basis rotation's AdamW side (embedding, head) decays on both steps, its SOAP side on the second only
    adamw_side = {id(p) for _, p in group_parameters(model.named_parameters())["embedding"]} if name == "basis_rotation" else set()
    for _ in range(steps):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p, s in zip(params, start):
        expected = s * (1 - lr * wd) ** (steps if id(p) in adamw_side else 1) if p.ndim == 2 else s
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_gradients_not_modified_in_place(name):
    model = tiny_model()
    opt = build_optimizer(name, model.named_parameters(), lr=1e-3)
    for seed in range(2):
        batch = lm_batch(seed)
        nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        opt.zero_grad()


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_state_dict_round_trip_resumes_exactly(name):
    model = tiny_model()
    opt = build_optimizer(name, model.named_parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for seed in range(3):
        lm_step(model, opt, seed)
        sched.step()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    for seed in range(3, 6):
        lm_step(model, opt, seed)
        sched.step()

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = tiny_model(seed=1)
    resumed.load_state_dict(saved["model"])
    opt2 = build_optimizer(name, resumed.named_parameters(), lr=2e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    for seed in range(3, 6):
        lm_step(resumed, opt2, seed)
        sched2.step()
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]


def test_lambda_lr_reaches_every_child():
    model = tiny_model()
    opt = build_optimizer("muon", model.named_parameters(), lr=0.02, adamw_lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 if s == 0 else 0.0)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 5e-4, 5e-4]
    assert [g["initial_lr"] for g in opt.param_groups] == [0.02, 1e-3, 1e-3]
    assert [g["lr"] for c in opt.optimizers for g in c.param_groups] == [0.01, 5e-4, 5e-4]
    lm_step(model, opt, 0)
    sched.step()  # lr = 0 from now on: nothing may move, in any child
    before = [p.detach().clone() for p in model.parameters()]
    lm_step(model, opt, 1)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("pairing", ["fifo", "2bw"])
def test_composite_under_delay_and_error_feedback(pairing):
    model = tiny_model()
    opt = DelayedOptimizer(build_optimizer("normuon", model.named_parameters(), lr=0.02), delay=1, error_feedback=1.0, pairing=pairing)
    losses = [lm_step(model, opt, seed % 2) for seed in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    state = copy.deepcopy(opt.state_dict())
    assert len(state["delay"]["correction"]["previous_update"]) == len(list(model.parameters()))


# ---- parity with the papers' equations -----------------------------------------------------------
def adam_denominator(v, t, b2, eps, mars_eps=False):
    """sqrt(v_hat) + eps; pytorch-optimizer's MARS uses (sqrt(v + 1e-15) + eps) / sqrt(1 - b2^t) instead,
    which differs only where sqrt(v) is within a few eps of zero (we hit one such element here)."""
    if mars_eps:
        return ((v + 1e-15).sqrt() + eps) / math.sqrt(1 - b2**t)
    return (v / (1 - b2**t)).sqrt() + eps


def reference_adamw(grads, lr, wd, betas=(0.9, 0.95), eps=1e-8, decay_mask=(True, True, False, False), mars_eps=False):
    b1, b2 = betas
    params = initial()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            decay = lr * wd if decay_mask[i] else 0.0
            params[i] = p * (1 - decay) - lr * (m[i] / (1 - b1**t)) / adam_denominator(v[i], t, b2, eps, mars_eps)
    return params


def test_adamw_parity():
    """Loshchilov & Hutter 2019: Adam moments with bias correction, decay decoupled from the update."""
    grads = toy_grads(5)
    assert_all_close(run_zoo("adamw", grads, lr=0.01, weight_decay=0.1, foreach=False), reference_adamw(grads, 0.01, 0.1))
    assert_all_close(run_zoo("adamw", grads, lr=0.01, weight_decay=0.1), reference_adamw(grads, 0.01, 0.1))


def test_adan_parity():
    """Xie et al. 2022, Alg. 1 with bias correction; library betas are 1 - the paper's; g_0 = g_1."""
    grads = toy_grads(5)
    lr, wd, (b1, b2, b3), eps = 0.01, 0.1, (0.98, 0.92, 0.99), 1e-8
    params = initial()
    state = [dict(m=torch.zeros_like(p), v=torch.zeros_like(p), n=torch.zeros_like(p), prev=None) for p in params]
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            s = state[i]
            diff = g - (g if s["prev"] is None else s["prev"])
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * diff
            s["n"] = b3 * s["n"] + (1 - b3) * (g + b2 * diff) ** 2
            denom = (s["n"] / (1 - b3**t)).sqrt() + eps
            update = (s["m"] / (1 - b1**t) + b2 * s["v"] / (1 - b2**t)) / denom
            decay = lr * wd if p.ndim == 2 else 0.0
            params[i] = p * (1 - decay) - lr * update
            s["prev"] = g
    assert_all_close(run_zoo("adan", grads, lr=lr, weight_decay=wd), params)
    assert_all_close(run_zoo("adan", grads, lr=lr, weight_decay=wd, foreach=False), params)


def test_lion_parity():
    """Chen et al. 2023, Alg. 2: sign of the interpolation, then the momentum update."""
    grads = toy_grads(5)
    lr, wd, b1, b2 = 1e-3, 0.5, 0.9, 0.99
    params = initial()
    m = [torch.zeros_like(p) for p in params]
    for step_grads in grads:
        for i, (p, g) in enumerate(zip(params, step_grads)):
            c = b1 * m[i] + (1 - b1) * g
            decay = lr * wd if p.ndim == 2 else 0.0
            params[i] = p * (1 - decay) - lr * torch.sign(c)
            m[i] = b2 * m[i] + (1 - b2) * g
    assert_all_close(run_zoo("lion", grads, lr=lr, weight_decay=wd), params, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [1.0, 0.01])  # corrected gradient clipped to norm 1 / not clipped
def test_mars_parity(scale):
    """Yuan et al. 2024, MARS-AdamW, approximate variant (Alg. 2: g(x_{t-1}) of the previous batch,
    with g_0 = 0 as the library and the official code start); 1-D tensors get AdamW with betas_1d."""
    grads = toy_grads(5, scale=scale)
    lr, wd, (b1, b2), gamma, eps = 3e-3, 0.1, (0.95, 0.99), 0.025, 1e-8
    params = initial()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    prev = [torch.zeros_like(p) for p in params]
    adam_1d = reference_adamw(grads, lr, 0.0, betas=(0.9, 0.95), decay_mask=(False,) * 4, mars_eps=True)
    for t, step_grads in enumerate(grads, start=1):
        for i, (p, g) in enumerate(zip(params, step_grads)):
            if p.ndim < 2:
                continue
            c = g + gamma * b1 / (1 - b1) * (g - prev[i])
            if c.norm() > 1:
                c = c / c.norm()
            m[i] = b1 * m[i] + (1 - b1) * c
            v[i] = b2 * v[i] + (1 - b2) * c * c
            update = (m[i] / (1 - b1**t)) / adam_denominator(v[i], t, b2, eps, mars_eps=True)
            params[i] = p * (1 - lr * wd) - lr * update
            prev[i] = g
    params[2:] = adam_1d[2:]
    assert_all_close(run_zoo("mars", grads, lr=lr, weight_decay=wd), params, rtol=1e-4, atol=1e-6)


def test_soap_parity():
    """Vyas et al. 2024, Alg. 1: Adam in the eigenbasis of Shampoo's L = E[G G^T], R = E[G^T G].

    Within ``precondition_frequency`` steps the basis is the eigh of the first gradient's statistics,
    so a 4-step reference needs no QR refresh. The first step only collects statistics (no update,
    no decay); the first moment lives in the original space and is projected each step; the decay is
    applied after the update (``p = (p - s u)(1 - lr wd)``). Square matrices keep eigenvalues simple
    (a rectangular first gradient makes G^T G rank-deficient and its eigenbasis arbitrary)."""
    g = torch.Generator().manual_seed(3)
    grads = [[torch.randn(5, 5, generator=g), torch.randn(5, generator=g)] for _ in range(4)]
    lr, wd, (b1, b2), eps = 3e-3, 0.1, (0.95, 0.95), 1e-8

    def build():
        gen = torch.Generator().manual_seed(0)
        return [nn.Parameter(torch.randn(5, 5, generator=gen)), nn.Parameter(torch.randn(5, generator=gen))]

    model_params = build()
    named = [("blocks.0.attn.q_proj.weight", model_params[0]), ("blocks.0.attn_norm.weight", model_params[1])]
    opt = build_optimizer("soap", named, lr=lr, weight_decay=wd)
    for t, step_grads in enumerate(grads, start=1):
        for p, gr in zip(model_params, step_grads):
            p.grad = gr.clone()
        opt.step()
        if t == 1:
            assert all(torch.equal(p, s) for p, s in zip(model_params, build()))  # the skipped first step

    w, bias = [p.detach().clone() for p in build()]
    g0 = grads[0][0]
    L, R = (1 - b2) * g0 @ g0.T, (1 - b2) * g0.T @ g0
    QL, QR = (torch.linalg.eigh(M)[1].flip(1) for M in (L, R))
    m, v = torch.zeros(5, 5), torch.zeros(5, 5)
    m1, v1 = torch.zeros(5), torch.zeros(5)
    for t in range(1, 4):  # the library's internal step counter starts at 1 on the second call
        gw, gb = grads[t]
        m = b1 * m + (1 - b1) * gw
        v = b2 * v + (1 - b2) * (QL.T @ gw @ QR) ** 2
        update = QL @ ((QL.T @ m @ QR) / (v.sqrt() + eps)) @ QR.T
        m1 = b1 * m1 + (1 - b1) * gb
        v1 = b2 * v1 + (1 - b2) * gb**2
        step = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        w = (w - step * update) * (1 - lr * wd)
        bias = bias - step * m1 / (v1.sqrt() + eps)
    torch.testing.assert_close(model_params[0].detach(), w, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model_params[1].detach(), bias, rtol=1e-5, atol=1e-7)


# ---- recipes -------------------------------------------------------------------------------------
RECIPES = sorted((__import__("pathlib").Path(__file__).parents[2] / "recipes" / "optimizers").glob("*.yaml"))


def test_every_optimizer_has_a_recipe():
    assert {p.stem for p in RECIPES} >= set(REQUIRED)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_builds(path):
    yaml = pytest.importorskip("yaml")
    model_cfg = yaml.safe_load(path.read_text())["model"]
    assert model_cfg["optimizer"] == path.stem
    opt = build_optimizer(
        model_cfg["optimizer"], tiny_model().named_parameters(), lr=model_cfg["lr"],
        weight_decay=model_cfg["weight_decay"], **model_cfg.get("optimizer_kwargs", {}),
    )
    assert opt.param_groups[0]["lr"] == model_cfg["lr"]
