"""Soak test: does a long pipeline run keep its resident memory flat?

Each configuration is a real Lightning fit (``AsyncPipelineStrategy``, gloo, one process per stage, started
by Lightning's spawn launcher) of the quick start's model and data: the ``tiny`` SmolLM2 on the standard
library's sources, byte tokenizer, batches of 16 x 128 tokens, 4 micro-batches. A callback samples every
rank's resident set size (``VmRSS``) every ``--every`` steps. After ``--warmup`` steps (allocator pools,
optimizer state, the first validation) the table gives each rank's steady RSS and the least-squares slope of
RSS over steps, in MB per 1,000 steps and as a share of the steady RSS (target: below 1% per 1,000 steps).

Configurations: 2 and 3 stages x ``2bw`` and ``1f1b`` x validation off or every ``--val-every`` steps (a
validation drains a 2BW pipeline and flushes every pending send: the case without it is the one that grew). When
``--val-every`` divides ``--steps`` the last validation sees the final weights, and the run also prints the logged
``val/loss`` minus a single-device validate of the weights the fit returned (0 up to float rounding).

    python benchmarks/soak.py                                  # 8 fits of 1,600 steps (about 50 min on 2 idle cores)
    python benchmarks/soak.py --steps 400 --stages 2 --schedules 2bw   # a quick look
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time

import lightning as L

import _bench

MB = 1e6


def memory_bytes() -> dict[str, int]:
    """This process's resident memory from ``/proc/self/status`` (Linux): ``rss`` in all, ``anon`` (heap: what
    a leak grows) and ``file`` (mapped files: the token cache's pages, bounded by the file's size)."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file"}
    out = {}
    try:
        out = {fields[k]: kib * 1024 for k, kib in _bench.proc_status(list(fields)).items()}
    except OSError:  # not Linux: the peak, not the level
        import resource

        out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def slope_per_1000(samples: list[tuple[int, int]]) -> float:
    """Least-squares slope of bytes over steps, in bytes per 1,000 steps."""
    n = len(samples)
    if n < 2:
        return float("nan")
    mx = sum(s for s, _ in samples) / n
    my = sum(b for _, b in samples) / n
    sxx = sum((s - mx) ** 2 for s, _ in samples)
    sxy = sum((s - mx) * (b - my) for s, b in samples)
    return 1000.0 * sxy / sxx if sxx else float("nan")


class SampleRSS(L.Callback):
    """Records ``{step, rss, anon, file}`` every ``every`` steps; each rank writes its samples to ``rank<r>.json`` in ``out``."""

    def __init__(self, every: int, out: str) -> None:
        self.every, self.out = every, out
        self.samples: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self.samples.append({"step": trainer.global_step, **memory_bytes()})

    def on_train_end(self, trainer, pl_module) -> None:
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.samples, f)


def _fit(cfg: dict) -> tuple[float, float] | None:
    """Fit ``cfg``; with validation whose interval divides the steps (so the last one sees the final weights), the
    logged ``val/loss`` and a single-device validate of the weights the fit returned (``None`` otherwise)."""
    import torch

    import lightning_async  # noqa: F401 (registers the strategies)
    from lightning_async.data import TextDataModule
    from lightning_async.lm import CausalLM
    from lightning_async.strategies import AsyncPipelineStrategy

    torch.set_num_threads(1)
    L.seed_everything(0)
    val = cfg["val_every"]
    trainer = L.Trainer(
        accelerator="cpu", devices=cfg["stages"], max_steps=cfg["steps"],
        strategy=AsyncPipelineStrategy(schedule=cfg["schedule"], n_microbatches=4, start_method="spawn"),
        val_check_interval=val if val else None, check_val_every_n_epoch=None if val else 10**6,
        limit_val_batches=4 if val else 0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[SampleRSS(cfg["every"], cfg["dir"])], gradient_clip_val=1.0,
    )
    model = CausalLM(model="tiny", vocab_size=257, lr=3e-3)
    data = TextDataModule(source="stdlib", tokenizer="byte", seq_len=128, batch_size=16)
    trainer.fit(model, data)
    if not val or cfg["steps"] % val:
        return None
    logged = float(trainer.callback_metrics["val/loss"])
    one = L.Trainer(accelerator="cpu", devices=1, limit_val_batches=4, logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
    return logged, one.validate(model, data, verbose=False)[0]["val/loss"]


def run(stages: int, schedule: str, val_every: int, steps: int, every: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = dict(stages=stages, schedule=schedule, val_every=val_every, steps=steps, every=every, dir=tmp)
        start = time.perf_counter()
        val_losses = _fit(cfg)
        wall = time.perf_counter() - start
        ranks = []
        for r in range(stages):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                samples = [x for x in json.load(f) if x["step"] >= warmup]
            row = {"rank": r, "samples": samples}
            for kind in ("rss", "anon", "file"):
                if all(kind in x for x in samples):
                    level = sum(x[kind] for x in samples) / len(samples)
                    slope = slope_per_1000([(x["step"], x[kind]) for x in samples])
                    row[kind] = {"steady_mb": level / MB, "slope_mb": slope / MB, "slope_pct": 100 * slope / level}
            ranks.append(row)
    return {"stages": stages, "schedule": schedule, "val_every": val_every, "steps": steps, "wall_s": wall, "ranks": ranks,
            "val_loss_pipeline_and_one_device": val_losses}


def main() -> None:
    parser = _bench.parser(__doc__)
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--warmup", type=int, default=800, help="steps before the slope is fitted (the allocator settles)")
    parser.add_argument("--every", type=int, default=20, help="sample RSS every N steps")
    parser.add_argument("--val-every", type=int, default=300, help="validation interval of the 'with validation' rows")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--schedules", nargs="+", default=["2bw", "1f1b"])
    parser.add_argument("--validation", nargs="+", choices=["off", "on"], default=["off", "on"])
    _bench.add_json(parser, "also write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'stages':>6} {'schedule':>8} {'val':>5} {'rank':>4} {'RSS MB':>7} {'RSS MB/1k':>10} {'RSS %/1k':>9} "
          f"{'heap MB/1k':>10} {'files MB/1k':>11}")
    for stages, schedule, val in itertools.product(args.stages, args.schedules, args.validation):
        row = run(stages, schedule, args.val_every if val == "on" else 0, args.steps, args.every, args.warmup)
        rows.append(row)
        for r in row["ranks"]:
            rss, anon, file = r["rss"], r.get("anon", {}), r.get("file", {})
            print(f"{stages:>6} {schedule:>8} {val:>5} {r['rank']:>4} {rss['steady_mb']:>7.0f} {rss['slope_mb']:>10.2f} "
                  f"{rss['slope_pct']:>8.2f}% {anon.get('slope_mb', float('nan')):>10.2f} "
                  f"{file.get('slope_mb', float('nan')):>11.2f}", flush=True)
    worst = max(r["rss"]["slope_pct"] for row in rows for r in row["ranks"])
    print(f"worst RSS slope: {worst:.2f}% of the steady RSS per 1,000 steps (target < 1%)")
    for row in rows:
        if row["val_loss_pipeline_and_one_device"] is not None:
            logged, one = row["val_loss_pipeline_and_one_device"]
            print(f"{row['stages']} stages {row['schedule']}: logged val/loss {logged:.7f}, a single-device validate of "
                  f"the final weights {one:.7f} (difference {logged - one:+.1e})")
    if args.json:
        _bench.write_json(args.json, rows)


if __name__ == "__main__":
    main()
