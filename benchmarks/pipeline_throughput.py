"""Pipeline throughput: every schedule of our runtime beside ``torch.distributed.pipelining``'s, in one run.

For each configuration one group of gloo processes (one per stage, one thread each) runs, on fresh copies of the
same pieces, in turn (interleaved rounds, so a drift in machine load hits every schedule alike):

* ours: ``1f1b``, ``gpipe``, ``2bw``, ``2bw-split``, ``zbh1``, ``interleaved`` (2 chunks per stage), ``zbv``; a ``-fused`` suffix
  runs our runtime without pre-posted receives (the fused send/receive groups NCCL runs);
* torch's, as anchors: ``torch-1F1B`` (``Schedule1F1B``), ``torch-Interleaved1F1B`` (2 chunks per stage),
  ``torch-ZB1P`` (``ScheduleInterleavedZeroBubble`` on 1 chunk per stage: ZB-H1), ``torch-ZBV``
  (``ScheduleZBVZeroBubble``) and ``torch-DualPipeV`` (``ScheduleDualPipeV``), each with a correct user's
  additions around ``step()`` (the tied-embedding gradient sum, the optimizer step, the loss shared with every rank).

Every schedule gets its own optimizer (AdamW), ``warmup`` batches, then ``N`` timed batches and a drain (2BW) or
nothing (the flushing schedules end each batch empty). Rank 0 takes the wall time from the end of batch
``warmup - 1`` to the end of the drain.

Configurations: ``sleep:P:M`` (stages whose forward / input-gradient / weight-gradient sleep ``--tf`` / ``--tb -
--tw`` / ``--tw`` seconds per micro-batch for a stage's share: no CPU used, so a 2-core machine hosts 4 or 8 stages
and the measurement isolates the schedules and the runtimes' overheads; ``--weights N`` gives each rank's stage N more
parameter tensors, a real stage's count, for what a runtime pays per tensor) and ``real:P:M`` (the ``tiny`` SmolLM2
with ``2P`` blocks: real compute, which on a machine with fewer cores than stages also measures the contention).

Columns: efficiency = the bubble-free time ``max_s m (tf + tb)`` per batch over the measured one; the timing
model's prediction (``timing.time_action_lists`` over the same action lists and window, with the forward, input- and
weight-gradient times each rank measured of itself in the run, the effective hop latency seen in the run's own
traces, and the runtime's measured cost per action); the ratio to torch's
equivalent schedule; the peak RSS growth of the worst rank over the timed window (a rough witness of activation
memory on the CPU: see ``benchmarks/memory.py`` for the per-term accounting).

    python benchmarks/pipeline_throughput.py --configs sleep:4:4,sleep:4:8,sleep:4:16 --json runs/throughput.json
"""

from __future__ import annotations

import cProfile
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench  # noqa: E402
from _bench import reset_peak_rss, rss_kib, spawn  # noqa: E402
from _stages import SLEEP_WIDTH, Workload, p2p_probe, ping_pong  # noqa: E402

from lightning_async.optim import build_optimizer  # noqa: E402
from lightning_async.pipeline import schedules as S  # noqa: E402
from lightning_async.pipeline.partition import partition_units  # noqa: E402
from lightning_async.pipeline.stage import build_rank_stage  # noqa: E402
from lightning_async.pipeline.timing import time_action_lists  # noqa: E402

#: cProfile categories, first match wins: (label, test on (file, function name))
PROFILE_CATEGORIES = (
    ("compute (stage sleeps)", lambda f, fn: fn == "<built-in method time.sleep>"),
    ("waits on peers", lambda f, fn: "wait" in fn and ("c10d" in fn or "Work" in fn)),
    ("posting p2p / collectives", lambda f, fn: "_distributed_c10d" in fn),
    ("autograd engine", lambda f, fn: "run_backward" in fn or fn == "<built-in method apply>"),
    ("our runtime (Python)", lambda f, fn: "lightning_async" in f),
    ("torch (Python)", lambda f, fn: "/torch/" in f),
)

FUSED = "-fused"  # our runtime without pre-posted receives: the fused send/receive groups NCCL runs
OURS = ("1f1b", "gpipe", "2bw", "2bw-split", "pipedream", "paci", "wpipe", "zbh1", "interleaved", "zbv")
# torch's schedules: class name, our schedule with its pieces' layout (chunks per stage, placement), our equivalent
TORCH = {
    "torch-1F1B": ("Schedule1F1B", "1f1b", "1f1b"),
    "torch-Interleaved1F1B": ("ScheduleInterleaved1F1B", "interleaved", "interleaved"),
    "torch-ZB1P": ("ScheduleInterleavedZeroBubble", "zbh1", "zbh1"),
    "torch-ZBV": ("ScheduleZBVZeroBubble", "zbv", "zbv"),
    "torch-DualPipeV": ("ScheduleDualPipeV", "zbv", None),
}
ORDER = (*OURS, *(f"{s}{FUSED}" for s in ("1f1b", "2bw", "zbv")), *TORCH)
DEFAULT_SCHEDULES = (*OURS, *TORCH)


def base_schedule(name: str) -> str:
    """The schedule whose action lists a row's timing is predicted with (torch's rows: our equivalent)."""
    if name in TORCH:
        return TORCH[name][2]
    return name.removesuffix(FUSED)


# ---------------------------------------------------------------------------------------------- timing helpers
class Clock:
    """Seconds per category on one rank, and the ``(kind, chunk, micro-batch, start, end)`` of every action."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.events: list[tuple[str, int, int, float, float]] = []

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def trace(self, kind: str, fn):
        """``fn(chunk, microbatch, ...)`` timed, with its event recorded (``I`` for a split backward)."""

        @functools.wraps(fn)
        def timed(chunk, mb, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(chunk, mb, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                label = "I" if kind == "B" and kwargs.get("split") else kind
                self.t[label] = self.t.get(label, 0.0) + t1 - t0
                self.events.append((label, chunk, mb, t0, t1))

        return timed

    def reset(self) -> None:
        self.t.clear()
        self.events = []


def _optimizer(named):
    return build_optimizer("adamw", named, lr=1e-4, weight_decay=0.1)


def _stage_units(work: Workload, units, pieces: int) -> list[list[str]]:
    return partition_units(units, pieces, "uniform")


# ---------------------------------------------------------------------------------------------- one schedule
def _timed_loop(batches, warm: int, step, finish) -> tuple[list[float], float, float]:
    """Run ``step(b, batch)`` for every batch and ``finish()``; the end time of each, and the window's start and
    peak RSS growth (KiB)."""
    marks = []
    for b, batch in enumerate(batches):
        if b == warm:
            start, base = time.perf_counter(), rss_kib("VmRSS")
            reset_peak_rss()
        step(b, batch)
        marks.append(time.perf_counter())
    finish()
    marks.append(time.perf_counter())
    peak = rss_kib("VmHWM")
    return marks, start, (peak - base) if peak is not None and base is not None else float("nan")


def profile_by_category(prof: cProfile.Profile) -> dict[str, float]:
    """Seconds of own time (cProfile's ``tottime``) per :data:`PROFILE_CATEGORIES` entry, the rest as ``other``."""
    import pstats

    out: dict[str, float] = {}
    for (file, _, fn), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        label = next((lab for lab, test in PROFILE_CATEGORIES if test(file, fn)), "other (harness, builtins)")
        out[label] = out.get(label, 0.0) + own
    return out


def _run_ours(work: Workload, name: str, batches, warm: int, clock: Clock, profile: bool = False) -> dict:
    spec = S.spec(base_schedule(name))
    p = work.p
    units = work.units(spec.virtual_stages(p))
    rt = _bench.build_rank(units, spec, work.m, work.split(), work.loss(), lambda plan: _optimizer(plan.named_parameters),
                           rank=dist.get_rank(), world_size=p, pipeline_parallel_size=p,
                           stage_units=_stage_units(work, units, spec.virtual_stages(p))).runtime
    rt.transport.prepost_enabled = rt.transport.prepost_enabled and not name.endswith(FUSED)
    rt.compute.forward = clock.trace("F", rt.compute.forward)
    rt.compute.backward = clock.trace("B", rt.compute.backward)
    rt.compute.weight_grad = clock.trace("W", rt.compute.weight_grad)
    rt._begin_update = clock.wrap("update", rt._begin_update)
    for group in rt.update_groups:  # (wpipe: one update pipeline per chunk)
        group.updates.apply = clock.wrap("update", group.updates.apply)
    rt.transport.receive = clock.wrap("p2p", rt.transport.receive)
    rt.transport.exchange = clock.wrap("p2p", rt.transport.exchange)
    rt.collect_loss = clock.wrap("p2p", rt.collect_loss)

    prof = cProfile.Profile() if profile else None

    def step(b, batch):
        if b == warm:
            clock.reset()
            if prof is not None:
                prof.enable()
        rt.train_batch(batch)
        if rt.reported_loss_batch() is not None:
            rt.collect_loss(rt.reported_loss_batch())

    def finish():
        rt.drain()
        if rt.clock.reported_loss(len(batches) - 1) != len(batches) - 1:  # the last batch's loss is still out
            rt.collect_loss(len(batches) - 1)
        if prof is not None:
            prof.disable()
            _dump_profile(prof, name)

    return _timed_result(batches, warm, step, finish, prof)


def _run_torch(work: Workload, name: str, groups, batches, warm: int, clock: Clock, profile: bool = False) -> dict:
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    cls_name, layout, _ = TORCH[name]
    rank, p = groups.stage, groups.num_stages
    spec = S.spec(layout)  # (our schedule with torch's piece layout: the placement only)
    v = spec.chunks
    pieces = p * v
    units = work.units(pieces)
    split_units = _stage_units(work, units, pieces)
    built = build_rank_stage(units, rank, split_units, schedule=spec)
    chunks = built.chunks
    stages = [
        PipelineStage(chunk, spec.piece(rank, c, p), pieces, torch.device("cpu"), group=groups.p2p)
        for c, chunk in enumerate(chunks)
    ]
    cls = getattr(pipelining.schedules, cls_name)
    sched = cls(stages if v > 1 or cls_name != "Schedule1F1B" else stages[0], work.m, loss_fn=work.loss())
    opt = _optimizer(built.named_parameters)
    tied = dict(built.module.named_parameters())
    tied_params = [tied[n] for n in built.tied]
    holds_first = any(spec.piece(rank, c, p) == 0 for c in range(v))
    holds_last = any(spec.piece(rank, c, p) == pieces - 1 for c in range(v))
    split = work.split()

    def step(b, batch):
        inputs, targets = split(batch)
        t0 = time.perf_counter()
        losses: list = []
        args = (inputs,) if holds_first else ()
        kwargs = dict(target=targets, losses=losses) if holds_last else {}
        sched.step(*args, **kwargs)
        t1 = time.perf_counter()
        # What a correct user adds around torch's schedules (our runtime does the same inside): sum the tied
        # embedding's gradient over first and last stage, step, and share the last stage's loss with every rank.
        if tied_params and groups.tied is not None:
            for q in tied_params:
                dist.all_reduce(q.grad, group=groups.tied)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros(())
        dist.all_reduce(loss, group=groups.metrics)
        clock.t["step"] = clock.t.get("step", 0.0) + t1 - t0
        clock.t["update"] = clock.t.get("update", 0.0) + time.perf_counter() - t1

    prof = cProfile.Profile() if profile else None

    def profiled_step(b, batch):
        if b == warm and prof is not None:
            prof.enable()
        step(b, batch)

    def finish():
        if prof is not None:
            prof.disable()
            _dump_profile(prof, name)

    return _timed_result(batches, warm, profiled_step, finish, prof)


def _timed_result(batches, warm: int, step, finish, prof: cProfile.Profile | None) -> dict:
    """:func:`_timed_loop`'s measurements as a run's result (with its profile by category, if profiled)."""
    marks, start, rss = _timed_loop(batches, warm, step, finish)
    return {"marks": marks, "start": start, "rss_kib": rss, "in_flight_peak": None,
            "profile": None if prof is None else profile_by_category(prof)}


def _dump_profile(prof: cProfile.Profile, name: str) -> None:
    """The whole pstats of this rank (``PIPELINE_PROFILE_DIR``), for ``python -m pstats``."""
    if os.environ.get("PIPELINE_PROFILE_DIR"):
        prof.dump_stats(os.path.join(os.environ["PIPELINE_PROFILE_DIR"], f"{name}-rank{dist.get_rank()}.pstats"))


def run_config(work: Workload, warm: int, n: int, order: tuple[str, ...], rounds: int = 1, profile: bool = False) -> dict:
    """Runs inside every rank of a ``work.p``-process gloo group; rank 0's dict carries the results."""
    from lightning_async.pipeline.groups import make_pipeline_groups

    rank, p = dist.get_rank(), work.p
    groups = make_pipeline_groups(rank, p, p)
    shape = (work.microbatch_size, SLEEP_WIDTH) if work.kind == "sleep" else (work.microbatch_size, work.seq_len, 64)
    comm = ping_pong(shape, group=groups.p2p) if p > 1 else 0.0
    comms = [None] * p
    dist.all_gather_object(comms, comm)
    batches = [work.batch(100 + b) for b in range(warm + n)]
    out = {"hop_s": comms[0], "runs": {name: [] for name in order}}
    for _, name in _bench.interleaved(order, rounds):
        clock = Clock()
        dist.barrier()
        res = _run_torch(work, name, groups, batches, warm, clock, profile) if name in TORCH else _run_ours(work, name, batches, warm, clock, profile)
        clocks = [None] * p
        dist.all_gather_object(clocks, {"t": dict(clock.t), "events": clock.events, "rss_kib": res["rss_kib"],
                                        "profile": res.get("profile")})
        out["runs"][name].append({"marks": res["marks"], "clocks": clocks})
    return out


# ---------------------------------------------------------------------------------------------- prediction
def action_times(runs: list[dict], spec: S.ScheduleSpec, p: int) -> tuple[list[float], list[float], list[float]] | None:
    """Per piece: the mean forward, whole-backward and weight-gradient seconds our runs measured of themselves
    (a split backward's is its ``I`` plus its ``W``)."""
    pieces = spec.virtual_stages(p)
    times = {k: [[] for _ in range(pieces)] for k in ("F", "B", "I", "W")}
    for run in runs:
        for r, c in enumerate(run["clocks"]):
            for kind, chunk, _, a, b in c["events"]:
                times[kind][spec.piece(r, chunk, p)].append(b - a)
    if not any(times["F"]):
        return None

    def mean(xs):
        return statistics.mean(xs) if xs else 0.0

    tf = [mean(x) for x in times["F"]]
    tw = [mean(x) for x in times["W"]]
    tb = [mean(b) if b else mean(i) + w for b, i, w in zip(times["B"], times["I"], tw)]
    return tf, tb, tw


def effective_hop(runs: list[dict], spec: S.ScheduleSpec, p: int) -> float | None:
    """The median effective latency of a hop between ranks, from our runs' traces: for an action that waited for a
    neighbour (its rank was idle before it), its start minus the end of the neighbour's action it waited for. This
    is send, transfer, the receiver's wake-up and the runtime's Python between the two, under the run's load."""
    hops = []
    last = spec.virtual_stages(p) - 1
    for run in runs:
        done, order = {}, {}
        for r, c in enumerate(run["clocks"]):
            events = sorted(c["events"], key=lambda e: e[3])
            for i, (kind, chunk, mb, a, b) in enumerate(events):
                done[kind, spec.piece(r, chunk, p), mb] = (a, b, r)
                order[kind, spec.piece(r, chunk, p), mb] = events[i - 1][4] if i else None
        for (kind, piece, mb), (start, _, rank) in done.items():
            if kind == "F" and piece > 0:
                source = [("F", piece - 1, mb)]
            elif kind in ("B", "I") and piece < last:
                source = [("B", piece + 1, mb), ("I", piece + 1, mb)]
            else:
                continue
            src = next((done[k] for k in source if k in done), None)
            before = order[kind, piece, mb]
            if src is None or src[2] == rank or before is None or before >= src[1]:
                continue  # a local hand-over, or the rank was still busy when the input arrived
            hops.append(start - src[1])
    return statistics.median(hops) if hops else None


def action_overhead(run: dict, window_s: float) -> list[float]:
    """Per rank, the runtime's own seconds per action: the window less compute, waits on other ranks (receives,
    sends, the loss reduction) and updates, over the actions it ran."""
    out = []
    for c in run["clocks"]:
        busy = sum(v for k, v in c["t"].items() if k in ("F", "B", "I", "W", "p2p", "update"))
        out.append(max(0.0, window_s - busy) / max(1, len(c["events"])))
    return out


def predicted_per_batch(spec: S.ScheduleSpec, p: int, m: int, tf, tb, tw, comm: float, upd, warm: int, n: int,
                        overhead=0.0) -> float:
    """Simulated seconds per batch on rank 0 over the measured window (from the end of batch ``warm - 1`` to the
    end of the drain)."""
    lists = [spec.run_actions(r, p, m, warm + n) for r in range(p)]
    trace = time_action_lists(lists, tf, tb, comm, upd, weight=tw, schedule=spec, overhead=overhead)
    k = 0
    for b in range(warm):
        k += len(spec.call_actions(0, p, m, b, fresh=b == 0))
    return (trace[0][-1][2] - trace[0][k - 1][2]) / n


def compute_actions_per_batch(name: str, p: int, m: int) -> int | None:
    """Compute actions (F, B, I, W) per batch on the busiest rank, in steady state (torch's: its equivalent's)."""
    own = base_schedule(name)
    if own is None:
        return None
    spec = S.spec(own)
    batch = 1 if spec.delayed else 0
    return max(sum(a.kind != S.UPDATE for a in spec.call_actions(r, p, m, batch, fresh=batch == 0)) for r in range(p))


def analyse(label: str, work: Workload, warm: int, n: int, res: dict) -> list[dict]:
    p, m = work.p, work.m
    rows = []
    for name, runs in res["runs"].items():
        per = [((r["marks"][-1] - r["marks"][warm - 1]) / n, r) for r in runs]
        per_batch, run = min(per, key=lambda x: x[0])
        row = dict(config=label, kind=work.kind, p=p, m=m, schedule=name, n_batches=n, warmup=warm, rounds=len(runs),
                   batches_per_s=1 / per_batch, per_batch_s=per_batch, all_rounds_per_batch_s=[x for x, _ in per],
                   rss_growth_mib=max(c["rss_kib"] for c in run["clocks"]) / 1024,
                   clocks=[c["t"] for c in run["clocks"]])
        actions = compute_actions_per_batch(name, p, m)
        if actions:
            row["us_per_action"] = 1e6 * per_batch / actions  # at near-zero compute: the runtime's own cost
        if run["clocks"][0].get("profile") is not None:
            row["profile_ms_per_batch"] = [{k: 1e3 * v / n for k, v in c["profile"].items()} for c in run["clocks"]]
        base = base_schedule(name)
        own = name if name not in TORCH else base
        if base is not None and own in res["runs"]:
            spec = S.spec(base)
            measured = action_times(res["runs"][own], spec, p)
            if measured is not None:
                tf, tb, tw = measured
                upd = [c["t"].get("update", 0.0) / n for c in run["clocks"]]
                own_run = min(res["runs"][own], key=lambda r: r["marks"][-1] - r["marks"][warm - 1])
                overhead = action_overhead(own_run, own_run["marks"][-1] - own_run["marks"][warm - 1])
                hop = effective_hop(res["runs"][own], spec, p)
                hop = res["hop_s"] if hop is None else hop
                pred = predicted_per_batch(spec, p, m, tf, tb, tw, hop, upd, warm, n, overhead)
                ideal = max(m * sum(tf[k] + tb[k] for k in range(spec.virtual_stages(p)) if spec.holder(k, p)[0] == r)
                            for r in range(p))
                row.update(predicted_per_batch_s=pred, measured_over_predicted=per_batch / pred,
                           overhead_per_action_s=max(overhead), effective_hop_s=hop,
                           ideal_per_batch_s=ideal, efficiency=ideal / per_batch)
        rows.append(row)
    by_name = {r["schedule"]: r for r in rows}
    for r in rows:
        twin = next((t for t, (_, _, ours) in TORCH.items() if ours == base_schedule(r["schedule"]) and r["schedule"] not in TORCH), None)
        if twin in by_name:
            r["ratio_to_torch"] = r["batches_per_s"] / by_name[twin]["batches_per_s"]
    sync = [r for r in rows if r["schedule"] in TORCH or not S.spec(base_schedule(r["schedule"])).delayed]
    if sync:  # 2BW against the fastest synchronous schedule of the run, ours or torch's
        best = max(sync, key=lambda r: r["batches_per_s"])
        for r in rows:
            if r["schedule"] not in TORCH and S.spec(base_schedule(r["schedule"])).delayed:
                r["over_best_sync"], r["best_sync"] = r["batches_per_s"] / best["batches_per_s"], best["schedule"]
    return rows


def table(rows: list[dict]) -> str:
    head = ("| config | schedule | batches/s | us / action | efficiency | measured / predicted | x torch's equivalent "
            "| peak RSS growth MiB | 2BW x best sync |")
    out = [head, "|" + "---|" * 9]

    def fmt(x, spec=".3f"):
        return "" if x is None else format(x, spec)

    for r in rows:
        best = f"{r['over_best_sync']:.3f} (vs {r['best_sync']})" if "over_best_sync" in r else ""
        out.append(
            f"| {r['config']} | {r['schedule']} | {r['batches_per_s']:.3f} | {fmt(r.get('us_per_action'), '.0f')} | "
            f"{fmt(r.get('efficiency'))} | "
            f"{fmt(r.get('measured_over_predicted'))} | {fmt(r.get('ratio_to_torch'))} | {r['rss_growth_mib']:.1f} | {best} |"
        )
    return "\n".join(out)


def profile_table(rows: list[dict]) -> str:
    """Where each rank's time per batch goes (cProfile's own time by category, ms per batch; ``--profile``)."""
    labels = [lab for lab, _ in PROFILE_CATEGORIES] + ["other (harness, builtins)"]
    out = ["| config | schedule | rank | " + " | ".join(labels) + " | total |", "|" + "---|" * (len(labels) + 4)]
    for r in rows:
        for rank, prof in enumerate(r.get("profile_ms_per_batch") or []):
            cells = " | ".join(f"{prof.get(lab, 0.0):.2f}" for lab in labels)
            out.append(f"| {r['config']} | {r['schedule']} | {rank} | {cells} | {sum(prof.values()):.2f} |")
    return "\n".join(out)


def parse_config(text: str, args) -> tuple[str, Workload, int]:
    kind, p, m = text.split(":")
    p, m = int(p), int(m)
    if kind == "sleep":
        work = Workload("sleep", p, m, tf=args.tf, tb=args.tb, tw=args.tw, weights=args.weights)
        n = max(args.min_batches, math.ceil(args.window_microbatches / m))
    elif kind == "real":
        work = Workload("real", p, m, microbatch_size=args.microbatch_size, seq_len=args.seq_len)
        n = max(args.min_batches, math.ceil(args.real_window_microbatches / m))
    else:
        raise ValueError(f"unknown config kind {kind!r} (use sleep:P:M or real:P:M)")
    return f"{kind} p={p} m={m}", work, n


def runnable(name: str, p: int, m: int) -> bool:
    """Whether a schedule takes these settings (torch's DualPipeV and ZB-V need ``m >= 2p``; interleaved, a multiple
    of ``p``)."""
    if name in TORCH:
        cls = TORCH[name][0]
        if cls in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
            return m >= 2 * p
        return m >= p
    try:
        S.spec(base_schedule(name)).validate(p, m)
        return True
    except ValueError:
        return False


def main(argv=None) -> None:
    ap = _bench.parser(__doc__, whole=True)
    ap.add_argument("--configs", default="sleep:4:4,sleep:4:8,sleep:4:16,real:2:4", help="comma-separated KIND:P:M")
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES), help=f"subset of {','.join(ORDER)}")
    ap.add_argument("--tf", type=float, default=0.020, help="sleep stages: forward seconds per micro-batch")
    ap.add_argument("--tb", type=float, default=0.040, help="sleep stages: backward seconds per micro-batch")
    ap.add_argument("--tw", type=float, default=0.020, help="sleep stages: the weight-gradient part of --tb")
    ap.add_argument("--weights", type=int, default=0,
                    help="sleep stages: extra parameter tensors per rank (a real stage's count, e.g. 75)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches before the window")
    ap.add_argument("--window-microbatches", type=int, default=64, help="sleep: timed micro-batches (N = this / m)")
    ap.add_argument("--real-window-microbatches", type=int, default=48, help="real: timed micro-batches")
    ap.add_argument("--min-batches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=4, help="real: sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128, help="real: tokens per sequence")
    _bench.add_rounds(ap, 1, "interleaved repetitions; the fastest of each is kept")
    _bench.add_json(ap, "write all rows here")
    ap.add_argument("--probe", action="store_true", help="only run the 2-rank gloo p2p anatomy probe and exit")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile our runtime's timed window on every rank and print where the time goes by category "
                         "(slows the runtime: compare rates without it)")
    args = ap.parse_args(argv)
    if args.probe:
        res = spawn(2, p2p_probe)
        for k, v in sorted({**res[0], **res[1]}.items()):
            print(f"{k:>22}: {1e3 * v:.3f} ms")
        return
    wanted = args.schedules.split(",")
    rows = []
    started = time.perf_counter()
    for text in args.configs.split(","):
        label, work, n = parse_config(text, args)
        order = tuple(s for s in ORDER if s in wanted and runnable(s, work.p, work.m))
        t0 = time.perf_counter()
        res = spawn(work.p, run_config, work, args.warmup, n, order, args.rounds, args.profile)[0]
        new = analyse(label, work, args.warmup, n, res)
        rows += new
        print(f"# {label}: N={n} timed batches; hop {1e6 * res['hop_s']:.0f} us; {time.perf_counter() - t0:.0f}s", flush=True)
        for r in new:
            extra = f"  x torch {r['ratio_to_torch']:.3f}" if "ratio_to_torch" in r else ""
            pred = f"  meas/pred {r['measured_over_predicted']:.3f}" if "measured_over_predicted" in r else ""
            best = f"  2BW/best sync {r['over_best_sync']:.3f} ({r['best_sync']})" if "over_best_sync" in r else ""
            print(f"  {r['schedule']:>22}: {r['batches_per_s']:.3f} batches/s{pred}{extra}  RSS +{r['rss_growth_mib']:.1f} MiB{best}  "
                  f"rounds ms {' '.join(f'{1e3 * x:.0f}' for x in r['all_rounds_per_batch_s'])}", flush=True)
    print()
    print(table(rows))
    if args.profile:
        print("\nWhere the time goes (cProfile own time, ms per batch, the timed window):\n")
        print(profile_table(rows))
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    if args.json:
        _bench.write_json(args.json, {"args": vars(args), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
