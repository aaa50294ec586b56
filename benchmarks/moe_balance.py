"""Does the per-layer router loss keep the experts balanced? ``recipes/models/hf-moe-tiny.yaml`` trained on the quick
start's data (stdlib corpus, bytes, batch 16 x 128, AdamW 3e-3, one thread, one device) for ``--steps`` steps at
several ``router_aux_loss_coef`` values, the same batches in the same order for each. Reported per coefficient: the
training loss (mean of the last 10 steps) and the worst layer's expert load (the busiest expert's tokens over the
mean; 1.0 balanced, 4.0 = every token to the same 2 of 8 experts), mean of the last 10 steps.

    python benchmarks/moe_balance.py --steps 100 --coefficients 0 0.01 0.1
"""

from __future__ import annotations

import itertools
import os
import time

import torch
import yaml

import _bench
from lightning_async.data import TextDataModule
from lightning_async.models.hf import HFCausalLM
from lightning_async.optim import build_optimizer

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "models", "hf-moe-tiny.yaml")


def train(config: dict, batches: list[torch.Tensor], microbatches: int) -> dict:
    torch.manual_seed(0)
    module = HFCausalLM(config, vocab_size=257, aux_loss_microbatches=microbatches)
    opt = build_optimizer("adamw", module.named_parameters(), lr=3e-3, weight_decay=0.1)
    losses, loads = [], []
    start = time.perf_counter()
    for batch in batches:
        inputs, targets = module.pipeline_split_batch(batch)
        loss = module.pipeline_loss(module(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        loads.append(max(v["load"] for v in module.router_statistics.read().values()))
    return {"loss": sum(losses[-10:]) / 10, "max_load": sum(loads[-10:]) / 10, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = _bench.parser(__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--coefficients", type=float, nargs="+", default=[0.0, 0.01, 0.1])
    parser.add_argument("--cache-dir", default=".cache/lightning-async")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = TextDataModule(source="stdlib", seq_len=128, batch_size=16, max_chars=400_000, cache_dir=args.cache_dir, progress=False)
    data.prepare_data()
    data.setup("fit")
    batches = list(itertools.islice(iter(data.train_dataloader()), args.steps))
    with open(RECIPE) as f:
        recipe = yaml.safe_load(f)["model"]["init_args"]
    print(f"{'router_aux_loss_coef':>20s} {'train loss':>11s} {'max expert load':>16s} {'seconds':>8s}   (last 10 of {args.steps} steps)")
    for coef in args.coefficients:
        r = train(dict(recipe["model"], router_aux_loss_coef=coef), batches, recipe["aux_loss_microbatches"])
        print(f"{coef:20g} {r['loss']:11.3f} {r['max_load']:16.2f} {r['seconds']:8.0f}", flush=True)


if __name__ == "__main__":
    main()
