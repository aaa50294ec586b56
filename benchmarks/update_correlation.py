"""What Error Feedback extrapolates: how consecutive updates relate, per optimizer (docs/results.md, question 2).

EF applies ``u_t + lam (u_t - u_(t-1))``: it bets that the next update differs from this one as this one differed
from the last. For each optimizer this trains the ``nano`` model under the one-step delay (2BW pairing, no
correction) and records the optimizer's full update ``u_t`` of every step (step hooks around the inner
optimizer), then reports, averaged over the second half of the run and over all parameters:

* ``corr(d_t, d_t-1)``: the correlation of consecutive update differences ``d_t = u_t - u_(t-1)``. Near +1 the
  differences trend (EF's extrapolation is right); 0 is unpredictable; -0.5 is what independent noise gives
  (``d_t`` and ``d_(t-1)`` share ``-u_(t-1)``): extrapolating it adds noise.
* ``|d| / |u|``: the size of EF's added term relative to the update itself.
* ``cos(u_t, u_t-1)``: the alignment of consecutive updates.
* ``lam*``: the least-squares extrapolation coefficient ``<d_t, d_(t-1)> / |d_(t-1)|^2`` (what adaptive EF
  estimates; clamped to [0, 1] there).

    python benchmarks/update_correlation.py --steps 600 --path ../shared/corpora/gutenberg-100m/train.txt.xz
"""

from __future__ import annotations

import sys

import torch

import _bench
from lightning_async.callbacks.update_correlation import RecordedUpdates, UpdateSeries
from lightning_async.data import TextDataModule
from lightning_async.models import SmolLM2, model_config
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import DelayedOptimizer, build_optimizer
from lightning_async.optim.lr_schedules import warmup_cosine

#: the sync-tuned lrs of the paper-regime study (recipes/study/paper-regime.yaml); wd and betas from the recipes
SETTINGS = {
    "adamw": (1e-2, 0.1, {"betas": (0.9, 0.95)}),
    "muon": (0.007, 0.1, {"ns_dtype": "float32"}),
    "normuon": (0.007, 0.1, {"ns_dtype": "float32"}),
    "adan": (3e-2, 0.1, {"betas": (0.98, 0.92, 0.99)}),
    "soap": (3e-3, 0.1, {"betas": (0.95, 0.95)}),
    "lion": (3e-3, 0.3, {"betas": (0.9, 0.99)}),
    "mars": (1e-2, 0.1, {"gamma": 0.025, "betas": (0.95, 0.99), "betas_1d": (0.9, 0.95), "mars_type": "adamw"}),
}


def measure(name: str, batches: list[torch.Tensor], vocab: int) -> dict:
    torch.manual_seed(0)
    model = SmolLM2(model_config("nano", vocab_size=vocab))
    lr, wd, kwargs = SETTINGS[name]
    inner = build_optimizer(name, model.named_parameters(), lr=lr, weight_decay=wd, **kwargs)
    schedule = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: warmup_cosine(s, len(batches), 0.1, 0.1))
    delayed = DelayedOptimizer(inner, delay=1, pairing="2bw")
    series, step = UpdateSeries(), 0
    RecordedUpdates(inner, lambda update: series.add(update) if step >= max(len(batches) // 2 - 2, 0) else None)
    for step, batch in enumerate(batches):
        inputs, targets = split_next_token(batch)
        next_token_loss(model(inputs), targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        delayed.step()
        delayed.zero_grad()
        schedule.step()
    means = series.means()
    return {"corr": means["diff_correlation"], "size": means["diff_size"], "cos": means["cosine"],
            "lam": means["lambda_star"]}


def main(argv: list[str] | None = None) -> int:
    parser = _bench.parser(__doc__)
    parser.add_argument("--optimizers", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--path", help="a text file (default: the embedded standard-library corpus)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = TextDataModule(source="text" if args.path else "stdlib", path=args.path, seq_len=64, batch_size=16,
                          max_tokens=4_000_000, progress=False, seed=0)
    data.prepare_data()
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():
        batches.append(batch)
        if len(batches) == args.steps:
            break
    print(f"nano, one-step delay (2bw), {len(batches)} steps of 16 x 64 tokens; means over the second half")
    print("| optimizer | corr(d_t, d_t-1) | lam* | abs(d) / abs(u) | cos(u_t, u_t-1) |")
    print("|---|---|---|---|---|")
    for name in args.optimizers:
        m = measure(name, batches, data.vocab_size)
        print(f"| {name} | {m['corr']:+.3f} | {m['lam']:+.3f} | {m['size']:.3f} | {m['cos']:+.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
