"""Pipeline throughput: our 2BW / 1F1B / GPipe runtime against ``torch.distributed.pipelining.Schedule1F1B``.

For each configuration one group of gloo processes (one per stage, one thread each) runs, on the same stage
modules, in turn: ``torch``'s ``Schedule1F1B`` (with ``PipelineStage``), our ``1f1b``, ``gpipe`` and ``2bw``.
Every schedule gets a fresh copy of the stages and its own optimizer (AdamW), ``warmup`` batches, then ``N``
timed batches and a drain (2BW) or nothing (the flushing schedules end each batch empty). Rank 0 takes the wall
time from the end of batch ``warmup - 1`` to the end of the drain (``batches/s``); ``steady`` leaves the drain out.

Configurations:

* ``real:P:M``: the ``tiny`` SmolLM2 cut into ``P`` stages (real compute);
* ``sleep:P:M``: stages whose forward / backward sleep ``--tf`` / ``--tb`` seconds on a tiny tensor (isolates
  the schedule and the runtime's overheads on a machine with fewer cores than stages).

Efficiency is the bubble-free time ``max_s m (tf_s + tb_s)`` per batch divided by the measured time per batch.
The prediction is :func:`lightning_async.pipeline.timing.simulate_lists` over the same action lists and the
same window, with the stage times (known for sleep stages, timed on each rank before the run for real ones), the
measured one-hop p2p latency and the measured optimizer step. Each rank also splits its time into compute,
p2p waits, updates and the rest (runtime Python), to show where time goes.

    python benchmarks/pipeline_throughput.py --breakdown --json runs/pipeline_throughput.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _stages import SLEEP_WIDTH, Workload, p2p_probe, ping_pong, spawn, time_stage  # noqa: E402

from lightning_async.optim import build_optimizer  # noqa: E402
from lightning_async.pipeline import schedules as S  # noqa: E402
from lightning_async.pipeline.groups import make_pipeline_groups  # noqa: E402
from lightning_async.pipeline.runtime import PipelineRuntime  # noqa: E402
from lightning_async.pipeline.stage import StageModule  # noqa: E402
from lightning_async.pipeline.timing import predict, simulate_lists  # noqa: E402

TORCH = "torch-1F1B"
ORDER = (TORCH, "1f1b", "gpipe", "2bw", "1f1b-fused", "2bw-fused")
DEFAULT_SCHEDULES = ORDER[:4]
FUSED = "-fused"  # our runtime without pre-posted receives: the fused send/receive groups NCCL runs


def base_schedule(name: str) -> str:
    """The schedule a row runs: ``torch-1F1B`` is a 1F1B, ``2bw-fused`` a 2BW."""
    return "1f1b" if name == TORCH else name.removesuffix(FUSED)


# ---------------------------------------------------------------------------------------------- timing helpers
class Clock:
    """Accumulates seconds per category on one rank."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.events: list[tuple[str, int, float, float]] = []
        self.active: set[str] = set()

    def wrap(self, name: str, fn):
        """``fn`` timed under ``name``; a call made while ``name`` is already being timed is not counted twice."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if name in self.active:
                return fn(*args, **kwargs)
            self.active.add(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.active.discard(name)
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
                self.n[name] = self.n.get(name, 0) + 1

        return timed

    def trace(self, kind: str, fn):
        """Like :meth:`wrap`, and also records ``(kind, microbatch, start, end)`` for ``fn(microbatch, ...)``."""

        @functools.wraps(fn)
        def timed(mb, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(mb, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.t[kind] = self.t.get(kind, 0.0) + t1 - t0
                self.n[kind] = self.n.get(kind, 0) + 1
                self.events.append((kind, mb, t0, t1))

        return timed

    def reset(self) -> None:
        self.t.clear()
        self.n.clear()
        self.events = []


def _optimizer(named):
    return build_optimizer("adamw", named, lr=1e-4, weight_decay=0.1)


def _opt_step_time(work: Workload, stage: int, reps: int = 10) -> float:
    _, named, _ = work.build(stage)
    opt = _optimizer(named)
    for _, q in named:
        q.grad = torch.randn_like(q)
    times = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- one schedule
def _run_ours(work: Workload, name: str, groups, batches, warm: int, clock: Clock) -> list[float]:
    stage, schedule = groups.stage, base_schedule(name)
    units, named, tied = work.build(stage)
    module = StageModule(units)
    rt = PipelineRuntime(
        module, _optimizer(named), schedule, work.m, work.split(), work.loss(), groups,
        tied_parameters=tied, count_tied_in_norm=stage == 0,
    )
    rt.transport.prepost_enabled = rt.transport.prepost_enabled and not name.endswith(FUSED)
    rt._forward = clock.trace("forward", rt._forward)
    rt._backward = clock.trace("backward", rt._backward)
    rt._begin_update = clock.wrap("update", rt._begin_update)
    rt._apply_update = clock.wrap("update", rt._apply_update)
    rt.transport.exchange = clock.wrap("p2p", rt.transport.exchange)
    rt.transport.receive = clock.wrap("p2p", rt.transport.receive)
    rt.transport._send_header = clock.wrap("header", rt.transport._send_header)
    rt.transport._receive_header = clock.wrap("header", rt.transport._receive_header)
    rt.collect_loss = clock.wrap("loss", rt.collect_loss)
    marks = []
    for b, batch in enumerate(batches):
        if b == warm:
            clock.reset()
            start = time.perf_counter()
        rt.train_batch(batch)
        report = b - 1 if schedule == "2bw" else b
        if report >= 0:
            rt.collect_loss(report)
        marks.append(time.perf_counter())
    rt.drain()
    if schedule == "2bw":
        rt.collect_loss(len(batches) - 1)
    marks.append(time.perf_counter())
    clock.t["total"] = marks[-1] - start
    return marks


def _run_torch(work: Workload, groups, batches, warm: int, clock: Clock) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage, p = groups.stage, groups.num_stages
    units, named, tied = work.build(stage)
    module = StageModule(units)
    pstage = PipelineStage(module, stage, p, torch.device("cpu"), group=groups.p2p)
    sched = Schedule1F1B(pstage, work.m, loss_fn=work.loss())
    opt = _optimizer(named)
    tied_params = [q for n, q in module.named_parameters() if n in tied]
    split = work.split()
    marks = []
    for b, batch in enumerate(batches):
        if b == warm:
            clock.reset()
            start = time.perf_counter()
        inputs, targets = split(batch)
        t0 = time.perf_counter()
        losses: list = []
        if stage == 0:
            sched.step(inputs)
        elif stage == p - 1:
            sched.step(target=targets, losses=losses)
        else:
            sched.step()
        t1 = time.perf_counter()
        # What a correct user adds around Schedule1F1B (our runtime does the same inside): sum the tied
        # embedding's gradient over first and last stage, step, and share the last stage's loss with every rank.
        if tied_params and groups.tied is not None:
            for q in tied_params:
                dist.all_reduce(q.grad, group=groups.tied)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros(())
        dist.all_reduce(loss, group=groups.metrics)
        t2 = time.perf_counter()
        clock.t["step"] = clock.t.get("step", 0.0) + t1 - t0
        clock.t["update"] = clock.t.get("update", 0.0) + t2 - t1
        marks.append(time.perf_counter())
    marks.append(time.perf_counter())  # no drain: every step flushes
    clock.t["total"] = marks[-1] - start
    return marks


def run_config(work: Workload, warm: int, n: int, order: tuple[str, ...], rounds: int = 1) -> dict:
    """Runs inside every rank of a ``work.p``-process gloo group; rank 0's dict carries the results."""
    rank, p = dist.get_rank(), work.p
    groups = make_pipeline_groups(rank, p, p)
    stage = groups.stage
    if work.kind == "sleep":
        tf, tb = work.tf, work.tb
        shape = (work.microbatch_size, SLEEP_WIDTH)
    else:
        tf, tb = time_stage(work, stage)
        shape = (work.microbatch_size, work.seq_len, 128)
    upd = _opt_step_time(work, stage)
    comm = ping_pong(shape, group=groups.p2p) if p > 1 else 0.0
    header = ping_pong((10,), dtype=torch.int64, group=groups.p2p) if p > 1 else 0.0
    stage_times = [None] * p
    dist.all_gather_object(stage_times, (tf, tb, upd, comm, header))
    batches = [work.batch(100 + b) for b in range(warm + n)]
    out = {"stage_times": stage_times, "runs": {name: [] for name in order}}
    for _ in range(rounds):  # interleaved rounds: a drift in machine load hits every schedule alike
        for name in order:
            clock = Clock()
            dist.barrier()
            if name == TORCH:
                marks = _run_torch(work, groups, batches, warm, clock)
            else:
                marks = _run_ours(work, name, groups, batches, warm, clock)
            clocks = [None] * p
            dist.all_gather_object(clocks, {"t": dict(clock.t), "n": dict(clock.n), "events": clock.events})
            out["runs"][name].append({"marks": marks, "clocks": clocks})
    return out


# ---------------------------------------------------------------------------------------------- prediction
def predicted_window(schedule: str, p: int, m: int, tf, tb, comm, upd, warm: int, n: int) -> tuple[float, float]:
    """Simulated seconds per batch on stage 0 over the measured window: (with the final drain, steady)."""
    lists = [S.run_actions(schedule, s, p, m, warm + n) for s in range(p)]
    trace = simulate_lists(lists, tf, tb, comm, upd)
    ends = []  # stage 0: end of each call
    k = 0
    for b in range(warm + n):
        k += len(S.call_actions(schedule, 0, p, m, b, fresh=b == 0))
        ends.append(trace[0][k - 1][2])
    t0 = ends[warm - 1]
    return (trace[0][-1][2] - t0) / n, (ends[-1] - t0) / n


def in_situ(rs: list[dict], p: int) -> tuple[list[float], list[float], float] | None:
    """Per-stage mean forward/backward seconds and the median effective hop latency, from our runs' traces.

    The hop latency of ``F j`` into stage ``s + 1`` is ``start(F j on s+1) - end(F j on s)``, counted only when
    stage ``s + 1`` sat idle waiting for it (likewise for ``B j`` into stage ``s - 1``): send, transfer,
    wake-up of the receiver and the runtime's Python between the two actions.
    """
    fwd, bwd, hops = [[] for _ in range(p)], [[] for _ in range(p)], []
    for run in rs:
        ev = [c["events"] for c in run["clocks"]]
        for s in range(p):
            for kind, _, a, b in ev[s]:
                (fwd if kind == "forward" else bwd)[s].append(b - a)
        for s in range(p):
            own = sorted(ev[s], key=lambda e: e[2])
            idx = {(k, mb): (a, b) for k, mb, a, b in ev[s]}
            prev_end = {}
            for i, (k, mb, a, b) in enumerate(own):
                prev_end[(k, mb)] = own[i - 1][3] if i else None
            for k, src in (("forward", s - 1), ("backward", s + 1)):
                if not 0 <= src < p:
                    continue
                other = {(kk, mb): (a, b) for kk, mb, a, b in ev[src]}
                for (kk, mb), (a, _) in idx.items():
                    if kk != k or (kk, mb) not in other:
                        continue
                    sent = other[(kk, mb)][1]
                    before = prev_end.get((kk, mb))
                    if before is not None and before < sent:
                        hops.append(a - sent)
    if not any(fwd):
        return None
    return [statistics.mean(x) for x in fwd], [statistics.mean(x) for x in bwd], statistics.median(hops) if hops else 0.0


def analyse(label: str, work: Workload, warm: int, n: int, res: dict) -> list[dict]:
    p, m = work.p, work.m
    st = res["stage_times"]
    tf = [s[0] for s in st]
    tb = [s[1] for s in st]
    upd = [s[2] for s in st]
    comm = st[0][3]
    ideal = max(m * (f + b) for f, b in zip(tf, tb))
    rows = []
    for name, runs in res["runs"].items():
        per = [((r["marks"][-1] - r["marks"][warm - 1]) / n, r) for r in runs]
        per_batch, run = min(per, key=lambda x: x[0])
        marks = run["marks"]
        steady = (marks[-2] - marks[warm - 1]) / n
        sched = base_schedule(name)
        pred, pred_steady = predicted_window(sched, p, m, tf, tb, comm, upd, warm, n)
        pred0 = predict(sched, p, m, tf, tb, 0.0, num_batches=warm + n)["per_batch_s"]
        row = dict(
            config=label, kind=work.kind, p=p, m=m, schedule=name, n_batches=n, warmup=warm, rounds=len(runs),
            batches_per_s=1 / per_batch, microbatches_per_s=m / per_batch, per_batch_s=per_batch,
            all_rounds_per_batch_s=[x for x, _ in per],
            steady_per_batch_s=steady, ideal_per_batch_s=ideal,
            efficiency=ideal / per_batch, steady_efficiency=ideal / steady,
            predicted_per_batch_s=pred, predicted_efficiency=ideal / pred,
            predicted_steady_efficiency=ideal / pred_steady,
            predicted_no_comm_efficiency=ideal / pred0,
            measured_over_predicted=per_batch / pred,
            stage_forward_s=tf, stage_backward_s=tb, optimizer_step_s=upd, hop_latency_s=comm,
            header_latency_s=st[0][4],
            clocks=[{k: v for k, v in c.items() if k != "events"} for c in run["clocks"]],
        )
        src = "1f1b" if name == TORCH else name  # torch's runs carry no trace: use our 1f1b's on the same stages
        situ = in_situ(res["runs"][src], p) if src in res["runs"] else None
        if situ is not None:
            sf, sb, hop = situ
            pred_situ, _ = predicted_window(sched, p, m, sf, sb, hop, upd, warm, n)
            row.update(
                in_situ_forward_s=sf, in_situ_backward_s=sb, in_situ_hop_s=hop,
                predicted_in_situ_per_batch_s=pred_situ, predicted_in_situ_efficiency=ideal / pred_situ,
                measured_over_predicted_in_situ=per_batch / pred_situ,
            )
        rows.append(row)
    torch_bps = next((r["batches_per_s"] for r in rows if r["schedule"] == TORCH), None)
    for r in rows:
        r["ratio_to_torch"] = r["batches_per_s"] / torch_bps if torch_bps else None
    return rows


def breakdown(row: dict) -> str:
    """Per-rank split of the timed window (seconds per batch) into categories."""
    n = row["n_batches"]
    lines = []
    for rank, c in enumerate(row["clocks"]):
        t = c["t"]
        total = t.get("total", 0.0)
        parts = {k: v for k, v in t.items() if k != "total"}
        if "p2p" in parts and "header" in parts:
            parts["p2p"] -= parts["header"]
        counted = sum(v for k, v in parts.items())
        parts["other"] = total - counted
        cells = " ".join(f"{k}={1e3 * v / n:7.1f}" for k, v in sorted(parts.items()))
        lines.append(f"    rank {rank}: total={1e3 * total / n:7.1f} ms/batch  {cells}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = (
        "| config | schedule | batches/s | micro-batches/s | efficiency vs bubble-free | steady efficiency "
        "| predicted efficiency | measured / predicted time | predicted eff. (in-situ times) "
        "| measured / predicted (in-situ) | ratio to torch Schedule1F1B |"
    )
    out = [head, "|" + "---|" * 11]
    for r in rows:
        out.append(
            f"| {r['config']} | {r['schedule']} | {r['batches_per_s']:.3f} | {r['microbatches_per_s']:.2f} | "
            f"{r['efficiency']:.3f} | {r['steady_efficiency']:.3f} | {r['predicted_efficiency']:.3f} | "
            f"{r['measured_over_predicted']:.3f} | {r.get('predicted_in_situ_efficiency', float('nan')):.3f} | "
            f"{r.get('measured_over_predicted_in_situ', float('nan')):.3f} | {r['ratio_to_torch']:.3f} |"
        )
    return "\n".join(out)


def parse_config(text: str, args) -> tuple[str, Workload, int]:
    kind, p, m = text.split(":")
    p, m = int(p), int(m)
    if kind == "sleep":
        work = Workload("sleep", p, m, tf=args.tf, tb=args.tb)
        n = max(args.min_batches, math.ceil(args.window_microbatches / m))
        label = f"sleep p={p} m={m}"
    elif kind == "real":
        work = Workload("real", p, m, microbatch_size=args.microbatch_size, seq_len=args.seq_len)
        n = max(args.min_batches, math.ceil(args.real_window_microbatches / m))
        label = f"real p={p} m={m}"
    else:
        raise ValueError(f"unknown config kind {kind!r} (use sleep:P:M or real:P:M)")
    return label, work, n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", default="real:2:2,real:2:4,sleep:4:4,sleep:4:8,sleep:8:8,sleep:8:16",
        help="comma-separated KIND:P:M (KIND: real or sleep)",
    )
    ap.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                    help=f"subset of {','.join(ORDER)} (-fused: without pre-posted receives, as on NCCL)")
    ap.add_argument("--tf", type=float, default=0.020, help="sleep stages: forward seconds per micro-batch")
    ap.add_argument("--tb", type=float, default=0.040, help="sleep stages: backward seconds per micro-batch")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches before the window")
    ap.add_argument("--window-microbatches", type=int, default=64, help="sleep: timed micro-batches (N = this / m)")
    ap.add_argument("--real-window-microbatches", type=int, default=48, help="real: timed micro-batches")
    ap.add_argument("--min-batches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=4, help="real: sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=128, help="real: tokens per sequence")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the fastest of each is kept")
    ap.add_argument("--breakdown", action="store_true", help="print the per-rank time split of every run")
    ap.add_argument("--json", default=None, help="write all rows (with per-rank clocks) here")
    ap.add_argument("--probe", action="store_true", help="only run the 2-rank gloo p2p anatomy probe and exit")
    args = ap.parse_args(argv)
    if args.probe:
        res = spawn(2, p2p_probe)
        for k, v in sorted({**res[0], **res[1]}.items()):
            print(f"{k:>22}: {1e3 * v:.3f} ms")
        return
    order = tuple(s for s in ORDER if s in args.schedules.split(","))
    rows = []
    started = time.perf_counter()
    for text in args.configs.split(","):
        label, work, n = parse_config(text, args)
        t0 = time.perf_counter()
        res = spawn(work.p, run_config, work, args.warmup, n, order, args.rounds)[0]
        new = analyse(label, work, args.warmup, n, res)
        rows += new
        st = res["stage_times"]
        print(
            f"# {label}: N={n} timed batches; stage fwd/bwd ms "
            + " ".join(f"{1e3 * a:.1f}/{1e3 * b:.1f}" for a, b, *_ in st)
            + f"; optimizer step ms {' '.join(f'{1e3 * s[2]:.2f}' for s in st)}"
            + f"; hop {1e6 * st[0][3]:.0f} us; header hop {1e6 * st[0][4]:.0f} us; {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        for r in new:
            print(
                f"  {r['schedule']:>10}: {r['batches_per_s']:.3f} batches/s  eff {r['efficiency']:.3f} "
                f"(steady {r['steady_efficiency']:.3f})  predicted {r['predicted_efficiency']:.3f} "
                f"(steady {r['predicted_steady_efficiency']:.3f}, no comm {r['predicted_no_comm_efficiency']:.3f})  "
                f"meas/pred {r['measured_over_predicted']:.3f}  x torch {r['ratio_to_torch']:.3f}  "
                f"rounds ms {' '.join(f'{1e3 * x:.0f}' for x in r['all_rounds_per_batch_s'])}",
                flush=True,
            )
            if "predicted_in_situ_efficiency" in r:
                print(
                    f"{'':>14}in-situ F/B ms "
                    + " ".join(f"{1e3 * a:.1f}/{1e3 * b:.1f}" for a, b in zip(r["in_situ_forward_s"], r["in_situ_backward_s"]))
                    + f", hop {1e3 * r['in_situ_hop_s']:.2f} ms -> predicted eff {r['predicted_in_situ_efficiency']:.3f}"
                    f", meas/pred {r['measured_over_predicted_in_situ']:.3f}",
                    flush=True,
                )
            if args.breakdown:
                print(breakdown(r), flush=True)
    print()
    print(table(rows))
    print(f"\ntotal {time.perf_counter() - started:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
