"""Format the small tables of ``docs/results.md`` from finished run directories.

Each argument is ``LABEL=RUN_DIR`` (a single run dir holding event files). The script prints a
markdown table with one row per run: label, the run's identity (optimizer, mode, delay, EF
strength, lr), the final validation loss, the gap to a reference run and the wall time.

    python benchmarks/repro_tables.py --ref adamw=studies/repro-main/runs/adamw-sync-s0 \
        "adamw delayed=studies/repro-main/runs/adamw-delayed-s0" ...

``--ref OPT=RUN_DIR`` (repeatable) names the sync baseline of each optimizer; the ``gap`` column is
final loss minus that baseline's, and ``recovered`` (for runs with EF) is the share of the optimizer's
plain delayed gap (``--delayed OPT=RUN_DIR``) won back. ``--curve`` adds the validation losses at
every evaluation step.

Reads only what ``lightning_async.compare`` reads (``load_run``); writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _bench
from lightning_async.compare import load_run


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what} {item!r}: expected KEY=RUN_DIR")
        out[key.strip()] = value.strip()
    return out


def _wall_s(run) -> float | None:
    """Seconds between the first and the last event of the run (train/loss or val/loss)."""
    acc_times = []
    for tag in ("train/loss", "val/loss"):
        if run.series(tag):
            acc_times.append(tag)
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run.path), size_guidance={"scalars": 0})
        acc.Reload()
        times = [e.wall_time for tag in acc_times for e in acc.Scalars(tag)]
        return max(times) - min(times) if times else None
    except Exception:  # noqa: BLE001 - wall time is a nicety
        return None


def main(argv: list[str] | None = None) -> int:
    parser = _bench.parser(__doc__)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    parser.add_argument("--ref", action="append", default=[], metavar="OPT=RUN_DIR", help="sync baseline per optimizer")
    parser.add_argument("--delayed", action="append", default=[], metavar="OPT=RUN_DIR",
                        help="plain delayed run per optimizer (for the EF 'recovered' column)")
    parser.add_argument("--curve", action="store_true", help="add the val/loss curve")
    args = parser.parse_args(argv)

    refs = {k: load_run(v).final_val_loss for k, v in _pairs(args.ref, "--ref").items()}
    delayed = {k: load_run(v).final_val_loss for k, v in _pairs(args.delayed, "--delayed").items()}
    headers = ["run", "optimizer", "mode", "delay", "EF", "final val loss", "gap vs sync", "EF recovered", "wall"]
    if args.curve:
        headers.append("val/loss by step")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for label, path in _pairs(args.runs, "run").items():
        if not Path(path).is_dir():
            print(f"| {label} | (missing: {path}) |" + " |" * (len(headers) - 2))
            continue
        run = load_run(path)
        ident = run.identity
        loss = run.final_val_loss
        ref = refs.get(ident.optimizer)
        gap = f"{loss - ref:+.3f}" if (loss is not None and ref is not None) else ""
        rec = ""
        base = delayed.get(ident.optimizer)
        if ident.ef_strength and base is not None and ref is not None and loss is not None and abs(base - ref) > 1e-4:
            rec = f"{(base - loss) / (base - ref):.0%}"
        wall = _wall_s(run)
        cells = [
            label, ident.optimizer, ident.mode, str(ident.delay), f"{ident.ef_strength:g}",
            f"{loss:.3f}" if loss is not None else "n/a", gap, rec, f"{wall:.0f} s" if wall else "",
        ]
        if args.curve:
            cells.append(" ".join(f"{s}:{v:.3f}" for s, v in run.series("val/loss")))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
