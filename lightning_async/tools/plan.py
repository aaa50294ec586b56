"""``lightning-async plan``: the planning map of pipeline depth, micro-batch count and schedule (the CLI; the rows
and the text are :mod:`~lightning_async.tools.plan_table`).

For each stage count ``p`` and micro-batch count ``m``, every synchronous schedule we run (1F1B, ZB-H1, interleaved
1F1B with two chunks per stage, ZB-V) and 2BW (and 2BW-split): their per-batch time and peak memory, the best
synchronous schedule that fits ``--memory-gib`` (when memory costs are known), 2BW's throughput relative to it, and
a one-line recommendation. ``--weight-fraction`` is the share of the backward that is the weight gradient (what a
zero-bubble schedule can defer; 0.5 for a transformer's linear layers). ``--compare`` (which chose this map over
the older 1F1B-against-2BW table, now removed) is still accepted and changes nothing.

Stage costs are either given (``--forward-ms/--backward-ms`` per stage and micro-batch, ``--comm-ms`` per hop) or
measured on the current device from a model config (``--model smollm2-135m --seq-len 2048``): one decoder block,
the embedding and the LM head (with the loss) are timed forward and backward, the layers are split evenly over
the stages (the first stage also holds the embedding, the last the head; for a schedule with two chunks per stage,
over its pieces, so ZB-V's rank 0 holds both), and parameter and activation bytes are counted. With ``--tflops`` (and with no option at all: SmolLM2-135M, sequence 2048, bf16, 100 TFLOP/s) the
stage costs are nominal instead: FLOP counts at that sustained rate, parameters counted exactly, activations
estimated, nothing measured.

Usage::

    lightning-async plan
    lightning-async plan --forward-ms 10 --backward-ms 20
    lightning-async plan --model smollm2-360m --tflops 300 --memory-gib 40
    lightning-async plan --model smollm2-360m --tflops 300 --seq-len 4096
    lightning-async plan --model smollm2-135m --seq-len 2048 --device cpu --json plans/plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_async.pipeline.measure import measure_model
from lightning_async.tools.depth_advice import depth_advice_lines
from lightning_async.tools.family_advice import family_advice
from lightning_async.tools.plan_table import compare, fmt_bytes, fmt_time, format_compare_table, map_footnote
from lightning_async.tools.stage_costs import (
    NOMINAL_DTYPE,
    NOMINAL_MODEL,
    NOMINAL_TFLOPS,
    map_costs,
    nominal_model,
)

DEFAULT_STAGES = (4, 8, 16, 32, 64)
DEFAULT_MULTIPLIERS = (1, 2, 4)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lightning-async plan",
        description="Planning map: every schedule's per-batch time and peak memory per pipeline shape, and PipeDream-2BW "
        "against the best synchronous schedule.",
    )
    ap.add_argument("--stages", type=int, nargs="+", default=list(DEFAULT_STAGES), help="stage counts p")
    ap.add_argument(
        "--microbatches", type=int, nargs="+", default=list(DEFAULT_MULTIPLIERS), metavar="K",
        help="micro-batches per batch as multiples of p: m = K * p (default 1 2 4)",
    )
    ap.add_argument("--batches", type=int, default=5, help="batches to simulate (steady state measured inside)")
    given = ap.add_argument_group("given stage costs (per stage, per micro-batch)")
    given.add_argument("--forward-ms", type=float, help="forward time of one stage")
    given.add_argument("--backward-ms", type=float, help="backward time of one stage (default 2x forward)")
    given.add_argument("--comm-ms", type=float, default=0.0, help="latency of one hop (activation or gradient)")
    given.add_argument("--update-ms", type=float, default=0.0, help="optimizer step of one stage")
    meas = ap.add_argument_group("measured (or, with --tflops, nominal) stage costs of a model")
    meas.add_argument(
        "--model", help=f"model config name (lightning_async.models.MODEL_CONFIGS), e.g. smollm2-135m (default with "
        f"--tflops or no cost option: {NOMINAL_MODEL})",
    )
    meas.add_argument(
        "--tflops", type=float,
        help="nominal costs instead of a measurement: FLOP counts at this sustained TFLOP/s per stage, activations "
        f"estimated (default when no cost option is given: {NOMINAL_TFLOPS:g})",
    )
    meas.add_argument("--seq-len", type=int, default=2048)
    meas.add_argument("--micro-batch-size", type=int, default=1)
    meas.add_argument("--vocab-size", type=int, help="override the config's vocabulary size")
    meas.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    meas.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"],
        help=f"default: float32 when measured, {NOMINAL_DTYPE} when nominal",
    )
    meas.add_argument("--reps", type=int, default=3, help="timed repetitions per unit after one warm-up (fastest kept)")
    meas.add_argument(
        "--head-tokens", type=int,
        help="tokens to time the LM head on, scaled linearly to the sequence (default: 256 on CPU, all on GPU)",
    )
    meas.add_argument(
        "--split", choices=["even", "balanced"], default="even",
        help="layers per stage: even, or balanced on the measured cost (the LM head weighs several blocks)",
    )
    meas.add_argument("--link-gbps", type=float, help="derive --comm-ms from the boundary activation size")
    meas.add_argument(
        "--optimizer-states", type=float, default=2.0,
        help="fp32 optimizer-state tensors per parameter (AdamW: 2, Muon: 1)",
    )
    cmp = ap.add_argument_group("the map: every schedule, 2BW against the best synchronous one")
    cmp.add_argument("--compare", action="store_true",
                     help="accepted and ignored: the map is what plan prints (this flag chose it over a table now removed)")
    cmp.add_argument("--weight-fraction", type=float, default=0.5,
                     help="share of the backward that is the weight gradient (zero-bubble schedules defer it)")
    cmp.add_argument("--memory-gib", type=float, help="memory per stage: schedules that need more are left out")
    cmp.add_argument("--worth", type=float, default=1.05,
                     help="2BW is recommended only when at least this many times faster than the best sync schedule")
    cmp.add_argument("--global-batch", type=int,
                     help="sequences per optimizer step over all replicas: m = G / (replicas x --micro-batch-size) "
                          "per pipeline, for each --data-parallel count (replaces --microbatches)")
    cmp.add_argument("--data-parallel", type=int, nargs="+", default=[1], metavar="DP",
                     help="pipeline replicas to compare at --global-batch (default 1)")
    cmp.add_argument("--shard-optimizer", action="store_true",
                     help="memory with the optimizer state and EF sharded over the replicas (ZeRO-1)")
    cmp.add_argument("--fsdp", action="store_true",
                     help="memory with FSDP2 inside each stage (weights, optimizer state and EF at 1/dp); the "
                          "schedules it does not run (split backward) are left out")
    cmp.add_argument("--clipping", action="store_true",
                     help="the run clips gradients by their global norm (gradient_clip_val): under 2BW every stage "
                          "but the first then holds a second gradient buffer (tied weights do so on the last stage)")
    ap.add_argument("--json", dest="json_path", help="write the map and the inputs as JSON")
    return ap


def argument_error(args: argparse.Namespace) -> str | None:
    """The first problem with ``args`` as a message naming the option, ``None`` when there is none."""
    if args.forward_ms is not None and (args.model is not None or args.tflops is not None):
        return "give either --forward-ms (and optionally --backward-ms) or --model/--tflops, not both"
    if args.forward_ms is None and args.backward_ms is not None:
        return "--backward-ms needs --forward-ms"
    checks = [
        (name, value, "> 0", value is None or value > 0)
        for name, value in (("--forward-ms", args.forward_ms), ("--tflops", args.tflops),
                            ("--link-gbps", args.link_gbps))
    ] + [
        (name, value, ">= 0", value is None or value >= 0)
        for name, value in (("--backward-ms", args.backward_ms), ("--comm-ms", args.comm_ms),
                            ("--update-ms", args.update_ms), ("--optimizer-states", args.optimizer_states),
                            ("--memory-gib", args.memory_gib))
    ] + [
        (name, value, ">= 1", value is None or value >= 1)
        for name, value in (("--stages", min(args.stages)), ("--microbatches", min(args.microbatches)),
                            ("--batches", args.batches), ("--seq-len", args.seq_len),
                            ("--micro-batch-size", args.micro_batch_size), ("--head-tokens", args.head_tokens))
    ]
    if args.data_parallel != [1] and args.global_batch is None:
        return "--data-parallel needs --global-batch (m per pipeline = G / (replicas x --micro-batch-size))"
    if (args.shard_optimizer or args.fsdp) and max(args.data_parallel) < 2:
        return f"{'--fsdp' if args.fsdp else '--shard-optimizer'} splits the state over replicas: give --data-parallel counts > 1"
    if args.shard_optimizer and args.fsdp:
        return "--fsdp already shards the optimizer state: drop --shard-optimizer"
    if min(args.data_parallel) < 1 or (args.global_batch is not None and args.global_batch < 1):
        return "--global-batch and --data-parallel must be >= 1"
    if not 0 <= args.weight_fraction < 1:
        return f"--weight-fraction must be in [0, 1), got {args.weight_fraction:g}"
    for name, value, rule, ok in checks:
        if not ok:  # also catches nan
            return f"{name} must be {rule}, got {value:g}"
    if args.json_path and Path(args.json_path).is_dir():
        return f"--json {args.json_path} is a directory; give a file name, e.g. {Path(args.json_path) / 'plan.json'}"
    return None


def _model_costs(args: argparse.Namespace) -> dict:
    """Unit costs of ``--model``: measured, or nominal with ``--tflops`` or when no cost option was given."""
    nominal = args.tflops is not None or args.model is None
    name = args.model or NOMINAL_MODEL
    if nominal:
        dtype = args.dtype or NOMINAL_DTYPE
        tflops = args.tflops or NOMINAL_TFLOPS
        meas = nominal_model(name, args.seq_len, args.micro_batch_size, dtype, tflops, args.vocab_size)
        print(
            f"nominal costs, nothing measured: {name}, seq {meas['seq_len']} x micro-batch {meas['micro_batch_size']}, "
            f"{dtype}, FLOP counts at {meas['tflops']:g} TFLOP/s per stage, activations estimated"
        )
        if args.model is None:
            print("  (measure on your hardware: --model smollm2-135m --device cuda --dtype bfloat16; or give "
                  "--forward-ms/--backward-ms; --help lists the options)")
        return meas
    meas = measure_model(
        name, args.seq_len, args.micro_batch_size, args.device, args.dtype or "float32", max(args.reps, 1),
        args.head_tokens, args.vocab_size,
    )
    print(
        f"measured on {meas['device_name']} ({meas['threads']} threads, {meas['dtype']}): {name}, "
        f"seq {meas['seq_len']} x micro-batch {meas['micro_batch_size']}, fastest of {meas['reps']}"
    )
    return meas


def plan_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-async plan``: 0 map printed, 2 bad input (one ``error:`` line)."""
    args = build_parser().parse_args(argv)
    problem = argument_error(args)
    if problem is None and args.json_path:
        try:
            Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            problem = f"--json {args.json_path}: cannot create its directory ({err})"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    stages = sorted(set(args.stages))
    update_s = args.update_ms / 1e3
    comm_s = args.comm_ms / 1e3
    meas, stage_costs = None, {}
    if args.forward_ms is not None:
        tf = args.forward_ms / 1e3
        tb = (args.backward_ms if args.backward_ms is not None else 2 * args.forward_ms) / 1e3

        def costs_for_p(p):
            return {"forward_s": [tf] * p, "backward_s": [tb] * p}

        print(f"stage costs (given): forward {fmt_time(tf)}, backward {fmt_time(tb)}, hop {fmt_time(comm_s)}")
    else:
        try:
            meas = _model_costs(args)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if args.link_gbps:
            comm_s = meas["boundary_bytes"] / (args.link_gbps * 1e9 / 8)
        u = meas["units"]
        for unit in ("embed", "block", "head"):
            d = u[unit]
            print(
                f"  {unit:5s} forward {fmt_time(d['forward_s']):>9s}  backward {fmt_time(d['backward_s']):>9s}  "
                f"params {d['params'] / 1e6:7.2f}M  activations {fmt_bytes(d['activation_bytes'])}"
                f" (I to W: {fmt_bytes(d['weight_grad_bytes'])})"
            )
        if meas["head_tokens"] < meas["seq_len"]:
            print(f"  (head timed on {meas['head_tokens']} tokens, scaled linearly to {meas['seq_len']})")
        print(f"  {args.split} layer split; hop latency {fmt_time(comm_s)}; optimizer states {args.optimizer_states:g} x fp32 per parameter")

        def costs_for_p(p):
            costs = map_costs(meas, p, args.optimizer_states, args.split)
            stage_costs[str(p)] = costs
            return costs

    rows, skipped = compare(stages, args.microbatches, costs_for_p, comm_s, update_s, args.batches,
                            args.weight_fraction, args.memory_gib, args.worth, args.global_batch,
                            sorted(set(args.data_parallel)), args.micro_batch_size, args.shard_optimizer, args.fsdp,
                            args.clipping)
    print(format_compare_table(rows))
    for s in skipped:
        print(f"skipped p={s['p']}: {s['reason']}")
    print(map_footnote(args.weight_fraction))
    print("convergence under staleness (measured only):\n" + depth_advice_lines(stages))
    print("quality by schedule, optimizer and correction (measured only):\n" + family_advice())
    if args.json_path:
        payload = {
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "comm_s": comm_s,
            "update_s": update_s,
            "measurement": meas,
            "stage_costs": stage_costs,
            "rows": rows,
            "skipped": skipped,
        }
        with open(args.json_path, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan_main())
