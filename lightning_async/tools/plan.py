"""``lightning-async plan``: a planning table for pipeline depth, micro-batch count and schedule.

For each stage count ``p`` and micro-batch count ``m`` the timing model (:mod:`lightning_async.pipeline.timing`)
runs 1F1B and 2BW and reports the steady per-batch time, the bubble, the throughput gain of 2BW over 1F1B and
the extra memory 2BW (a second weight version) and 2BW with Error Feedback (one more parameter-sized buffer)
cost on the most loaded stage.

Stage costs are either given (``--forward-ms/--backward-ms`` per stage and micro-batch, ``--comm-ms`` per hop) or
measured on the current device from a model config (``--model smollm2-135m --seq-len 2048``): one decoder block,
the embedding and the LM head (with the loss) are timed forward and backward, the layers are split evenly over
the stages (the first stage also holds the embedding, the last the head), and parameter and activation bytes are
counted. With ``--tflops`` (and with no option at all: SmolLM2-135M, sequence 2048, bf16, 100 TFLOP/s) the
stage costs are nominal instead: FLOP counts at that sustained rate, parameters counted exactly, activations
estimated, nothing measured.

With ``--compare`` it draws the map instead: for each ``p`` and ``m``, every synchronous schedule we run (1F1B,
ZB-H1, interleaved 1F1B with two chunks per stage, ZB-V) and 2BW (and 2BW-split), their per-batch time and peak
memory, the best
synchronous schedule that fits ``--memory-gib`` (when memory costs are known), 2BW's throughput relative to it, and
a one-line recommendation. ``--weight-fraction`` is the share of the backward that is the weight gradient (what a
zero-bubble schedule can defer; 0.5 for a transformer's linear layers).

``lightning-async simulate`` is the old name: it says so on stderr and runs the same. Usage::

    lightning-async plan
    lightning-async plan --compare --forward-ms 10 --backward-ms 20
    lightning-async plan --compare --model smollm2-360m --tflops 300 --memory-gib 40
    lightning-async plan --forward-ms 10 --backward-ms 20
    lightning-async plan --model smollm2-360m --tflops 300 --seq-len 4096
    lightning-async plan --model smollm2-135m --seq-len 2048 --device cpu --json plans/plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_async.pipeline.fsdp import check_fsdp_applicable
from lightning_async.pipeline.measure import measure_model
from lightning_async.pipeline.schedules import spec
from lightning_async.pipeline.timing import memory_model, schedule_memory, simulate
from lightning_async.tools.depth_advice import depth_advice_lines
from lightning_async.tools.stage_costs import (
    NOMINAL_DTYPE,
    NOMINAL_MODEL,
    NOMINAL_TFLOPS,
    nominal_model,
    stage_costs_from_measurement,
)

DEFAULT_STAGES = (4, 8, 16, 32, 64)
DEFAULT_MULTIPLIERS = (1, 2, 4)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="lightning-async plan",
        description="Planning table: 1F1B vs PipeDream-2BW per-batch time, bubble and memory per pipeline shape.",
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
    cmp = ap.add_argument_group("the map (--compare): every schedule, 2BW against the best synchronous one")
    cmp.add_argument("--compare", action="store_true", help="compare every schedule instead of 1F1B and 2BW")
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
    ap.add_argument("--json", dest="json_path", help="write the table and the inputs as JSON")
    return ap


#: the schedules of the map: the synchronous ones we run, and the asynchronous ones
COMPARED = ("1f1b", "zbh1", "interleaved", "zbv")
ASYNC = ("2bw", "2bw-split")


def compare_row(p: int, m: int, costs: dict, comm_s: float, update_s: float, num_batches: int,
                weight_fraction: float, budget_bytes: float | None, worth: float, data_parallel: int = 1,
                shard_optimizer: bool = False, fsdp: bool = False) -> dict:
    """One row of the map: each schedule's steady per-batch time and peak memory per rank (``data_parallel``
    replicas, the optimizer state sharded over them with ``shard_optimizer``, FSDP inside each stage with ``fsdp``:
    the schedules it refuses are skipped), the best synchronous schedule (that
    fits ``budget_bytes``), 2BW's speed-up over it and a recommendation."""
    weight = [b * weight_fraction for b in costs["backward_s"]]
    row = {"p": p, "m": m, "dp": data_parallel, "schedules": {}}
    sharded = shard_optimizer and data_parallel > 1
    fsdp = fsdp and data_parallel > 1
    for name in (*COMPARED, *ASYNC):
        s_ = spec(name)
        try:
            s_.validate(p, m)
            if fsdp:
                check_fsdp_applicable(s_, data_parallel)
        except ValueError as err:
            row["schedules"][name] = {"skipped": str(err)}
            continue
        r = simulate(s_, p, m, num_batches, costs["forward_s"], costs["backward_s"], comm_s, update_s, weight=weight)
        entry = {"per_batch_s": r.per_batch_time, "bubble": r.bubble, "peak_inflight": max(r.peak_inflight)}
        if costs.get("param_bytes") is not None:
            mem = schedule_memory(s_, p, m, costs["param_bytes"], costs["optimizer_bytes"], costs["activation_bytes"],
                                  data_parallel_size=data_parallel, shard_optimizer=sharded,
                                  weight_grad_bytes=costs.get("weight_grad_bytes"), fsdp=fsdp)
            entry["peak_bytes"] = max(x["total"] for x in mem)
            entry["fits"] = budget_bytes is None or entry["peak_bytes"] <= budget_bytes
        row["schedules"][name] = entry
    timed = {n: e for n, e in row["schedules"].items() if "per_batch_s" in e}
    sync = {n: e for n, e in timed.items() if n not in ASYNC and e.get("fits", True)}
    delayed = {n: e for n, e in timed.items() if n in ASYNC}
    fastest = min(delayed, key=lambda n: delayed[n]["per_batch_s"]) if delayed else None
    two = delayed.get(fastest)
    if not timed:
        row["recommendation"] = f"no schedule runs m={m} micro-batches on {p} stages (fewer replicas, or a larger batch)"
        return row
    if not sync:
        row["recommendation"] = "no synchronous schedule fits the memory budget" + (
            f"; {fastest} fits" if two and two.get("fits", True) else "; nothing fits")
        return row
    best = min(sync, key=lambda n: sync[n]["per_batch_s"])
    row["best_sync"] = best
    if two is None:
        row["recommendation"] = f"{best}: 2BW cannot run m={m} micro-batches on {p} stages"
    else:
        gain = sync[best]["per_batch_s"] / two["per_batch_s"]
        row["2bw_over_best_sync"], row["best_async"] = gain, fastest
        more = two.get("peak_bytes", 0) - sync[best].get("peak_bytes", 0)
        extra = (f", {'+' if more >= 0 else '-'}{_fmt_bytes(abs(more))} of memory on the most loaded stage"
                 if "peak_bytes" in two and "peak_bytes" in sync[best] else "")
        if not two.get("fits", True):
            row["recommendation"] = f"{best}: 2BW needs more memory than the budget"
        elif gain >= worth:
            row["recommendation"] = f"{fastest}: {gain:.2f}x {best}{extra}; pair it with a delay-robust optimizer (Muon) or EF"
        else:
            row["recommendation"] = f"{best}: 2BW gains only {gain:.3f}x (< {worth:g}x), not worth a stale gradient"
    return row


def format_compare_table(rows: list[dict]) -> str:
    names = (*COMPARED, *ASYNC)
    has_mem = any("peak_bytes" in e for r in rows for e in r["schedules"].values())
    replicas = any(r.get("dp", 1) > 1 for r in rows)
    head = ["p", *(["dp"] if replicas else []), "m", *(f"{n} batch" for n in names)]
    if has_mem:
        head += [f"{n} mem" for n in names]
    head += ["best sync", "2BW x best sync", "recommendation"]
    lines = []
    for r in rows:
        cells = [str(r["p"]), *([str(r["dp"])] if replicas else []), str(r["m"])]
        cells += [_fmt_time(r["schedules"][n]["per_batch_s"]) if "per_batch_s" in r["schedules"][n] else "-" for n in names]
        if has_mem:
            cells += [(_fmt_bytes(r["schedules"][n]["peak_bytes"]) + ("" if r["schedules"][n].get("fits", True) else " (over)"))
                      if "peak_bytes" in r["schedules"][n] else "-" for n in names]
        cells += [r.get("best_sync", "-"), f"{r['2bw_over_best_sync']:.2f}x" if "2bw_over_best_sync" in r else "-",
                  r["recommendation"]]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    last = len(head) - 1  # the recommendation reads left to right
    out += ["| " + " | ".join(c.ljust(w) if i == last else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"
            for cells in lines]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------ table


def _costs_by_stage_count(stages: Sequence[int], costs_for_p, skipped: list[dict]):
    """``(p, costs_for_p(p))`` for each stage count; one whose costs raise ``ValueError`` goes to ``skipped``."""
    for p in stages:
        try:
            costs = costs_for_p(p)
        except ValueError as err:
            skipped.append({"p": p, "reason": str(err)})
            continue
        yield p, costs


def plan(
    stages: Sequence[int],
    multipliers: Sequence[int],
    costs_for_p,
    comm_s: float,
    update_s: float,
    num_batches: int,
) -> tuple[list[dict], list[dict]]:
    """Rows of the planning table. ``costs_for_p(p)`` returns the stage-cost dict or raises ``ValueError``."""
    rows, skipped = [], []
    for p, costs in _costs_by_stage_count(stages, costs_for_p, skipped):
        for k in multipliers:
            m = k * p
            row = {"p": p, "m": m}
            sims = {}
            for schedule in ("1f1b", "2bw"):
                r = simulate(
                    schedule, p, m, num_batches, costs["forward_s"], costs["backward_s"], comm_s, update_s
                )
                sims[schedule] = r
                row[schedule] = {
                    "per_batch_s": r.per_batch_time,
                    "bubble": r.bubble,
                    "throughput_rel": r.throughput_rel,
                    "peak_inflight": r.peak_inflight,
                    "weight_versions": r.weight_versions,
                }
            row["ideal_per_batch_s"] = sims["2bw"].ideal_per_batch_time
            row["gain_2bw_over_1f1b"] = sims["1f1b"].per_batch_time / sims["2bw"].per_batch_time
            if costs.get("param_bytes") is not None:
                mem = memory_model(
                    costs["param_bytes"],
                    costs["optimizer_bytes"],
                    costs["activation_bytes"],
                    inflight_sync=sims["1f1b"].peak_inflight,
                    inflight_2bw=sims["2bw"].peak_inflight,
                )
                peak_sync = max(x.sync for x in mem)
                peak_2bw = max(x.twobw for x in mem)
                peak_ef = max(x.twobw_ef for x in mem)
                row["memory"] = {
                    "peak_1f1b_bytes": peak_sync,
                    "peak_2bw_bytes": peak_2bw,
                    "peak_2bw_ef_bytes": peak_ef,
                    "2bw_extra_bytes": peak_2bw - peak_sync,
                    "2bw_ef_extra_bytes": peak_ef - peak_sync,
                    "per_stage": [
                        {"1f1b": x.sync, "2bw": x.twobw, "2bw_ef": x.twobw_ef, "params": x.params} for x in mem
                    ],
                }
            rows.append(row)
    return rows, skipped


def microbatches_per_pipeline(global_batch: int, data_parallel: int, micro_batch_size: int) -> int | None:
    """``m = G / (dp x micro-batch)``, or None where the global batch does not split evenly."""
    share, rest = divmod(global_batch, data_parallel * micro_batch_size)
    return share if share >= 1 and rest == 0 else None


def compare(stages, multipliers, costs_for_p, comm_s, update_s, num_batches, weight_fraction, memory_gib, worth,
            global_batch=None, data_parallel=(1,), micro_batch_size=1, shard_optimizer=False, fsdp=False):
    """The map's rows (:func:`compare_row` for every ``p`` and ``m = k p``, or with ``global_batch`` for every
    replica count ``dp``: ``m = G / (dp x micro_batch_size)``) and the stage counts (and replica counts) skipped."""
    rows, skipped = [], []
    budget = None if memory_gib is None else memory_gib * 2**30
    for p, costs in _costs_by_stage_count(stages, costs_for_p, skipped):
        if global_batch is None:
            shapes = [(k * p, 1) for k in multipliers]
        else:
            shapes = []
            for dp in data_parallel:
                m = microbatches_per_pipeline(global_batch, dp, micro_batch_size)
                if m is None:
                    skipped.append({"p": p, "reason": f"dp={dp}: the global batch {global_batch} does not split into "
                                                      f"{dp} replicas x micro-batches of {micro_batch_size}"})
                else:
                    shapes.append((m, dp))
        rows += [compare_row(p, m, costs, comm_s, update_s, num_batches, weight_fraction, budget, worth,
                             data_parallel=dp, shard_optimizer=shard_optimizer, fsdp=fsdp) for m, dp in shapes]
    return rows, skipped


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(rows: list[dict]) -> str:
    head = ["p", "m", "1F1B batch", "2BW batch", "bubble 1F1B", "bubble 2BW", "2BW gain", "2BW/limit"]
    has_mem = any("memory" in r for r in rows)
    if has_mem:
        head += ["peak mem 1F1B", "+2BW", "+2BW+EF"]
    lines = []
    for r in rows:
        cells = [
            str(r["p"]),
            str(r["m"]),
            _fmt_time(r["1f1b"]["per_batch_s"]),
            _fmt_time(r["2bw"]["per_batch_s"]),
            f"{100 * r['1f1b']['bubble']:.1f}%",
            f"{100 * r['2bw']['bubble']:.1f}%",
            f"{r['gain_2bw_over_1f1b']:.2f}x",
            f"{100 * r['2bw']['throughput_rel']:.0f}%",
        ]
        if has_mem:
            mem = r.get("memory")
            if mem:
                base = mem["peak_1f1b_bytes"]
                cells += [
                    _fmt_bytes(base),
                    f"+{_fmt_bytes(mem['2bw_extra_bytes'])} ({100 * mem['2bw_extra_bytes'] / base:.0f}%)",
                    f"+{_fmt_bytes(mem['2bw_ef_extra_bytes'])} ({100 * mem['2bw_ef_extra_bytes'] / base:.0f}%)",
                ]
            else:
                cells += ["-", "-", "-"]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += ["| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |" for cells in lines]
    return "\n".join(out)


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
    if (args.global_batch is not None or args.data_parallel != [1] or args.shard_optimizer or args.fsdp) and not args.compare:
        return "--global-batch, --data-parallel, --shard-optimizer and --fsdp belong to the map: add --compare"
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
    """Entry point of ``lightning-async plan``: 0 table printed, 2 bad input (one ``error:`` line)."""
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

        print(f"stage costs (given): forward {_fmt_time(tf)}, backward {_fmt_time(tb)}, hop {_fmt_time(comm_s)}")
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
                f"  {unit:5s} forward {_fmt_time(d['forward_s']):>9s}  backward {_fmt_time(d['backward_s']):>9s}  "
                f"params {d['params'] / 1e6:7.2f}M  activations {_fmt_bytes(d['activation_bytes'])}"
                f" (I to W: {_fmt_bytes(d['weight_grad_bytes'])})"
            )
        if meas["head_tokens"] < meas["seq_len"]:
            print(f"  (head timed on {meas['head_tokens']} tokens, scaled linearly to {meas['seq_len']})")
        print(f"  {args.split} layer split; hop latency {_fmt_time(comm_s)}; optimizer states {args.optimizer_states:g} x fp32 per parameter")

        def costs_for_p(p):
            costs = stage_costs_from_measurement(meas, p, args.optimizer_states, args.split)
            stage_costs[str(p)] = costs
            return costs

    if args.compare:
        rows, skipped = compare(stages, args.microbatches, costs_for_p, comm_s, update_s, args.batches,
                                args.weight_fraction, args.memory_gib, args.worth, args.global_batch,
                                sorted(set(args.data_parallel)), args.micro_batch_size, args.shard_optimizer, args.fsdp)
        print(format_compare_table(rows))
    else:
        rows, skipped = plan(stages, args.microbatches, costs_for_p, comm_s, update_s, args.batches)
        print(format_table(rows))
    for s in skipped:
        print(f"skipped p={s['p']}: {s['reason']}")
    if args.compare:
        print(
            f"batch = steady per-batch time (weight gradient {args.weight_fraction:g} of the backward); mem = peak of the "
            "most loaded stage (weight versions, a gradient buffer, optimizer state, peak in-flight activations); "
            "best sync = fastest synchronous schedule that fits --memory-gib; 2BW x best sync = its time / the faster 2BW's (2bw or 2bw-split)."
        )
        print("convergence under staleness (measured only):\n" + depth_advice_lines(stages))
    else:
        print(
            "batch = steady per-batch time; bubble = idle fraction of all stages in steady state; "
            "2BW gain = 1F1B time / 2BW time; 2BW/limit = bubble-free limit (m x slowest stage) / 2BW time; memory = most loaded stage (weights, one gradient buffer, optimizer "
            "state, peak in-flight activations)."
        )
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


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-async simulate``, the old name of ``plan``: one line on stderr, then :func:`plan_main`."""
    print("`simulate` is now `plan`", file=sys.stderr)
    return plan_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan_main())
