"""The delay's gap, and the share EF wins back, against training length (docs/results.md, open question 1).

Reads every finished run under the given folders (``lightning_async.compare.load_runs``), groups them by
optimizer, training length (final ``train/tokens`` per model parameter) and category (sync, async, async+EF),
averages over seeds, and prints one markdown row per optimizer and length: sync, async, async+EF, the gap
``async - sync`` (absolute and relative) and EF recovered. With ``--plot PNG`` it draws the gap (relative to sync)
against tokens per parameter on a log axis, one line per optimizer, with the paper's 360M gaps as markers.

    python benchmarks/gap_vs_length.py studies/paper-regime/runs studies/paper-regime-length/runs \
        --optimizers adamw muon --plot docs/img/gap_vs_length.png
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

import _bench
from lightning_async.compare import load_runs
from lightning_async.models import model_config
from lightning_async.models.smollm2 import count_parameters

#: the paper's SmolLM2-360M gaps at ~20 tokens per parameter (BRIEF §1), relative to sync
PAPER_GAPS = {"adamw": 0.278 / 2.612, "muon": 0.012 / 2.578}


def tokens_per_parameter(run) -> float | None:
    tokens = run.series("train/tokens")
    hp = run.hparams
    if not tokens or "model" not in hp:
        return None
    cfg = model_config(str(hp["model"]), vocab_size=hp.get("vocab_size"), **(hp.get("model_overrides") or {}))
    return max(tokens)[1] / count_parameters(cfg)


def collect(folders: list[str], optimizers: list[str] | None) -> dict:
    """``{(optimizer, rounded tokens/param): {category: [final val loss per seed]}}``."""
    cells: dict = defaultdict(lambda: defaultdict(list))
    for run in load_runs(folders, skip_invalid=True):
        ident = run.identity
        if not run.done or run.final_val_loss is None or (optimizers and ident.optimizer not in optimizers):
            continue
        if ident.category not in ("sync", "async", "async+EF") or (ident.ef_strength not in (0.0, 1.0)):
            continue
        length = tokens_per_parameter(run)
        if length is not None:
            cells[(ident.optimizer, round(length, 1))][ident.category].append(run.final_val_loss)
    return cells


def rows(cells: dict) -> list[dict]:
    out = []
    for (optimizer, length), by_category in sorted(cells.items()):
        means = {c: statistics.fmean(v) for c, v in by_category.items()}
        if "sync" not in means or "async" not in means:
            continue
        gap = means["async"] - means["sync"]
        ef = means.get("async+EF")
        out.append(dict(optimizer=optimizer, tokens_per_param=length, n=min(len(v) for v in by_category.values()),
                        sync=means["sync"], async_=means["async"], async_ef=ef, gap=gap, relative=gap / means["sync"],
                        recovered=(means["async"] - ef) / gap if ef is not None and abs(gap) > 1e-4 else None))
    return out


def print_table(table: list[dict]) -> None:
    print("| optimizer | tokens/param | seeds | sync | async | async + EF | gap (async - sync) | EF recovered |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        ef = f"{r['async_ef']:.3f}" if r["async_ef"] is not None else "-"
        rec = f"{r['recovered']:.0%}" if r["recovered"] is not None else "-"
        print(f"| {r['optimizer']} | {r['tokens_per_param']:g} | {r['n']} | {r['sync']:.3f} | {r['async_']:.3f} | {ef} | "
              f"{r['gap']:+.3f} ({r['relative']:+.1%}) | {rec} |")


def plot(table: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for optimizer in sorted({r["optimizer"] for r in table}):
        mine = [r for r in table if r["optimizer"] == optimizer]
        line, = ax.plot([r["tokens_per_param"] for r in mine], [100 * r["relative"] for r in mine], marker="o", label=optimizer)
        if optimizer in PAPER_GAPS:
            ax.scatter([20], [100 * PAPER_GAPS[optimizer]], marker="*", s=120, color=line.get_color(),
                       label=f"{optimizer}, paper (360M)")
    ax.set_xscale("log")
    lengths = sorted({round(r["tokens_per_param"], 1) for r in table})
    ax.set_xticks(lengths, [f"{x:g}" for x in lengths], minor=False)
    ax.set_xticks([], minor=True)  # the log axis' minor labels (3x10^0, 4x10^0, ...) would overlap these
    ax.set_xlabel("training tokens per parameter")
    ax.set_ylabel("gap: (async - sync) / sync, %")
    ax.axhline(0, color="gray", linewidth=0.5)
    ax.set_title("One-step delay: final-loss gap vs training length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = _bench.parser(__doc__)
    parser.add_argument("folders", nargs="+", help="study runs folders (or run dirs)")
    parser.add_argument("--optimizers", nargs="+", help="only these optimizers")
    parser.add_argument("--plot", metavar="PNG", help="write the gap-vs-length plot here")
    args = parser.parse_args(argv)
    table = rows(collect(args.folders, args.optimizers))
    print_table(table)
    if args.plot:
        plot(table, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
