"""Timing and memory model of the pipeline schedules (pure Python, no torch).

The simulator executes each rank's action list (:meth:`~lightning_async.pipeline.schedules.ScheduleSpec.run_actions`)
under the runtime's dependency rules, on the model's pieces (virtual stages; one per rank except for the
interleaved and V schedules):

* a rank runs its own list strictly in order, one action at a time;
* ``F(j)`` of piece ``k > 0`` needs ``F(j)`` of piece ``k - 1`` finished, plus one hop of communication when the
  two pieces live on different ranks;
* ``B(j)`` / ``I(j)`` of piece ``k`` below the last needs ``B(j)`` / ``I(j)`` of piece ``k + 1`` (plus a hop); on
  the last piece it needs its own ``F(j)``;
* ``W(j)`` (the weight gradient of a split backward) needs nothing but the actions before it on its rank;
* ``U`` likewise, and takes ``update_s`` (default 0).

Every action starts as soon as its rank is free and its dependency has arrived. Because the order on each rank
is fixed, the start times are the longest paths through this dependency graph; :func:`simulate_lists` computes
them with a work list that wakes a rank when the action it waits for finishes (an event-driven run in dependency
order rather than in time order, with identical results). A rank whose next action can never become ready is
reported as a deadlock.

Model assumptions: communication is a fixed latency per hop that overlaps with compute (sends are asynchronous,
links have no contention and no bandwidth limit); compute times do not depend on the micro-batch or on what the
neighbours do; a split backward takes as long as the whole one (``I + W = B``); the first piece's inputs and the
last piece's targets are always available.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_async.pipeline.schedules import (
    BACKWARD, FORWARD, GRADIENT_ACTIONS, INPUT_GRAD, UPDATE, WEIGHT_GRAD, Action, ScheduleSpec, spec,
)
from lightning_async.pipeline.program import APPLY_UPDATE, Step, lower

__all__ = [
    "DeadlockError",
    "SimResult",
    "WEIGHT_GRAD_SHARE",
    "StageMemory",
    "memory_model",
    "predict",
    "render_timeline",
    "simulate",
    "inflight_and_versions",
    "peak_activation_bytes",
    "schedule_memory",
    "simulate_lists",
]


class DeadlockError(RuntimeError):
    """The action lists cannot complete under the dependency rules."""


@dataclass
class SimResult:
    """Outcome of one simulation. Times are in the unit of the inputs (seconds in :func:`predict`)."""

    schedule: str
    num_stages: int
    n_microbatches: int
    num_batches: int
    total_time: float
    #: per stage: list of (action, start, end)
    trace: list[list[tuple[Action, float, float]]]
    #: batch -> time at which the last stage to apply ``U(batch)`` finished it
    batch_end: list[float]
    steady_window: tuple[float, float, int]  # (start, end, number of batches inside)
    per_batch_time: float
    ideal_per_batch_time: float
    throughput_rel: float
    bubble: float
    bubble_per_stage: list[float]
    bubble_total: float
    bubble_total_per_stage: list[float]
    peak_inflight: list[int]
    weight_versions: list[int]
    busy_per_batch: list[float] = field(default_factory=list)
    chunks: int = 1  # pieces per rank

    def summary(self) -> dict:
        """JSON-friendly digest (no trace)."""
        return {
            "schedule": self.schedule,
            "num_stages": self.num_stages,
            "n_microbatches": self.n_microbatches,
            "num_batches": self.num_batches,
            "total_time": self.total_time,
            "per_batch_time": self.per_batch_time,
            "ideal_per_batch_time": self.ideal_per_batch_time,
            "throughput_rel": self.throughput_rel,
            "bubble": self.bubble,
            "bubble_per_stage": self.bubble_per_stage,
            "bubble_total": self.bubble_total,
            "bubble_total_per_stage": self.bubble_total_per_stage,
            "peak_inflight": self.peak_inflight,
            "weight_versions": self.weight_versions,
            "steady_window": list(self.steady_window),
        }


def _per_stage(value: float | Sequence[float], p: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * p
    values = [float(v) for v in value]
    if len(values) != p:
        raise ValueError(f"{name} has {len(values)} entries, expected one per stage ({p}).")
    return values


def _per_hop(value: float | Sequence[float], pieces: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * max(pieces - 1, 0)
    values = [float(v) for v in value]
    if len(values) != max(pieces - 1, 0):
        raise ValueError(f"comm has {len(values)} entries, expected one per hop ({pieces - 1}).")
    return values


def _version_used(schedule: ScheduleSpec, batch: int) -> int:
    """Number of updates contained in the weights that ``batch`` runs on.

    Flushing schedules use the newest weights, ``W_b`` (updates ``U(0..b-1)``). 2BW uses ``V(b)``: updates
    ``U(0..b-2)``, i.e. ``max(b - 1, 0)`` of them (``V(0) = V(1) = W0``).
    """
    return max(batch - 1, 0) if schedule.delayed else batch


def _durations(kind: str, tf: float, tb: float, tw: float) -> float:
    if kind == FORWARD:
        return tf
    if kind == BACKWARD:
        return tb
    if kind == INPUT_GRAD:
        return tb - tw
    return tw  # WEIGHT_GRAD


def simulate_lists(
    actions: Sequence[Sequence[Action]],
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    comm: float | Sequence[float] = 0.0,
    update: float | Sequence[float] = 0.0,
    weight: float | Sequence[float] | None = None,
    schedule: "str | ScheduleSpec" = "1f1b",
    overhead: float | Sequence[float] = 0.0,
) -> list[list[tuple[Action, float, float]]]:
    """Run arbitrary per-rank action lists; return the trace ``[(action, start, end), ...]`` per rank.

    ``forward``/``backward``/``weight`` (the ``W`` part of a split backward, default half of it) are per *piece*
    (virtual stage: a scalar, or one value per piece in model order), ``comm`` per boundary between consecutive
    pieces (a scalar or one per boundary; boundaries inside a rank cost nothing), ``update`` per rank.
    ``schedule`` says which rank and chunk hold each piece. ``overhead`` (per rank, or a scalar) is added to every
    ``F``/``B``/``I``/``W``: a runtime's own cost per action (bookkeeping, launching sends). Raises
    :class:`DeadlockError` naming each stuck rank's next action when the lists cannot complete.
    """
    s_ = spec(schedule)
    p = len(actions)
    pieces = s_.virtual_stages(p)
    tf, tb = _per_stage(forward, pieces, "forward"), _per_stage(backward, pieces, "backward")
    tw = [b / 2 for b in tb] if weight is None else _per_stage(weight, pieces, "weight")
    tu, hop = _per_stage(update, p, "update"), _per_hop(comm, pieces)
    extra = _per_stage(overhead, p, "overhead")
    holder = [s_.holder(k, p) for k in range(pieces)]
    done: list[dict[tuple[str, int, int], float]] = [{} for _ in range(p)]
    ptr, free = [0] * p, [0.0] * p
    trace: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    pending, queued = deque(range(p)), [True] * p

    def wake(rank: int) -> None:
        if not queued[rank]:
            queued[rank] = True
            pending.append(rank)

    def arrival(step: Step) -> float | None:
        """When the input of ``step`` (lowered: it names its channel and whether it crosses ranks) is there."""
        kind, piece = step.source
        other, kinds = (piece - 1, (FORWARD,)) if kind == "act" else (piece + 1, GRADIENT_ACTIONS)
        r, c = holder[other]
        finished = next((done[r][k, step.microbatch, c] for k in kinds if (k, step.microbatch, c) in done[r]), None)
        if finished is None:
            return None
        return finished + (hop[min(piece, other)] if step.remote_input else 0.0)

    # the programs the runtime runs, less the steps that take no time of their own (applying an update)
    todos = [[(step.action, step) for step in lower(s_, r, p, actions[r]) if step.kind != APPLY_UPDATE] for r in range(p)]
    while pending:
        r = pending.popleft()
        queued[r] = False
        todo = todos[r]
        while ptr[r] < len(todo):
            a, step = todo[ptr[r]]
            ready = 0.0
            if a.kind == UPDATE:
                duration = tu[r]
            else:
                piece = step.piece
                duration = _durations(a.kind, tf[piece], tb[piece], tw[piece]) + extra[r]
                if step.source is not None:
                    ready = arrival(step)
                elif a.kind in GRADIENT_ACTIONS:
                    ready = done[r].get((FORWARD, a.microbatch, a.chunk))
                if ready is None:
                    break  # woken again when the dependency finishes
            start = max(free[r], ready)
            end = start + duration
            key = (a.kind, a.microbatch if a.kind != UPDATE else a.batch, a.chunk)
            if key in done[r]:
                raise ValueError(f"rank {r} runs {a!r} twice")
            done[r][key] = end
            free[r] = end
            trace[r].append((a, start, end))
            ptr[r] += 1
            if a.kind == FORWARD and piece < pieces - 1:
                wake(holder[piece + 1][0])
            elif a.kind in GRADIENT_ACTIONS and piece > 0:
                wake(holder[piece - 1][0])
    stuck = [f"stage {r} waits at {actions[r][ptr[r]]!r} (#{ptr[r]})" for r in range(p) if ptr[r] < len(actions[r])]
    if stuck:
        raise DeadlockError("pipeline deadlock: " + "; ".join(stuck))
    return trace


def _busy_in(intervals: list[tuple[Action, float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for _, s, e in intervals)


def _per_piece(value, s_: ScheduleSpec, p: int, name: str) -> list[float]:
    """Times per piece from a rank's share (a scalar, or one per rank: each of its ``v`` pieces takes 1/v of it)
    or from one value per piece."""
    pieces = s_.virtual_stages(p)
    if not isinstance(value, (int, float)) and len(value) == pieces and pieces != p:
        return [float(x) for x in value]
    share = _per_stage(value, p, name)
    return [share[s_.holder(k, p)[0]] / s_.chunks for k in range(pieces)]


def simulate(
    schedule: "str | ScheduleSpec",
    num_stages: int,
    n_microbatches: int,
    num_batches: int = 5,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    comm: float | Sequence[float] = 0.0,
    update: float | Sequence[float] = 0.0,
    warmup_batches: int | None = None,
    weight: float | Sequence[float] | None = None,
) -> SimResult:
    """Simulate ``num_batches`` training calls plus the final drain of ``schedule``.

    ``forward``/``backward``/``weight`` (the weight-gradient part of the backward, default half of it): a rank's
    share of the model per micro-batch, a scalar or one value per rank (a schedule with ``v`` chunks per rank runs
    each chunk in ``1/v`` of it), or one value per piece. ``update``: per batch and rank. ``comm``: latency per hop
    between ranks, a scalar or one value per boundary between consecutive pieces.

    The steady state is measured between the end of batch ``warmup_batches`` (default 1, or 0 with fewer than
    4 batches) and the end of batch ``num_batches - 2`` (the last batch ends inside the drain, which is faster);
    the end of a batch is when the last rank to apply its update finishes it.
    """
    s_ = spec(schedule)
    s_.validate(num_stages, n_microbatches)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}.")
    p, m = num_stages, n_microbatches
    lists = [s_.run_actions(r, p, m, num_batches) for r in range(p)]
    tf, tb = _per_piece(forward, s_, p, "forward"), _per_piece(backward, s_, p, "backward")
    tw = None if weight is None else _per_piece(weight, s_, p, "weight")
    trace = simulate_lists(lists, tf, tb, comm, update, tw, s_)
    tu = _per_stage(update, p, "update")

    total = max((t[-1][2] for t in trace if t), default=0.0)
    batch_end = [0.0] * num_batches
    for t in trace:
        for a, _, e in t:
            if a.kind == UPDATE:
                batch_end[a.batch] = max(batch_end[a.batch], e)

    # Steady window.
    if warmup_batches is None:
        warmup_batches = 1 if num_batches >= 4 else 0
    last = num_batches - 2 if num_batches >= 3 else num_batches - 1
    if last > warmup_batches:
        lo, hi, n = batch_end[warmup_batches], batch_end[last], last - warmup_batches
    else:  # too few batches for a window: whole run
        lo, hi, n = 0.0, total, num_batches
    per_batch = (hi - lo) / n

    share = [sum(tf[k] + tb[k] for k in range(s_.virtual_stages(p)) if s_.holder(k, p)[0] == r) for r in range(p)]
    busy_per_batch = [m * share[r] + tu[r] for r in range(p)]
    ideal = max(busy_per_batch)
    width = hi - lo
    steady_busy = [_busy_in(trace[r], lo, hi) for r in range(p)]
    bubble_stage = [1.0 - b / width if width > 0 else 0.0 for b in steady_busy]
    bubble = 1.0 - sum(steady_busy) / (p * width) if width > 0 else 0.0
    all_busy = [sum(e - s0 for _, s0, e in t) for t in trace]
    bubble_total_stage = [1.0 - b / total if total > 0 else 0.0 for b in all_busy]
    bubble_total = 1.0 - sum(all_busy) / (p * total) if total > 0 else 0.0
    peak_inflight, versions = inflight_and_versions(s_, [[a for a, _, _ in t] for t in trace])

    return SimResult(
        schedule=s_.name,
        num_stages=p,
        n_microbatches=m,
        num_batches=num_batches,
        total_time=total,
        trace=trace,
        batch_end=batch_end,
        steady_window=(lo, hi, n),
        per_batch_time=per_batch,
        ideal_per_batch_time=ideal,
        throughput_rel=ideal / per_batch if per_batch > 0 else 1.0,
        bubble=bubble,
        bubble_per_stage=bubble_stage,
        bubble_total=bubble_total,
        bubble_total_per_stage=bubble_total_stage,
        peak_inflight=peak_inflight,
        weight_versions=versions,
        busy_per_batch=busy_per_batch,
        chunks=s_.chunks,
    )


#: what a split backward keeps of a micro-batch from ``I`` to ``W``, as a share of its activations, when the bytes
#: are not given: a decoder block's linear-layer inputs and output gradients are about 70% of what it saves for the
#: backward (``stage_costs.nominal_model``; measured 0.70 on SmolLM2 blocks, ``measure.weight_grad_bytes``)
WEIGHT_GRAD_SHARE = 0.7


def _activation_changes(a: Action, full: float, residue: float) -> tuple[float, float]:
    """``(change of the activation bytes held, change of the micro-batches held in full)`` after action ``a`` on a
    piece whose micro-batch saves ``full`` bytes for its backward and keeps ``residue`` of them from ``I`` to ``W``:

    * ``F``: ``+full`` (everything autograd saves for the backward);
    * ``B`` (a whole backward): ``-full``;
    * ``I`` (a split backward's input gradient): ``-full + residue``: autograd frees the graph, and only what the
      deferred weight gradients need stays, each linear layer's input and output gradient
      (:mod:`~lightning_async.pipeline.weight_grad`);
    * ``W``: ``-residue``.
    """
    if a.kind == FORWARD:
        return full, 1
    if a.kind == BACKWARD:
        return -full, -1
    if a.kind == INPUT_GRAD:
        return residue - full, -1
    if a.kind == WEIGHT_GRAD:
        return -residue, 0
    return 0.0, 0


def peak_activation_bytes(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], piece_bytes: Sequence[float],
                          weight_grad_bytes: Sequence[float] | None = None) -> list[float]:
    """Per rank, replaying its list: the peak of the activation bytes held after each action.

    A micro-batch forwarded on a piece holds that piece's ``piece_bytes`` (what autograd saves for the backward)
    from its ``F`` until its backward: a whole ``B`` frees them; a split backward's ``I`` frees them but for the
    piece's ``weight_grad_bytes`` (the linear layers' inputs and output gradients the deferred weight gradients
    need; default :data:`WEIGHT_GRAD_SHARE` of ``piece_bytes``), which its ``W`` frees.
    """
    s_ = spec(schedule)
    residue = [b * WEIGHT_GRAD_SHARE for b in piece_bytes] if weight_grad_bytes is None else list(weight_grad_bytes)
    p, peaks = len(lists), []
    for r, actions in enumerate(lists):
        held = peak = 0.0
        for a in actions:
            if a.kind != UPDATE:
                k = s_.piece(r, a.chunk, p)
                held += _activation_changes(a, piece_bytes[k], residue[k])[0]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def inflight_and_versions(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]]) -> tuple[list[float], list[int]]:
    """Per rank, replaying its list: the peak of the micro-batches whose activations are held in full, in
    micro-batches of the rank's whole share (a chunk's micro-batch counts ``1/v``; held from ``F`` until ``B``, or
    until ``I`` when the backward is split: after it only the weight gradients' inputs stay, see
    :func:`peak_activation_bytes`), and the peak number of live weight versions (a micro-batch's version stays live
    until its last backward action, ``W`` when split: its weight gradient accumulates into that version)."""
    s_ = spec(schedule)
    last = WEIGHT_GRAD if s_.split_backward else BACKWARD
    peaks, versions = [], []
    for actions in lists:
        reading: dict[int, int] = {}  # batch -> (chunk, micro-batch) pairs whose last backward action is to come
        updates, peak, live_peak, count = 0, 0, 1, 0
        for a in actions:
            count += _activation_changes(a, 0.0, 0.0)[1]
            if a.kind == FORWARD:
                reading[a.batch] = reading.get(a.batch, 0) + 1
            elif a.kind == last:
                reading[a.batch] -= 1
                if not reading[a.batch]:
                    del reading[a.batch]
            elif a.kind == UPDATE:
                updates += 1
            peak = max(peak, count)
            live = {updates} | {_version_used(s_, b) for b in reading}
            live_peak = max(live_peak, len(live))
        peaks.append(peak / s_.chunks if s_.chunks > 1 else peak)
        versions.append(live_peak)
    return peaks, versions


def predict(
    schedule: "str | ScheduleSpec",
    p: int,
    m: int,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    comm_s: float | Sequence[float] = 0.0,
    num_batches: int = 6,
    update_s: float | Sequence[float] = 0.0,
    weight_s: float | Sequence[float] | None = None,
) -> dict:
    """Predicted timing of ``num_batches`` training batches, for putting next to a measured run.

    Returns a dict with ``per_batch_s`` (steady state), ``total_s`` (all batches plus the final drain, from an
    empty pipeline), ``bubble`` (steady, all stages), ``bubble_total`` (whole run), ``bubble_per_stage``,
    ``throughput_rel`` (bubble-free limit / per-batch time), ``ideal_per_batch_s``, ``microbatches_per_s``,
    ``peak_inflight`` and ``weight_versions`` per stage, and ``batch_end_s`` (when each batch's last update
    finished).
    """
    r = simulate(schedule, p, m, num_batches, forward_s, backward_s, comm_s, update_s, weight=weight_s)
    return {
        "schedule": r.schedule,
        "p": p,
        "m": m,
        "num_batches": num_batches,
        "per_batch_s": r.per_batch_time,
        "total_s": r.total_time,
        "ideal_per_batch_s": r.ideal_per_batch_time,
        "throughput_rel": r.throughput_rel,
        "microbatches_per_s": m / r.per_batch_time if r.per_batch_time > 0 else float("inf"),
        "bubble": r.bubble,
        "bubble_total": r.bubble_total,
        "bubble_per_stage": r.bubble_per_stage,
        "peak_inflight": r.peak_inflight,
        "weight_versions": r.weight_versions,
        "batch_end_s": r.batch_end,
    }


# ----------------------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds. ``sync``: one weight version; ``twobw``: two; ``twobw_ef``: two plus ``u_prev``."""

    params: int
    grads: int
    optimizer: int
    activations_sync: int
    activations_2bw: int
    sync: int
    twobw: int
    twobw_ef: int


def memory_model(
    param_bytes: int | Sequence[int],
    optimizer_bytes: int | Sequence[int],
    activation_bytes: int | Sequence[int],
    inflight_sync: Sequence[int],
    inflight_2bw: Sequence[int] | None = None,
    grad_bytes: int | Sequence[int] | None = None,
) -> list[StageMemory]:
    """Per-stage memory for synchronous training, 2BW and 2BW with Error Feedback.

    ``param_bytes``/``optimizer_bytes``/``activation_bytes`` (per in-flight micro-batch) are scalars or one per
    stage; ``inflight_*`` are the peak in-flight micro-batches per stage (from :func:`simulate`). Gradients are
    one parameter-sized accumulator (``grad_bytes``, default ``param_bytes``): under 2BW backwards run in order,
    so only one batch accumulates at a time. 2BW keeps a second weight version; EF adds one parameter-sized
    buffer (the previous update).
    """
    p = len(inflight_sync)
    inflight_2bw = list(inflight_sync) if inflight_2bw is None else list(inflight_2bw)

    def per(v, name):
        return [int(x) for x in _per_stage(v, p, name)]

    params, opt, act = per(param_bytes, "param_bytes"), per(optimizer_bytes, "optimizer_bytes"), per(
        activation_bytes, "activation_bytes"
    )
    grads = params if grad_bytes is None else per(grad_bytes, "grad_bytes")
    out = []
    for s in range(p):
        a_sync, a_2bw = act[s] * inflight_sync[s], act[s] * inflight_2bw[s]
        base = grads[s] + opt[s]
        out.append(
            StageMemory(
                params=params[s],
                grads=grads[s],
                optimizer=opt[s],
                activations_sync=a_sync,
                activations_2bw=a_2bw,
                sync=params[s] + base + a_sync,
                twobw=2 * params[s] + base + a_2bw,
                twobw_ef=3 * params[s] + base + a_2bw,
            )
        )
    return out


def schedule_memory(
    schedule: "str | ScheduleSpec",
    num_stages: int,
    n_microbatches: int,
    param_bytes: int | Sequence[int],
    optimizer_bytes: int | Sequence[int],
    activation_bytes: int | Sequence[int],
    correction_buffers: int = 0,
    grad_bytes: int | Sequence[int] | None = None,
    data_parallel_size: int = 1,
    shard_optimizer: bool = False,
    weight_grad_bytes: int | Sequence[int] | None = None,
    fsdp: bool = False,
) -> list[dict[str, int]]:
    """Per rank, the bytes ``schedule`` holds at its peak: weights (one version per ``weight_versions``), one
    gradient accumulator, optimizer state, a correction's parameter-sized buffers (EF: 1), and the activations held
    at the peak (:func:`peak_activation_bytes`).

    Activations, per micro-batch and piece: from ``F`` to ``B`` (or to ``I``, the input gradient of a split
    backward) everything autograd saves for the backward, ``activation_bytes``; from ``I`` to ``W`` (zero-bubble
    schedules: ``zbh1``, ``zbv``, ``2bw-split``) only what the deferred weight gradients need, the linear layers'
    inputs and output gradients, ``weight_grad_bytes`` (per micro-batch, in the same form as ``activation_bytes``;
    default :data:`WEIGHT_GRAD_SHARE` of it; ``stage_costs`` gives both). So ZB-H1's peak is 1F1B's plus the
    weight-gradient residue of the micro-batches whose ``W`` it defers, not their whole activations.

    ``param_bytes``/``optimizer_bytes``/``grad_bytes`` (default ``param_bytes``): a rank's share, a scalar or one value
    per rank, the same whatever the schedule. ``activation_bytes``: what one micro-batch saves for the backward on a
    rank's whole share (a scalar or one per rank: a schedule with ``v`` chunks holds ``v`` pieces of ``1/v`` of it
    each), or one value per piece. ``shard_optimizer`` (ZeRO-1 over ``data_parallel_size`` replicas): the optimizer
    state and the correction's buffers are split evenly over the replicas (the runtime's shares are whole parameters
    balanced by size, so a stage of few large tensors holds a little more; ``benchmarks/memory.py`` measures it).
    ``fsdp`` (FSDP2 inside a stage, :mod:`~lightning_async.pipeline.fsdp`): the optimizer state, the buffers and the
    weights are ``1/dp`` each, under 2BW three weight shards (the two versions and the parameters FSDP gathers from);
    the gradient stays whole, as FSDP accumulates it unsharded over a batch's micro-batches and reduce-scatters once
    (a unit's gathered weights, transient, are left out).
    """
    if (shard_optimizer or fsdp) and data_parallel_size < 2:
        raise ValueError("shard_optimizer and fsdp need data_parallel_size > 1 (the state is split over the replicas).")
    if shard_optimizer and fsdp:
        raise ValueError("fsdp already shards the optimizer state: pass shard_optimizer=False with it.")
    share = data_parallel_size if shard_optimizer or fsdp else 1
    s_ = spec(schedule)
    p = num_stages
    lists = [s_.run_actions(r, p, n_microbatches, 2) for r in range(p)]
    inflight, _ = inflight_and_versions(s_, lists)

    def per(v, name):
        return [int(x) for x in _per_stage(v, p, name)]

    params, opt = per(param_bytes, "param_bytes"), per(optimizer_bytes, "optimizer_bytes")
    piece_bytes = _per_piece(activation_bytes, s_, p, "activation_bytes")
    residue = None if weight_grad_bytes is None else _per_piece(weight_grad_bytes, s_, p, "weight_grad_bytes")
    activations = peak_activation_bytes(s_, lists, piece_bytes, residue)
    grads = params if grad_bytes is None else per(grad_bytes, "grad_bytes")
    weight_copies = s_.weight_versions + (1 if fsdp and s_.weight_versions > 1 else 0)
    out = []
    for r in range(p):
        row = {
            "weights": weight_copies * params[r] // (data_parallel_size if fsdp else 1), "gradients": grads[r],
            "optimizer": opt[r] // share,
            "correction": correction_buffers * params[r] // share, "activations": int(round(activations[r])),
            "inflight_microbatches": inflight[r],
        }
        row["total"] = row["weights"] + row["gradients"] + row["optimizer"] + row["correction"] + row["activations"]
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------------- timeline


def render_timeline(result: SimResult, chars_per_unit: int = 3, unit: float | None = None) -> str:
    """ASCII timeline, one row per rank: ``F5``/``B5`` = forward/backward of micro-batch 5 (``I5``/``W5``: a split
    backward's input and weight gradients; ``F5c1``: on the rank's chunk 1), ``.`` = idle,
    ``|`` = the update (``U``) of a batch finishes there (when updates take no time), ``U`` = a timed update.

    ``unit`` is the time per ``chars_per_unit`` characters (default: the shortest action duration).
    """
    durations = [e - s for t in result.trace for _, s, e in t if e > s]
    if unit is None:
        unit = min(durations) if durations else 1.0
    width = int(round(result.total_time / unit * chars_per_unit)) + 1
    rows = []
    for s, t in enumerate(result.trace):
        row = ["."] * width
        marks = []
        for a, start, end in t:
            i, j = int(round(start / unit * chars_per_unit)), int(round(end / unit * chars_per_unit))
            if j == i:
                if a.kind == UPDATE:
                    marks.append(i)
                continue
            label = " " + (repr(a) if a.kind != UPDATE else "U")
            cell = (label + " " * (j - i))[: j - i]
            row[i:j] = list(cell)
        for i in marks:
            if i < width:
                row[i] = "|"
        rows.append(f"s{s} " + "".join(row).rstrip("."))
    return "\n".join(rows)
