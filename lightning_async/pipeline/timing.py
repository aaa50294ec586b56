"""Timing and memory model of the pipeline schedules (pure Python, no torch).

The simulator executes the per-stage action lists of :func:`~lightning_async.pipeline.schedules.run_actions`
under the runtime's dependency rules:

* a stage runs its own list strictly in order, one action at a time;
* ``F(j)`` on stage ``s > 0`` needs ``F(j)`` on stage ``s - 1`` finished plus one hop of communication;
* ``B(j)`` on stage ``s < p - 1`` needs ``B(j)`` on stage ``s + 1`` finished plus one hop; on the last stage
  ``B(j)`` needs its own ``F(j)``;
* ``U`` needs nothing but the actions before it on the same stage and takes ``update_s`` (default 0).

Every action starts as soon as its stage is free and its dependency has arrived. Because the order on each stage
is fixed, the start times are the longest paths through this dependency graph; :func:`simulate` computes them with
a work list that wakes a stage when the action it waits for finishes (an event-driven run in dependency order
rather than in time order, with identical results). A stage whose next action can never become ready is reported
as a deadlock.

Model assumptions: communication is a fixed latency per hop that overlaps with compute (sends are asynchronous,
links have no contention and no bandwidth limit); compute times do not depend on the micro-batch or on what the
neighbours do; the first stage's inputs and the last stage's targets are always available.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_async.pipeline.schedules import BACKWARD, FORWARD, UPDATE, Action, run_actions, spec, validate

__all__ = [
    "DeadlockError",
    "SimResult",
    "StageMemory",
    "memory_model",
    "predict",
    "render_timeline",
    "simulate",
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


def _per_hop(value: float | Sequence[float], p: int) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * max(p - 1, 0)
    values = [float(v) for v in value]
    if len(values) != max(p - 1, 0):
        raise ValueError(f"comm has {len(values)} entries, expected one per hop ({p - 1}).")
    return values


def _version_used(schedule: str, batch: int) -> int:
    """Number of updates contained in the weights that ``batch`` runs on.

    Flushing schedules use the newest weights, ``W_b`` (updates ``U(0..b-1)``). 2BW uses ``V(b)``: updates
    ``U(0..b-2)``, i.e. ``max(b - 1, 0)`` of them (``V(0) = V(1) = W0``).
    """
    return max(batch - 1, 0) if spec(schedule).delayed else batch


def simulate_lists(
    actions: Sequence[Sequence[Action]],
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    comm: float | Sequence[float] = 0.0,
    update: float | Sequence[float] = 0.0,
) -> list[list[tuple[Action, float, float]]]:
    """Run arbitrary per-stage action lists; return the trace ``[(action, start, end), ...]`` per stage.

    Raises :class:`DeadlockError` naming each stuck stage's next action when the lists cannot complete.
    """
    p = len(actions)
    tf, tb = _per_stage(forward, p, "forward"), _per_stage(backward, p, "backward")
    tu, hop = _per_stage(update, p, "update"), _per_hop(comm, p)
    done: list[dict[tuple[str, int], float]] = [{} for _ in range(p)]
    ptr, free = [0] * p, [0.0] * p
    trace: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    pending, queued = deque(range(p)), [True] * p

    def wake(s: int) -> None:
        if 0 <= s < p and not queued[s]:
            queued[s] = True
            pending.append(s)

    while pending:
        s = pending.popleft()
        queued[s] = False
        todo = actions[s]
        while ptr[s] < len(todo):
            a = todo[ptr[s]]
            if a.kind == FORWARD:
                dep, delay = ((s - 1, (FORWARD, a.microbatch)), hop[s - 1]) if s > 0 else (None, 0.0)
                duration = tf[s]
            elif a.kind == BACKWARD:
                if s < p - 1:
                    dep, delay = (s + 1, (BACKWARD, a.microbatch)), hop[s]
                else:
                    dep, delay = (s, (FORWARD, a.microbatch)), 0.0
                duration = tb[s]
            elif a.kind == UPDATE:
                dep, delay, duration = None, 0.0, tu[s]
            else:
                raise ValueError(f"unknown action kind {a.kind!r} in {a!r}")
            ready = 0.0
            if dep is not None:
                finished = done[dep[0]].get(dep[1])
                if finished is None:
                    break  # woken again when the dependency finishes
                ready = finished + delay
            start = max(free[s], ready)
            end = start + duration
            key = (a.kind, a.microbatch if a.kind != UPDATE else a.batch)
            if key in done[s]:
                raise ValueError(f"stage {s} runs {a!r} twice")
            done[s][key] = end
            free[s] = end
            trace[s].append((a, start, end))
            ptr[s] += 1
            if a.kind == FORWARD:
                wake(s + 1)
            elif a.kind == BACKWARD:
                wake(s - 1)
    stuck = [f"stage {s} waits at {actions[s][ptr[s]]!r} (#{ptr[s]})" for s in range(p) if ptr[s] < len(actions[s])]
    if stuck:
        raise DeadlockError("pipeline deadlock: " + "; ".join(stuck))
    return trace


def _busy_in(intervals: list[tuple[Action, float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for _, s, e in intervals)


def simulate(
    schedule: str,
    num_stages: int,
    n_microbatches: int,
    num_batches: int = 5,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    comm: float | Sequence[float] = 0.0,
    update: float | Sequence[float] = 0.0,
    warmup_batches: int | None = None,
) -> SimResult:
    """Simulate ``num_batches`` training calls plus the final drain of ``schedule``.

    ``forward``/``backward``/``update``: time per micro-batch (update: per batch) on each stage, a scalar or one
    value per stage. ``comm``: latency per hop, a scalar or one value per hop.

    The steady state is measured between the end of batch ``warmup_batches`` (default 1, or 0 with fewer than
    4 batches) and the end of batch ``num_batches - 2`` (the last batch ends inside the drain, which is faster);
    the end of a batch is when the last stage to apply its update finishes it.
    """
    validate(schedule, num_stages, n_microbatches)
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}.")
    p, m = num_stages, n_microbatches
    lists = [run_actions(schedule, s, p, m, num_batches) for s in range(p)]
    trace = simulate_lists(lists, forward, backward, comm, update)
    tf, tb = _per_stage(forward, p, "forward"), _per_stage(backward, p, "backward")
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

    busy_per_batch = [m * (tf[s] + tb[s]) + tu[s] for s in range(p)]
    ideal = max(busy_per_batch)
    width = hi - lo
    steady_busy = [_busy_in(trace[s], lo, hi) for s in range(p)]
    bubble_stage = [1.0 - b / width if width > 0 else 0.0 for b in steady_busy]
    bubble = 1.0 - sum(steady_busy) / (p * width) if width > 0 else 0.0
    all_busy = [sum(e - s0 for _, s0, e in t) for t in trace]
    bubble_total_stage = [1.0 - b / total if total > 0 else 0.0 for b in all_busy]
    bubble_total = 1.0 - sum(all_busy) / (p * total) if total > 0 else 0.0

    # In-flight activations and live weight versions, replayed in each stage's order.
    peak_inflight, versions = [], []
    for s in range(p):
        inflight: dict[int, int] = {}  # batch -> micro-batches forwarded, not backwarded
        updates, peak, live_peak, count = 0, 0, 1, 0
        for a, _, _ in trace[s]:
            if a.kind == FORWARD:
                inflight[a.batch] = inflight.get(a.batch, 0) + 1
                count += 1
            elif a.kind == BACKWARD:
                inflight[a.batch] -= 1
                count -= 1
                if not inflight[a.batch]:
                    del inflight[a.batch]
            else:
                updates += 1
            peak = max(peak, count)
            live = {updates} | {_version_used(schedule, b) for b in inflight}
            live_peak = max(live_peak, len(live))
        peak_inflight.append(peak)
        versions.append(live_peak)

    return SimResult(
        schedule=schedule,
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
    )


def predict(
    schedule: str,
    p: int,
    m: int,
    forward_s: float | Sequence[float],
    backward_s: float | Sequence[float],
    comm_s: float | Sequence[float] = 0.0,
    num_batches: int = 6,
    update_s: float | Sequence[float] = 0.0,
) -> dict:
    """Predicted timing of ``num_batches`` training batches, for putting next to a measured run.

    Returns a dict with ``per_batch_s`` (steady state), ``total_s`` (all batches plus the final drain, from an
    empty pipeline), ``bubble`` (steady, all stages), ``bubble_total`` (whole run), ``bubble_per_stage``,
    ``throughput_rel`` (bubble-free limit / per-batch time), ``ideal_per_batch_s``, ``microbatches_per_s``,
    ``peak_inflight`` and ``weight_versions`` per stage, and ``batch_end_s`` (when each batch's last update
    finished).
    """
    r = simulate(schedule, p, m, num_batches, forward_s, backward_s, comm_s, update_s)
    return {
        "schedule": schedule,
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


# ----------------------------------------------------------------------------------------------------- timeline


def render_timeline(result: SimResult, chars_per_unit: int = 3, unit: float | None = None) -> str:
    """ASCII timeline, one row per stage: ``F5``/``B5`` = forward/backward of micro-batch 5, ``.`` = idle,
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
            label = " " + (f"{a.kind}{a.microbatch}" if a.kind != UPDATE else "U")
            cell = (label + " " * (j - i))[: j - i]
            row[i:j] = list(cell)
        for i in marks:
            if i < width:
                row[i] = "|"
        rows.append(f"s{s} " + "".join(row).rstrip("."))
    return "\n".join(rows)
