"""WeightSwap: a module computes with given weights exactly as under ``functional_call``, and gets its own back."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from lightning_async.pipeline.weight_swap import WeightSwap


class TiedNet(nn.Module):
    """An embedding whose weight is also the head's (one weight under two names) and a block with a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)) * self.scale)


def versions(module: nn.Module, count: int) -> tuple[list[str], dict[str, int], list[list[torch.Tensor]]]:
    """The module's distinct weights (names), every name's position, and ``count`` perturbed leaf copies."""
    named = dict(module.named_parameters())
    position = {id(p): i for i, p in enumerate(named.values())}
    index = {n: position[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
    slots = [[(p.detach() + 0.1 * k).requires_grad_(True) for p in named.values()] for k in range(count)]
    return list(named), index, slots


def test_forward_and_gradients_equal_functional_call_and_the_parameters_come_back():
    torch.manual_seed(0)
    net = TiedNet()
    names, index, slots = versions(net, 2)
    swap = WeightSwap(net, index)
    tokens = torch.randint(0, 11, (3, 5))
    own = [p for p in net.parameters()]
    for slot in slots:
        with swap.using(slot):
            out = net(tokens)
        out.square().mean().backward()
        reference = [t.detach().clone().requires_grad_(True) for t in slot]
        expected = functional_call(net, {n: reference[i] for n, i in index.items()}, (tokens,))
        expected.square().mean().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        for got, want in zip(slot, reference):  # the tied weight's two uses both land in its one tensor
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)
    assert list(net.parameters()) == own and all(p.grad is None for p in own)
    assert net.head.weight is net.embed.weight


def test_the_parameters_come_back_when_the_forward_raises():
    net = TiedNet()
    _, index, slots = versions(net, 1)
    own = dict(net.named_parameters(remove_duplicate=False))
    with pytest.raises(IndexError):
        with WeightSwap(net, index).using(slots[0]):
            net(torch.tensor([[99]]))  # out of the embedding's range
    assert {n: id(p) for n, p in net.named_parameters(remove_duplicate=False)} == {n: id(p) for n, p in own.items()}


def test_every_name_must_have_a_position():
    net = TiedNet()
    _, index, _ = versions(net, 1)
    del index["head.weight"]
    with pytest.raises(KeyError):
        WeightSwap(net, index)


def test_the_parameters_come_back_when_a_weight_list_is_too_short():
    net = TiedNet()
    _, index, slots = versions(net, 1)
    own = {n: id(p) for n, p in net.named_parameters(remove_duplicate=False)}
    with pytest.raises(IndexError):
        with WeightSwap(net, index).using(slots[0][:1]):
            pass
    assert {n: id(p) for n, p in net.named_parameters(remove_duplicate=False)} == own
