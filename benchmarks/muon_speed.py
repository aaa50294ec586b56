"""Step time of torch.optim.Muon vs the zoo's BatchedMuon (and NorMuon) vs fused AdamW.

Uses the hidden matrices of real model shapes (``group_parameters`` decides which) with fixed random
gradients, and reports medians over interleaved repetitions plus ratios within the run. AdamW runs
over *all* parameters (fused on CUDA, foreach on CPU) as the yardstick of a cheap step.

    python benchmarks/muon_speed.py --device cuda --json muon_speed.json
    python benchmarks/muon_speed.py --device cpu --models tiny small
"""

from __future__ import annotations

from collections import Counter

import torch

import _bench
from lightning_async.models import SmolLM2, model_config
from lightning_async.optim.muon import BatchedMuon, NorMuon
from lightning_async.optim.zoo import group_parameters


def build(model_name: str, device: torch.device):
    torch.manual_seed(0)
    with torch.device(device):
        model = SmolLM2(model_config(model_name))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    matrices = [p for _, p in group_parameters(model.named_parameters())["matrix"]]
    fused = device.type == "cuda"
    optimizers = {
        "torch.Muon": torch.optim.Muon(matrices, lr=0.02),
        "BatchedMuon": BatchedMuon(matrices, lr=0.02),
        "NorMuon": NorMuon(matrices, lr=0.02),
        "AdamW": torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None),
    }
    return model, matrices, optimizers


def main() -> None:
    parser = _bench.parser(__doc__, whole=True)
    _bench.add_device(parser)
    parser.add_argument("--models", nargs="+", default=None, help="default: tiny small (+ smollm2-135m on CUDA)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=None, help="default: 20 on CUDA, 3 on CPU")
    _bench.add_json(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    models = args.models or (["tiny", "small", "smollm2-135m"] if device.type == "cuda" else ["tiny", "small"])
    reps = args.reps or (20 if device.type == "cuda" else 3)

    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} reps={reps}")
    header = (f"{'model':13} {'matrices':>8} {'shapes':>6} {'torch.Muon ms':>13} {'Batched ms':>10} {'NorMuon ms':>10} "
              f"{'AdamW ms':>9} {'torch/Batched':>13} {'Batched/AdamW':>13}")
    print(header)
    print("-" * len(header))
    rows = []
    for name in models:
        model, matrices, optimizers = build(name, device)
        times = {k: [] for k in optimizers}
        for _ in range(args.warmup):
            for opt in optimizers.values():
                opt.step()
        _bench.sync(device)
        for _, k in _bench.interleaved(optimizers, reps, "shuffle"):
            times[k].append(_bench.timed(optimizers[k].step, device))
        med = {k: 1e3 * t for k, t in _bench.medians(times).items()}
        shapes = Counter(tuple(p.shape) for p in matrices)
        row = dict(model=name, matrices=len(matrices), shapes={f"{r}x{c}": n for (r, c), n in shapes.items()},
                   ms=med, torch_over_batched=med["torch.Muon"] / med["BatchedMuon"],
                   batched_over_adamw=med["BatchedMuon"] / med["AdamW"])
        rows.append(row)
        print(f"{name:13} {len(matrices):8d} {len(shapes):6d} {med['torch.Muon']:13.2f} {med['BatchedMuon']:10.2f} "
              f"{med['NorMuon']:10.2f} {med['AdamW']:9.2f} {row['torch_over_batched']:13.2f} {row['batched_over_adamw']:13.2f}")
        del model, matrices, optimizers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        _bench.write_json(args.json, dict(device=str(device), reps=reps, rows=rows))


if __name__ == "__main__":
    main()
