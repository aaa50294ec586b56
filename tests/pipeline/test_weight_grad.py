"""The split backward (zero-bubble ``I`` and ``W``): the input gradient at once, the linear layers' weight
gradients later, together exactly what one backward gives."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_async.pipeline.weight_grad import DeferredWeightGrads, SplitBackwardLinear, split_linear_backward


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 5, bias=False), nn.Tanh(), nn.Linear(5, 3))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_split_backward_equals_one_backward():
    plain, split = _model(), _model()
    assert split_linear_backward(split) == 3
    assert all(isinstance(m, nn.Linear) for m in split if isinstance(m, SplitBackwardLinear))
    assert copy.deepcopy(split).state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 4, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(2, 4, 3)
    plain(xa).backward(dy)

    deferred = DeferredWeightGrads()
    with deferred.collecting():
        split(xb).backward(dy)
    # I: the input gradient and every weight but the linear layers' matrices are there; those wait for W
    assert torch.allclose(xb.grad, xa.grad, atol=1e-6)
    waiting = {n for n, p in split.named_parameters() if p.grad is None}
    assert waiting == {"0.weight", "3.weight", "5.weight"} and len(deferred) == 3
    deferred.compute()
    got, want = _grads(split), _grads(plain)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6
    assert len(deferred) == 0


def test_outside_a_collection_the_layers_are_plain_linear():
    plain, split = _model(), _model()
    split_linear_backward(split)
    x = torch.randn(3, 6)
    split(x).sum().backward()
    plain(x).sum().backward()
    got, want = _grads(split), _grads(plain)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6


def test_deferred_gradients_accumulate_over_microbatches():
    plain, split = _model(), _model()
    split_linear_backward(split)
    chunks = torch.randn(4, 2, 6).unbind(0)
    collections = []
    for x in chunks:
        plain(x).pow(2).mean().backward()
        deferred = DeferredWeightGrads()
        with deferred.collecting():
            split(x).pow(2).mean().backward()
        collections.append(deferred)
    for deferred in reversed(collections):  # W may run in any order
        deferred.compute()
    got, want = _grads(split), _grads(plain)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-5


def test_bf16_autocast_matches_nn_linear():
    plain, split = _model(), _model()
    split_linear_backward(split)
    x = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yp, ys = plain(x), split(x)
    assert ys.dtype == yp.dtype == torch.bfloat16
    yp.float().sum().backward()
    deferred = DeferredWeightGrads()
    with deferred.collecting():
        ys.float().sum().backward()
    deferred.compute()
    got, want = _grads(split), _grads(plain)
    assert all(got[n].dtype == torch.float32 for n in got)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 2e-2  # bf16 products, summed in another order


@pytest.mark.parametrize("bias", [True, False])
def test_subclasses_are_left_alone(bias):
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(Custom(2, 2, bias=bias), nn.Linear(2, 2))
    assert split_linear_backward(model) == 1
    assert type(model[0]) is Custom and type(model[1]) is SplitBackwardLinear


def test_a_saved_tensors_hook_that_copies_keeps_the_deferred_gradients():
    """Under ``torch.autograd.graph.save_on_cpu`` (any hook whose unpacked tensors are copies) the deferred weight
    gradients land in the layers' own weights; they went into the unpacked copy of each weight, and were lost."""
    plain, split = _model(), _model()
    split_linear_backward(split)
    x, dy = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
    plain(x).backward(dy)
    deferred = DeferredWeightGrads()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone()), deferred.collecting():
        split(x).backward(dy)
    deferred.compute()
    got, want = _grads(split), _grads(plain)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6


def test_activation_checkpointing_keeps_the_deferred_gradients():
    """A piece recomputed in the backward (``activation_checkpointing``) under a split backward: the non-reentrant
    checkpoint unpacks the weight as another tensor than the layer's own, so the deferred gradients, accumulated into
    the unpacked one, were lost."""
    from lightning_async.pipeline.stage import PieceModule

    plain, split = _model(), _model()
    split_linear_backward(split)
    piece = PieceModule([(str(i), layer) for i, layer in enumerate(split)])
    x, dy = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
    plain(x).backward(dy)
    deferred = DeferredWeightGrads()
    with deferred.collecting():
        piece(x, recompute=True).backward(dy)
    deferred.compute()
    got, want = _grads(split), _grads(plain)
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6
