"""The one-step delay of PipeDream-2BW in a plain PyTorch loop, with a staleness correction (docs/delay.md).

    python docs/examples/delayed_loop.py --optimizer muon --correction ef --steps 60

Trains a small SmolLM2-style decoder on a synthetic counting task (no download) three times from the same
initial weights: synchronous, one-step delayed, and delayed with the chosen correction, and prints the loss of
each. ``tests/cli/test_examples.py`` runs it.
"""

from __future__ import annotations

import argparse

import torch

from lightning_async.models import SmolLM2, model_config
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import CORRECTIONS, DelayedOptimizer, build_correction, build_optimizer
from lightning_async.optim.lr_schedules import warmup_cosine


def batches(steps: int, batch_size: int = 8, seq_len: int = 32, vocab: int = 64, seed: int = 0):
    """Counting sequences ``s, s+1, s+2, ... (mod vocab)`` from random starts: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch_size, 1), generator=g)
        yield (start + torch.arange(seq_len + 1)) % vocab


def train(optimizer_name: str, lr: float, steps: int, delay: int, correction: str | None) -> float:
    torch.manual_seed(0)
    model = SmolLM2(model_config("nano", vocab_size=64, num_layers=2))
    kwargs = {"ns_dtype": "float32"} if optimizer_name in ("muon", "normuon") else {}
    optimizer = build_optimizer(optimizer_name, model.named_parameters(), lr=lr, weight_decay=0.1, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, steps, 0.1, 0.1))
    delayed = DelayedOptimizer(optimizer, delay=delay, pairing="2bw",
                               correction=build_correction(correction) if correction else None)
    losses = []
    for batch in batches(steps):
        inputs, targets = split_next_token(batch)
        loss = next_token_loss(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clips the gradient about to be applied late
        delayed.step()
        delayed.zero_grad()
        schedule.step()
        losses.append(loss.item())
    for p, newest in zip(delayed.params, delayed.newest_weights()):
        p.data = newest  # evaluate and export the newest weights, not the stale ones the next forward would read
    return sum(losses[-10:]) / 10


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--correction", default="ef", choices=list(CORRECTIONS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for label, delay, correction in (("sync", 0, None), ("delayed", 1, None), (f"delayed+{args.correction}", 1, args.correction)):
        print(f"{label:>24}: final loss {train(args.optimizer, args.lr, args.steps, delay, correction):.3f}")


if __name__ == "__main__":
    main()
