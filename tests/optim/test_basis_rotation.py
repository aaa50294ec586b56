"""Basis rotation's scope (Jung et al. 2026) in the zoo: ``soap`` with ``rotate="hidden"`` rotates the hidden
matrices only (SOAP's update there) and trains the embedding, the head and the 1-D parameters with AdamW;
``basis_rotation`` is that with their settings."""

from __future__ import annotations

import pytest
import torch
from pytorch_optimizer import SOAP

from lightning_async.optim.zoo import (
    BASIS_ROTATION_DEFAULTS,
    SOAP_DEFAULTS,
    UnknownOptimizerArgument,
    build_optimizer,
    group_parameters,
)
from workload import BATCHES, loss_of, make_model

pytestmark = pytest.mark.usefixtures("one_thread")

PAPER = {"betas": (0.9, 0.999), "shampoo_beta": 0.999, "precondition_frequency": 10}  # their run's settings


def test_only_the_hidden_matrices_are_rotated() -> None:
    model = make_model()
    opt = build_optimizer("soap", model.named_parameters(), lr=3e-3, weight_decay=0.1, rotate="hidden", **PAPER)
    soap, adamw = opt.optimizers
    groups = group_parameters(model.named_parameters())
    assert isinstance(soap, SOAP) and isinstance(adamw, torch.optim.AdamW)
    assert [p for g in soap.param_groups for p in g["params"]] == [p for _, p in groups["matrix"]]
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {
        id(p) for _, p in groups["embedding"] + groups["no_decay"]}
    decay = {g["kind"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"matrix": 0.1, "embedding": 0.1, "no_decay": 0.0}
    assert all(g["betas"] == (0.9, 0.999) and g["lr"] == 3e-3 for g in opt.param_groups)


def test_a_step_is_soap_on_the_matrices_and_adamw_on_the_rest() -> None:
    """Against the two libraries stepped separately over the same tensors (bit for bit)."""
    rotated, reference = make_model(), make_model()
    opt = build_optimizer("soap", rotated.named_parameters(), lr=3e-3, weight_decay=0.1, rotate="hidden")
    groups = group_parameters(reference.named_parameters())
    soap = SOAP([p for _, p in groups["matrix"]], lr=3e-3, weight_decay=0.1, **SOAP_DEFAULTS)
    adamw = torch.optim.AdamW([{"params": [p for _, p in groups["embedding"]], "weight_decay": 0.1},
                               {"params": [p for _, p in groups["no_decay"]], "weight_decay": 0.0}],
                              lr=3e-3, betas=SOAP_DEFAULTS["betas"], eps=SOAP_DEFAULTS["eps"])
    for batch in BATCHES[:12]:  # past SOAP's skipped first step and one basis refresh (every 10 steps)
        for model, optimizers in ((rotated, [opt]), (reference, [soap, adamw])):
            loss_of(model, batch).backward()
            for o in optimizers:
                o.step()
                o.zero_grad()
    for (n, a), (_, b) in zip(rotated.named_parameters(), reference.named_parameters()):
        assert torch.equal(a, b), n
    whole = make_model()
    everything = build_optimizer("soap", whole.named_parameters(), lr=3e-3, weight_decay=0.1)
    for batch in BATCHES[:12]:
        loss_of(whole, batch).backward()
        everything.step()
        everything.zero_grad()
    assert not torch.equal(whole.embed.weight, rotated.embed.weight)  # SOAP's own scope rotates the embedding too


def test_it_trains() -> None:
    model = make_model()
    opt = build_optimizer("soap", model.named_parameters(), lr=1e-2, weight_decay=0.1, rotate="hidden", **PAPER)
    batch = BATCHES[0]
    first = loss_of(model, batch).item()
    for _ in range(15):
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    assert loss_of(model, batch).item() < first - 0.5


def test_an_unknown_scope_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rotate must be 'all' \(SOAP\) or 'hidden'"):
        build_optimizer("soap", make_model().named_parameters(), lr=1e-3, rotate="embedding")


def _train(model, optimizer, batches) -> None:
    for batch in batches:
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_basis_rotation_is_soap_on_the_hidden_matrices_with_their_settings() -> None:
    """The zoo name equals ``soap`` + ``rotate="hidden"`` + the paper's settings bit for bit, and differs from
    ``rotate="hidden"`` with SOAP's own settings (so the defaults are the paper's, not SOAP's)."""
    assert BASIS_ROTATION_DEFAULTS == {**PAPER, "eps": 1e-8}
    named, spelled, soap_settings = make_model(), make_model(), make_model()
    _train(named, build_optimizer("basis_rotation", named.named_parameters(), lr=3e-3, weight_decay=0.1), BATCHES[:12])
    _train(spelled, build_optimizer("soap", spelled.named_parameters(), lr=3e-3, weight_decay=0.1, rotate="hidden",
                                    **PAPER), BATCHES[:12])
    _train(soap_settings, build_optimizer("soap", soap_settings.named_parameters(), lr=3e-3, weight_decay=0.1,
                                          rotate="hidden"), BATCHES[:12])
    for (n, a), (_, b) in zip(named.named_parameters(), spelled.named_parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(named.blocks[0].attn.q_proj.weight, soap_settings.blocks[0].attn.q_proj.weight)


def test_basis_rotation_takes_no_scope() -> None:
    with pytest.raises(UnknownOptimizerArgument, match="'basis_rotation' does not take rotate"):
        build_optimizer("basis_rotation", make_model().named_parameters(), lr=1e-3, rotate="all")
