"""The tiny single-device workload the update-rule tests share: a 2-layer SmolLM2-style decoder, random
token batches, the zoo's optimizers at fixed learning rates, and comparison helpers."""

from __future__ import annotations

import torch

from lightning_async.models import SmolLM2, model_config
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim.zoo import build_optimizer

SHAPE = dict(vocab_size=257, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=64, max_seq_len=64)
# fp32 Newton-Schulz: exact comparisons need it (bf16 would turn 1e-7 differences into 1e-3).
KWARGS = {"muon": {"ns_dtype": torch.float32}, "normuon": {"ns_dtype": torch.float32}}
LRS = {"adamw": 3e-3, "muon": 2e-2, "normuon": 2e-2, "adan": 3e-3, "soap": 3e-3, "lion": 3e-4, "mars": 3e-3,
       "asyncpp": 3e-3, "basis_rotation": 3e-3}
WEIGHT_DECAY = 0.1
STEPS = 20


def make_model(seed: int = 0) -> SmolLM2:
    torch.manual_seed(seed)
    return SmolLM2(model_config("tiny", **SHAPE))


def make_batches(n: int = STEPS, batch_size: int = 4, seq_len: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE["vocab_size"], (batch_size, seq_len + 1), generator=g) for _ in range(n)]


BATCHES = make_batches()


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)  # a changing lr: each update must use the lr of the step it is applied at


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return build_optimizer(name, model.named_parameters(), lr=LRS[name], weight_decay=WEIGHT_DECAY, **KWARGS.get(name, {}))


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = split_next_token(batch)
    return next_token_loss(model(inputs), targets)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)
