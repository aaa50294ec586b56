"""The planning map's rows and text (pure functions; ``lightning-async plan`` is :mod:`~lightning_async.tools.plan`).

For each stage count ``p`` and micro-batch count ``m`` (or replica count at a fixed global batch), every synchronous
schedule we run (1F1B, ZB-H1, interleaved 1F1B with two chunks per stage, ZB-V) and 2BW (and 2BW-split) are run
through the timing model (:mod:`~lightning_async.pipeline.timing`) and the memory model
(:mod:`~lightning_async.pipeline.memory`): their per-batch time and peak memory, the best synchronous schedule that
fits the memory budget, 2BW's throughput relative to it, and a one-line recommendation.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_async.pipeline.fsdp import check_fsdp_applicable
from lightning_async.pipeline.memory import schedule_memory
from lightning_async.pipeline import schedules
from lightning_async.pipeline.schedules import spec
from lightning_async.pipeline.timing import time_schedule

__all__ = ["ASYNC", "COMPARED", "compare", "compare_row", "fmt_bytes", "fmt_time", "format_compare_table",
           "map_footnote", "microbatches_per_pipeline"]

#: the schedules of the map: the synchronous ones we run, and the asynchronous ones
COMPARED = schedules.MAP_SYNC_SCHEDULES  # (from the schedule registry)
ASYNC = schedules.DELAYED_SCHEDULES


def schedule_costs(s_: schedules.ScheduleSpec, p: int, costs: dict) -> dict:
    """The costs the timing and memory models take for ``s_``: ``costs`` itself (per rank), or, for a schedule with
    several chunks per rank when ``costs["pieces"][chunks]`` gives the same costs per piece (the model's units split
    over ``p x chunks`` pieces, the embedding on the first and the LM head on the last), times and activations per
    piece and each rank's parameter and optimizer bytes summed over the pieces it holds: the V schedule puts the
    first and the last piece, embedding and head, on rank 0, not the head on rank ``p - 1``. Raises ``ValueError``
    where the model's layers do not fill the pieces."""
    pieces = costs.get("pieces", {}).get(s_.chunks) if s_.chunks > 1 else None
    if pieces is None:
        return costs
    if "skipped" in pieces:
        raise ValueError(pieces["skipped"])

    last = len(pieces["forward_s"]) - 1
    both = s_.holder(0, p)[0] if s_.holder(0, p)[0] == s_.holder(last, p)[0] else None  # a rank with embedding and head
    tied = costs.get("tied_bytes", {})

    def per_rank(key: str) -> list:
        summed = [sum(v for k, v in enumerate(pieces[key]) if s_.holder(k, p)[0] == r) for r in range(p)]
        if both is not None:  # the tied weight is one tensor there, counted by both units
            summed[both] -= tied.get(key, 0)
        return summed

    return {**{k: pieces[k] for k in ("forward_s", "backward_s", "activation_bytes", "weight_grad_bytes") if k in pieces},
            **{k: per_rank(k) for k in ("param_bytes", "optimizer_bytes") if k in pieces}}


def compare_row(p: int, m: int, costs: dict, comm_s: float, update_s: float, num_batches: int,
                weight_fraction: float, budget_bytes: float | None, worth: float, data_parallel: int = 1,
                shard_optimizer: bool = False, fsdp: bool = False, clipping: bool = False) -> dict:
    """One row of the map: each schedule's steady per-batch time and peak memory per rank (``data_parallel``
    replicas, the optimizer state sharded over them with ``shard_optimizer``, FSDP inside each stage with ``fsdp``:
    the schedules it refuses are skipped), the best synchronous schedule (that
    fits ``budget_bytes``), 2BW's speed-up over it and a recommendation. Memory counts a second gradient buffer where
    a stage waits on a reduction across stages (tied weights in ``costs``, global-norm ``clipping``):
    :func:`~lightning_async.pipeline.memory.holds_two_gradients`."""
    row = {"p": p, "m": m, "dp": data_parallel, "schedules": {}}
    sharded = shard_optimizer and data_parallel > 1
    fsdp = fsdp and data_parallel > 1
    for name in (*COMPARED, *ASYNC):
        s_ = spec(name)
        try:
            s_.validate(p, m)
            if fsdp:
                check_fsdp_applicable(s_, data_parallel)
            c = schedule_costs(s_, p, costs)
        except ValueError as err:
            row["schedules"][name] = {"skipped": str(err)}
            continue
        weight = [b * weight_fraction for b in c["backward_s"]]
        r = time_schedule(s_, p, m, num_batches, c["forward_s"], c["backward_s"], comm_s, update_s, weight=weight)
        entry = {"per_batch_s": r.per_batch_time, "bubble": r.bubble, "peak_inflight": max(r.peak_inflight)}
        if c.get("param_bytes") is not None:
            mem = schedule_memory(s_, p, m, c["param_bytes"], c["optimizer_bytes"], c["activation_bytes"],
                                  data_parallel_size=data_parallel, shard_optimizer=sharded,
                                  weight_grad_bytes=c.get("weight_grad_bytes"), fsdp=fsdp,
                                  tied_weights=bool(costs.get("tied_bytes", {}).get("param_bytes")), clipping=clipping)
            entry["peak_bytes"] = max(x["total"] for x in mem)
            entry["fits"] = budget_bytes is None or entry["peak_bytes"] <= budget_bytes
        row["schedules"][name] = entry
    timed = {n: e for n, e in row["schedules"].items() if "per_batch_s" in e}
    sync = {n: e for n, e in timed.items() if n not in ASYNC and e.get("fits", True)}
    delayed = {n: e for n, e in timed.items() if n in ASYNC}
    # (ties to the nanosecond go to the first in ASYNC's order: 2bw before the rest of the family)
    fastest = min(delayed, key=lambda n: round(delayed[n]["per_batch_s"], 9)) if delayed else None
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
        extra = (f", {'+' if more >= 0 else '-'}{fmt_bytes(abs(more))} of memory on the most loaded stage"
                 if "peak_bytes" in two and "peak_bytes" in sync[best] else "")
        if not two.get("fits", True):
            row["recommendation"] = f"{best}: 2BW needs more memory than the budget"
        elif gain >= worth:
            row["recommendation"] = f"{fastest}: {gain:.2f}x {best}{extra}; pair it with a delay-robust optimizer (Muon) or EF"
        else:
            row["recommendation"] = f"{best}: 2BW gains only {gain:.3f}x (< {worth:g}x), not worth a stale gradient"
    return row


def format_compare_table(rows: list[dict]) -> str:
    """The map's rows (:func:`compare`) as a Markdown table, one line per row."""
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
        cells += [fmt_time(r["schedules"][n]["per_batch_s"]) if "per_batch_s" in r["schedules"][n] else "-" for n in names]
        if has_mem:
            cells += [(fmt_bytes(r["schedules"][n]["peak_bytes"]) + ("" if r["schedules"][n].get("fits", True) else " (over)"))
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


def _costs_by_stage_count(stages: Sequence[int], costs_for_p, skipped: list[dict]):
    """``(p, costs_for_p(p))`` for each stage count; one whose costs raise ``ValueError`` goes to ``skipped``."""
    for p in stages:
        try:
            costs = costs_for_p(p)
        except ValueError as err:
            skipped.append({"p": p, "reason": str(err)})
            continue
        yield p, costs


def microbatches_per_pipeline(global_batch: int, data_parallel: int, micro_batch_size: int) -> int | None:
    """``m = G / (dp x micro-batch)``, or None where the global batch does not split evenly."""
    share, rest = divmod(global_batch, data_parallel * micro_batch_size)
    return share if share >= 1 and rest == 0 else None


def compare(stages, multipliers, costs_for_p, comm_s, update_s, num_batches, weight_fraction, memory_gib, worth,
            global_batch=None, data_parallel=(1,), micro_batch_size=1, shard_optimizer=False, fsdp=False, clipping=False):
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
                             data_parallel=dp, shard_optimizer=shard_optimizer, fsdp=fsdp, clipping=clipping)
                 for m, dp in shapes]
    return rows, skipped


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def map_footnote(weight_fraction: float) -> str:
    """What the map's columns mean (printed under it)."""
    return (
        f"batch = steady per-batch time (weight gradient {weight_fraction:g} of the backward); mem = peak of the "
        "most loaded stage (weight versions, a gradient buffer, optimizer state, peak in-flight activations); "
        "best sync = fastest synchronous schedule that fits --memory-gib; 2BW x best sync = its time / the faster 2BW's (2bw or 2bw-split)."
    )
