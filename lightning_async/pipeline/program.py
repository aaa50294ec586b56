"""A schedule lowered to one rank's program: compute actions with their messages and update steps made explicit.

A schedule (:mod:`~lightning_async.pipeline.schedules`) says only which compute actions a rank runs and in which
order. What each action receives, from where, what it sends, which receive is posted ahead of it, and when an
update starts and is applied follow from the placement of the pieces; :func:`lower` derives them once per call,
and everything that needs them reads the resulting :class:`Step` list: the runtime dispatches on it
(:meth:`PipelineRuntime._run_program <lightning_async.pipeline.runtime.PipelineRuntime>`), the NCCL message-order
check reads its sends and receives (:func:`messages`), and the timing model its inputs
(:func:`~lightning_async.pipeline.timing.time_action_lists`). So the three cannot disagree with what runs.

Step kinds:

* ``F``, ``B``, ``I``, ``W``: compute. ``source`` names where the input comes from (``("act", piece)`` from the
  piece before, ``("grad", piece)`` from the piece after), ``remote_input`` whether that is another rank (a
  receive) or a chunk of this rank (a hand-over); ``target``/``remote_output`` the same for the output.
* ``BEGIN_UPDATE`` (a schedule's ``U``): the batch's last backward is done; take its gradients and start their
  reductions.
* ``APPLY_UPDATE``: apply the update of ``batch`` (if not applied yet). A flushing schedule applies it right after
  it began; under 2BW it is applied when its reductions have finished (``poll`` steps) and at the latest at the
  start of the call that reads the version it writes. ``barrier``: also wait there for that version's weights from
  the other replicas (the sharded optimizer's broadcasts).
* ``START_REDUCTIONS``: start the cross-stage reductions of ``batch``'s gradients that the last stage held back
  at its ``BEGIN_UPDATE`` (2BW: the first stage joins them one call later; see the runtime).

``prepost`` on a step is the next receive from another rank after it (posted before the step runs, on gloo);
``next_receive`` the receive of the very next step (fused with this step's send, on NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from lightning_async.pipeline.schedule_text import message_grid
from lightning_async.pipeline.schedules import (
    BACKWARD, FORWARD, GRADIENT_ACTIONS, INPUT_GRAD, UPDATE, WEIGHT_GRAD, Action, ScheduleSpec, spec,
)

BEGIN_UPDATE, APPLY_UPDATE, START_REDUCTIONS = "BEGIN_UPDATE", "APPLY_UPDATE", "START_REDUCTIONS"
COMPUTE = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)

Channel = tuple[str, int]  # (kind "act" or "grad", the receiving piece)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a rank's program (see the module docstring)."""

    kind: str
    batch: int
    microbatch: int = -1
    chunk: int = 0
    piece: int = -1  # the model piece a compute step runs
    source: Channel | None = None  # the channel the input arrives on (None: the batch's own inputs, or W/U)
    remote_input: bool = False
    target: Channel | None = None  # the channel the output leaves on (None: the first piece's gradient, the loss)
    remote_output: bool = False
    prepost: Channel | None = None
    next_receive: Channel | None = None
    poll: bool = False  # apply finished updates before this step (2BW: frees their gradients early)
    barrier: bool = False

    @property
    def action(self) -> Action:
        """The schedule's action this step runs (``U`` for both update steps)."""
        kind = UPDATE if self.kind in (BEGIN_UPDATE, APPLY_UPDATE, START_REDUCTIONS) else self.kind
        return Action(kind, self.microbatch, self.batch, self.chunk)


def _channels(spec: ScheduleSpec, rank: int, num_stages: int, action: Action) -> tuple:
    """``(piece, source, remote_input, target, remote_output)`` of a compute action of ``rank``."""
    piece = spec.piece(rank, action.chunk, num_stages)
    last = spec.virtual_stages(num_stages) - 1

    def remote(other: int) -> bool:
        return spec.holder(other, num_stages)[0] != rank

    if action.kind == FORWARD:
        source = ("act", piece) if piece > 0 else None
        target = ("act", piece + 1) if piece < last else None
        return piece, source, source is not None and remote(piece - 1), target, target is not None and remote(piece + 1)
    if action.kind in GRADIENT_ACTIONS:
        source = ("grad", piece) if piece < last else None
        target = ("grad", piece - 1) if piece > 0 else None
        return piece, source, source is not None and remote(piece + 1), target, target is not None and remote(piece - 1)
    return piece, None, False, None, False  # W: nothing crosses a boundary


@lru_cache(maxsize=256)
def _rank_clock(spec: ScheduleSpec, num_stages: int, rank: int):
    """``spec.clock(num_stages).rank(rank)``, built once per schedule, size and rank (:func:`lower` runs per call)."""
    return spec.clock(num_stages).rank(rank)


def lower(spec: ScheduleSpec, rank: int, num_stages: int, actions: tuple[Action, ...] | list[Action],
          start: tuple[int, ...] = (), apply_first: tuple[int, ...] = (), apply_last: tuple[int, ...] = ()) -> tuple[Step, ...]:
    """The program of ``actions`` (one call's, or a drain's) on ``rank``.

    ``start``: batches whose held-back reductions start first (``START_REDUCTIONS``). ``apply_first`` /
    ``apply_last``: batches whose updates are applied (with a ``barrier``) before the first / after the last step
    (the clock's ``due_before(call)``; a drain applies every update). Every ``U`` becomes ``BEGIN_UPDATE``,
    followed at once by ``APPLY_UPDATE`` where the rank's clock applies updates at once (a flushing schedule).
    """
    clock = _rank_clock(spec, num_stages, rank)
    raw: list[dict] = [dict(kind=START_REDUCTIONS, batch=b) for b in start]
    raw += [dict(kind=APPLY_UPDATE, batch=b, barrier=True) for b in apply_first]
    for a in actions:
        if a.kind == UPDATE:
            raw.append(dict(kind=BEGIN_UPDATE, batch=a.batch, microbatch=a.microbatch))
            if clock.applies_at_once:
                raw.append(dict(kind=APPLY_UPDATE, batch=a.batch, microbatch=a.microbatch))
            continue
        if a.kind not in COMPUTE:
            raise ValueError(f"unknown action kind {a.kind!r} in {a!r}")
        piece, source, remote_in, target, remote_out = _channels(spec, rank, num_stages, a)
        raw.append(dict(kind=a.kind, batch=a.batch, microbatch=a.microbatch, chunk=a.chunk, piece=piece,
                        source=source, remote_input=remote_in, target=target, remote_output=remote_out))
    raw += [dict(kind=APPLY_UPDATE, batch=b, barrier=True) for b in apply_last]
    receives = [r["source"] if r.get("remote_input") else None for r in raw]
    ahead: Channel | None = None  # the first remote receive after step k, filled from the end
    steps = []
    for k in range(len(raw) - 1, -1, -1):
        nxt = receives[k + 1] if k + 1 < len(raw) else None
        compute_or_begin = raw[k]["kind"] in (*COMPUTE, BEGIN_UPDATE)
        steps.append(Step(**raw[k], prepost=ahead if compute_or_begin else None, next_receive=nxt,
                          poll=not clock.applies_at_once and compute_or_begin))
        ahead = receives[k] or ahead
    return tuple(reversed(steps))


class CallPrograms:
    """One rank's lowered programs, cached per call shape (the runtime lowers every training call).

    Lowering passes batch and micro-batch numbers through unchanged, so a call's program relative to its batch ``b``
    (batches as ``batch - b``, micro-batches as ``microbatch - b * m``) depends only on the call's shape: warm-up,
    steady state, a drain, which held-back reductions start and which updates are due first and last. :meth:`get`
    returns that relative program, lowered once per shape; the dispatcher adds ``b`` and ``b * m`` back.
    """

    def __init__(self, spec: ScheduleSpec, rank: int, num_stages: int, n_microbatches: int, size: int = 64) -> None:
        self.spec, self.rank, self.num_stages, self.n_microbatches, self.size = spec, rank, num_stages, n_microbatches, size
        self._programs: dict[tuple, tuple[Step, ...]] = {}
        self.lowered = 0  # programs lowered so far (cache misses; for tests and benchmarks)

    def get(self, actions: tuple[Action, ...] | list[Action], batch: int, start: tuple[int, ...] = (),
            apply_first: tuple[int, ...] = (), apply_last: tuple[int, ...] = ()) -> tuple[Step, ...]:
        """The program of ``actions`` (see :func:`lower`) relative to ``batch``."""
        mb0 = batch * self.n_microbatches
        key = (tuple([(a.kind, a.microbatch - mb0, a.batch - batch, a.chunk) for a in actions]),
               tuple([b - batch for b in start]), tuple([b - batch for b in apply_first]),
               tuple([b - batch for b in apply_last]))
        program = self._programs.get(key)
        if program is None:
            if len(self._programs) >= self.size:
                self._programs.clear()
            relative = [Action(kind, mb, b, chunk) for kind, mb, b, chunk in key[0]]
            program = lower(self.spec, self.rank, self.num_stages, relative, start=key[1], apply_first=key[2],
                            apply_last=key[3])
            self._programs[key] = program
            self.lowered += 1
        return program


def messages(spec: ScheduleSpec, program: tuple[Step, ...] | list[Step], rank: int, num_stages: int) -> tuple[list, list]:
    """The messages ``rank`` sends and receives, in program order, as ``(peer, kind, micro-batch, receiving piece)``;
    hand-overs between two chunks of the rank are left out."""
    sent, received = [], []
    for s in program:
        if s.remote_input:
            kind, piece = s.source
            other = piece - 1 if kind == "act" else piece + 1
            received.append((spec.holder(other, num_stages)[0], kind, s.microbatch, piece))
        if s.remote_output:
            kind, piece = s.target
            sent.append((spec.holder(piece, num_stages)[0], kind, s.microbatch, piece))
    return sent, received


def message_order_mismatches(schedule: "str | ScheduleSpec", lists: list[list[Action]], per_channel: bool = True) -> list[str]:
    """Rank pairs whose programs (``lists``: each rank's actions, lowered here) send messages in another order than
    the other side receives them.

    ``per_channel``: compare each channel (kind and receiving piece) on its own, as gloo's tags match them;
    otherwise all messages from one rank to another together, as NCCL (no tags) matches them: a schedule runs on
    NCCL only when that is empty.
    """
    s_ = spec(schedule)
    p = len(lists)
    traffic = [messages(s_, lower(s_, r, p, lists[r]), r, p) for r in range(p)]
    out = []
    for a in range(p):
        for b in range(p):
            if a == b:
                continue
            sends = [(kind, mb, piece) for peer, kind, mb, piece in traffic[a][0] if peer == b]
            recvs = [(kind, mb, piece) for peer, kind, mb, piece in traffic[b][1] if peer == a]
            channels = {(kind, piece) for kind, _, piece in sends + recvs} if per_channel else {None}
            for channel in sorted(channels, key=str):
                one = [x for x in sends if channel is None or (x[0], x[2]) == channel]
                other = [x for x in recvs if channel is None or (x[0], x[2]) == channel]
                if one != other:
                    out.append(f"rank {a} -> rank {b} ({channel or 'all'}): sent {one[:6]}..., received {other[:6]}...\n"
                               + message_grid(s_, lists, a, b, one, other))
    return out
