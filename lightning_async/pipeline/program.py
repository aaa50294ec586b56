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
  reductions. On the update steps ``chunk`` names the rank's update group (0 unless chunks update on their own).
* ``APPLY_UPDATE``: apply the update of ``batch`` (if not applied yet). A flushing schedule applies it right after
  it began; under 2BW it is applied when its reductions have finished (``poll`` steps) and at the latest at the
  start of the call that reads the version it writes. ``barrier``: also wait there for that version's weights from
  the other replicas (the sharded optimizer's broadcasts).
* ``START_REDUCTIONS``: start the cross-stage reductions of ``batch``'s gradients that the last stage held back
  at its ``BEGIN_UPDATE`` (2BW: the first stage joins them one call later; see the runtime).

``prepost`` on a step is the next receive from another rank after it (posted before the step runs, on gloo);
``next_receive`` the receive of the very next step (fused with this step's send, on NCCL).

Matching order (:func:`order_sends`, NCCL's path): NCCL matches the messages between two ranks in the order they are
posted, with no tags, so the sender must send a pair's messages in the order the receiver consumes them. Where a
schedule computes them in another order (ZB-V: a rank's two chunks talk to the same neighbour, and the warm-up's
forwards run ahead of the other chunk's input gradients), ``send_order`` on a sending step says how: ``("hold", k)``
keeps the output back (at place ``k`` of the queue of sends held for that peer, in the receiver's order), and
``("release", n)`` sends the output, then the first ``n`` held ones. Each message is then sent at the first step by
which it and every message the receiver consumes before it have been computed: the receiver could not consume it any
earlier, so holding it back makes no rank wait on one it did not wait on before (no wait cycle; see
:func:`order_sends`). Receives never move. Under gloo's own rules (a tag per channel) the transport sends at once and
ignores ``send_order``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from lightning_async.pipeline.schedule_text import message_grid
from lightning_async.pipeline.schedules import (
    BACKWARD, FORWARD, GRADIENT_ACTIONS, INPUT_GRAD, UPDATE, WEIGHT_GRAD, Action, ScheduleSpec,
)
from lightning_async.pipeline.schedules import spec as spec_of

BEGIN_UPDATE, APPLY_UPDATE, START_REDUCTIONS = "BEGIN_UPDATE", "APPLY_UPDATE", "START_REDUCTIONS"
COMPUTE = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)

Channel = tuple[str, int]  # (kind "act" or "grad", the receiving piece)
Message = tuple[str, int, int]  # (kind, micro-batch, the receiving piece): one message of a call
HOLD, RELEASE = "hold", "release"  # a sending step's ``send_order``


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
    send_order: tuple[str, int] | None = None  # NCCL's path: (HOLD, place) or (RELEASE, count); None: send now
    settle: tuple[int, int] | None = None  # a backward: apply (batch, group)'s update once its input is here

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
def _update_clocks(spec: ScheduleSpec, num_stages: int, rank: int):
    """The clocks of ``rank``'s update groups (``spec.clock(num_stages).update_groups(rank)``) and whether the rank
    holds its reductions back a call (the clock's ``defers_reductions``) and whether it begins a batch's update last
    (``begins_last``), built once per schedule, size and rank
    (:func:`lower` runs per call)."""
    clock = spec.clock(num_stages)
    return tuple(c for _, c in clock.update_groups(rank)), clock.defers_reductions(rank), clock.begins_last(rank)


def lower(spec: ScheduleSpec, rank: int, num_stages: int, actions: tuple[Action, ...] | list[Action],
          start: tuple[tuple[int, int], ...] = (), apply_first: tuple[tuple[int, int], ...] = (),
          apply_last: tuple[tuple[int, int], ...] = ()) -> tuple[Step, ...]:
    """The program of ``actions`` (one call's, or a drain's) on ``rank``.

    ``start``, ``apply_first``, ``apply_last`` hold ``(batch, group)`` pairs (``group``: the rank's update group,
    :meth:`~lightning_async.pipeline.clock.UpdateClock.update_groups`; 0 where the rank updates its chunks at once).
    ``start``: updates whose held-back reductions start first (``START_REDUCTIONS``). ``apply_first`` /
    ``apply_last``: updates applied (with a ``barrier``) before the first / after the last step (the clock's
    ``due_before(call)``; a drain applies every update). Every ``U`` becomes ``BEGIN_UPDATE`` of its group (the
    step's ``chunk``), followed at once by ``APPLY_UPDATE`` where the group's clock applies updates at once (a
    flushing schedule, WPipe's second chunk) and the rank does not hold the update's reductions back to its next call
    (``paci``'s last stage: waiting for them at the end of its call would wait for another rank's next call across
    whatever the step does in between, so the update is applied at the start of its next call, by ``apply_first``,
    before any forward reads it). On the rank that begins a batch's update last (2BW's first stage), the update is
    applied before the rank's next backward computes (that step's ``settle``): every other participant of its
    reductions has started them by then (each begins it before its own next backward, which that one's input comes
    from), so the wait is short and the next batch's gradients never meet the pending ones (one gradient buffer,
    :func:`~lightning_async.pipeline.memory.holds_two_gradients`, whatever the timing). It is that backward's
    ``settle``, done after its input arrived: a step of its own between them would split the send before it from the
    receive it is fused with, which NCCL needs.
    """
    clocks, defers, begins_last = _update_clocks(spec, num_stages, rank)
    raw: list[dict] = [dict(kind=START_REDUCTIONS, batch=b, chunk=g) for b, g in start]
    raw += [dict(kind=APPLY_UPDATE, batch=b, chunk=g, barrier=True) for b, g in apply_first]
    settle: list[tuple[int, int]] = []  # (batch, group) begun here, applied before the next backward (begins_last)
    for a in actions:
        if a.kind == UPDATE:
            raw.append(dict(kind=BEGIN_UPDATE, batch=a.batch, microbatch=a.microbatch, chunk=a.chunk))
            if begins_last:
                settle.append((a.batch, a.chunk))
            if clocks[a.chunk].applies_at_once and not defers:  # (wpipe's and paci's land in the middle of a call,
                # so the sharded optimizer's weights from the other replicas are waited for at once, before a read)
                raw.append(dict(kind=APPLY_UPDATE, batch=a.batch, microbatch=a.microbatch, chunk=a.chunk,
                                barrier=spec.update_per_chunk or not spec.stash))
            continue
        if a.kind not in COMPUTE:
            raise ValueError(f"unknown action kind {a.kind!r} in {a!r}")
        piece, source, remote_in, target, remote_out = _channels(spec, rank, num_stages, a)
        raw.append(dict(kind=a.kind, batch=a.batch, microbatch=a.microbatch, chunk=a.chunk, piece=piece,
                        source=source, remote_input=remote_in, target=target, remote_output=remote_out))
        if settle and a.kind in GRADIENT_ACTIONS and a.batch > settle[0][0]:
            if len(settle) > 1:
                raise AssertionError(f"schedule {spec.name!r}: rank {rank} began {len(settle)} updates between backwards")
            raw[-1]["settle"] = settle.pop()
    raw += [dict(kind=APPLY_UPDATE, batch=b, chunk=g, barrier=True) for b, g in apply_last]
    receives = [r["source"] if r.get("remote_input") else None for r in raw]
    polls = not all(c.applies_at_once for c in clocks)
    ahead: Channel | None = None  # the first remote receive after step k, filled from the end
    steps = []
    for k in range(len(raw) - 1, -1, -1):
        nxt = receives[k + 1] if k + 1 < len(raw) else None
        compute_or_begin = raw[k]["kind"] in (*COMPUTE, BEGIN_UPDATE)
        steps.append(Step(**raw[k], prepost=ahead if compute_or_begin else None, next_receive=nxt,
                          poll=polls and compute_or_begin))
        ahead = receives[k] or ahead
    return tuple(reversed(steps))


class CallPrograms:
    """One rank's lowered programs, cached per call shape (the runtime lowers every training call).

    Lowering passes batch and micro-batch numbers through unchanged, so a call's program relative to its batch ``b``
    (batches as ``batch - b``, micro-batches as ``microbatch - b * m``) depends only on the call's shape: warm-up,
    steady state, a drain, which held-back reductions start and which updates are due first and last. :meth:`get`
    returns that relative program, lowered once per shape; the dispatcher adds ``b`` and ``b * m`` back. Where sends
    may need holding back (:func:`reorders`: ZB-V, interleaved), the other ranks' programs of the same call are
    lowered with it and :func:`order_sends` sets its ``send_order`` (at lowering time only: nothing per step).
    """

    def __init__(self, spec: ScheduleSpec, rank: int, num_stages: int, n_microbatches: int, size: int = 64) -> None:
        self.spec, self.rank, self.num_stages, self.n_microbatches, self.size = spec, rank, num_stages, n_microbatches, size
        self._programs: dict[tuple, tuple[Step, ...]] = {}
        self.lowered = 0  # programs lowered so far (cache misses; for tests and benchmarks)

    def get(self, actions: tuple[Action, ...] | list[Action], batch: int, start: tuple[tuple[int, int], ...] = (),
            apply_first: tuple[tuple[int, int], ...] = (), apply_last: tuple[tuple[int, int], ...] = ()) -> tuple[Step, ...]:
        """The program of ``actions`` (see :func:`lower`) relative to ``batch``."""
        mb0 = batch * self.n_microbatches
        key = (tuple([(a.kind, a.microbatch - mb0, a.batch - batch, a.chunk) for a in actions]),
               *(tuple([(b - batch, g) for b, g in pairs]) for pairs in (start, apply_first, apply_last)))
        program = self._programs.get(key)
        if program is None:
            if len(self._programs) >= self.size:
                self._programs.clear()
            relative = [Action(kind, mb, b, chunk) for kind, mb, b, chunk in key[0]]
            program = lower(self.spec, self.rank, self.num_stages, relative, start=key[1], apply_first=key[2],
                            apply_last=key[3])
            if reorders(self.spec):  # the peers' programs of the same call say the order they consume in
                programs = [program if q == self.rank else lower(self.spec, q, self.num_stages, self._call_of(q))
                            for q in range(self.num_stages)]
                program = order_sends(self.spec, self.num_stages, programs)[self.rank]
            self._programs[key] = program
            self.lowered += 1
        return program


    def _call_of(self, rank: int) -> list[Action]:
        """``rank``'s actions of a call relative to its batch (a flushing schedule's: every call alike)."""
        m = self.n_microbatches
        return self.spec.per_batch(rank, self.num_stages, m, self.spec.chunks, 0) + [Action(UPDATE, m - 1, 0)]


# ------------------------------------------------------------------------------------------- matching order
def reorders(spec: ScheduleSpec) -> bool:
    """Whether :func:`order_sends` may hold sends back in ``spec``'s programs: a flushing schedule with several chunks
    per rank (with one chunk, each direction of a pair carries one channel, whose messages a stage computes in the
    order its neighbour consumes them; the delayed schedules, whose calls overlap, all have one)."""
    return spec.chunks > 1 and not spec.delayed


def _peer_of(spec: ScheduleSpec, num_stages: int, channel: Channel, sent: bool) -> int:
    """The rank at the other end of a message on ``channel`` (the receiving piece's), sent or received."""
    kind, piece = channel
    if sent:
        return spec.holder(piece, num_stages)[0]
    return spec.holder(piece - 1 if kind == "act" else piece + 1, num_stages)[0]


def order_sends(spec: ScheduleSpec, num_stages: int, programs: list[tuple[Step, ...]]) -> list[tuple[Step, ...]]:
    """``programs`` (every rank's, of the same call or run) with ``send_order`` set so that each rank sends each peer
    its messages in the order the peer consumes them (NCCL matches a pair's messages in posting order; the module
    docstring).

    For a pair, let the receiver consume ``c_0, c_1, ...`` and the sender compute ``c_i`` at its step ``t(c_i)``:
    ``c_i`` is sent at step ``max(t(c_0), ..., t(c_i))``, right after the step's own output, in the receiver's
    order. Why that adds no wait: the receiver waits for ``c_i`` only after it has received ``c_0 ... c_{i-1}``,
    among them the one computed at that very step (which it waited for before, sent at once); the sender never waits
    on a send. So every wait of the new programs was a wait of the old ones, and a schedule that ran under gloo's tags
    (any order matches) runs here. Pairs whose two ends do not exchange the same messages are left as they are
    (:func:`message_order_mismatches` reports them).
    """
    if not reorders(spec):
        return list(programs)
    p = num_stages
    made: dict[tuple[int, int], dict[Message, int]] = {}  # (sender, receiver) -> message -> the sender's step
    consumed: dict[tuple[int, int], list[Message]] = {}  # (sender, receiver) -> messages in the receiver's order
    for rank, program in enumerate(programs):
        for k, s in enumerate(program):
            if s.remote_output:
                made.setdefault((rank, _peer_of(spec, p, s.target, True)), {})[(s.target[0], s.microbatch, s.target[1])] = k
            if s.remote_input:
                consumed.setdefault((_peer_of(spec, p, s.source, False), rank), []).append(
                    (s.source[0], s.microbatch, s.source[1]))
    due: dict[tuple[int, int], dict[Message, tuple[int, int]]] = {}  # pair -> message -> (send step, receiver's place)
    for pair, order in consumed.items():
        steps = made.get(pair, {})
        if sorted(order) != sorted(steps):
            continue
        latest, due[pair] = -1, {}
        for place, msg in enumerate(order):
            latest = max(latest, steps[msg])
            due[pair][msg] = (latest, place)
    out = []
    for rank, program in enumerate(programs):
        held: dict[int, list[Message]] = {}  # peer -> the messages held back for it, in its order
        steps = list(program)
        for k, s in enumerate(steps):
            if not s.remote_output:
                continue
            peer = _peer_of(spec, p, s.target, True)
            plan = due.get((rank, peer))
            if plan is None:
                continue
            msg, queue = (s.target[0], s.microbatch, s.target[1]), held.setdefault(peer, [])
            when, place = plan[msg]
            if when > k:
                at = sum(1 for other in queue if plan[other][1] < place)
                queue.insert(at, msg)
                steps[k] = replace(s, send_order=(HOLD, at))
                continue
            n = 0
            while n < len(queue) and plan[queue[n]][0] == k:
                n += 1
            if n:
                del queue[:n]
                steps[k] = replace(s, send_order=(RELEASE, n))
        out.append(tuple(steps))
    return out


def lower_all(spec: "str | ScheduleSpec", lists: list[list[Action]], reorder: bool = True) -> list[tuple[Step, ...]]:
    """Every rank's program of ``lists`` (each rank's actions of the same calls), sends ordered for NCCL
    (:func:`order_sends`; ``reorder=False``: in compute order, as before that pass)."""
    s_, p = spec_of(spec), len(lists)
    programs = [lower(s_, r, p, lists[r]) for r in range(p)]
    return order_sends(s_, p, programs) if reorder else programs


def messages(spec: ScheduleSpec, program: tuple[Step, ...] | list[Step], rank: int, num_stages: int) -> tuple[list, list]:
    """The messages ``rank`` sends and receives, in posting order on NCCL's path (held sends where they are
    released, :func:`order_sends`), as ``(peer, kind, micro-batch, receiving piece)``; hand-overs between two chunks
    of the rank are left out."""
    sent, received = [], []
    held: dict[int, list] = {}
    for s in program:
        if s.remote_input:
            kind, piece = s.source
            received.append((_peer_of(spec, num_stages, s.source, False), kind, s.microbatch, piece))
        if s.remote_output:
            kind, piece = s.target
            msg = (spec.holder(piece, num_stages)[0], kind, s.microbatch, piece)
            queue = held.setdefault(msg[0], [])
            if s.send_order is not None and s.send_order[0] == HOLD:
                queue.insert(s.send_order[1], msg)
                continue
            n = s.send_order[1] if s.send_order is not None else 0
            sent += [msg, *queue[:n]]
            del queue[:n]
    return sent, received


def posting_groups(spec: ScheduleSpec, program: tuple[Step, ...] | list[Step], rank: int, num_stages: int) -> list[list]:
    """The point-to-point groups ``rank`` posts for ``program`` on NCCL's path, in order, as the runtime and
    :class:`~lightning_async.pipeline.p2p.StageTransport` post them: a step's output with the very next step's
    receive (``next_receive``), held sends where they are released (each on its own, the receive with the last), a
    receive nothing fused ahead on its own. Each entry is ``("send" | "recv", (sender, receiver, kind, micro-batch,
    receiving piece))``. Boundary headers (once per channel after a restart, just ahead of their message) are left
    out."""
    groups: list[list] = []
    fused: Message | None = None  # the receive the previous group posted for this step
    held: dict[int, list] = {}
    for k, s in enumerate(program):
        if s.kind not in COMPUTE:
            continue
        if s.remote_input:
            msg = (_peer_of(spec, num_stages, s.source, False), rank, s.source[0], s.microbatch, s.source[1])
            if fused != msg:
                groups.append([("recv", msg)])
            fused = None
        if not s.remote_output:
            continue
        msg = (rank, spec.holder(s.target[1], num_stages)[0], s.target[0], s.microbatch, s.target[1])
        queue = held.setdefault(msg[1], [])
        if s.send_order is not None and s.send_order[0] == HOLD:
            queue.insert(s.send_order[1], msg)
            sends = []
        else:
            n = s.send_order[1] if s.send_order is not None else 0
            sends = [msg, *queue[:n]]
            del queue[:n]
        groups += [[("send", m)] for m in sends[:-1]]
        last = [("send", m) for m in sends[-1:]]
        after = program[k + 1] if k + 1 < len(program) else None
        if s.next_receive is not None and after is not None and after.remote_input:
            fused = (_peer_of(spec, num_stages, after.source, False), rank, after.source[0], after.microbatch,
                     after.source[1])
            last.append(("recv", fused))
        if last:
            groups.append(last)
    return groups


def stuck(spec: "str | ScheduleSpec", programs: list[tuple[Step, ...]], rendezvous: bool = False) -> str | None:
    """Run every rank's :func:`posting_groups` against each other with a pair's messages matched in posting order
    (NCCL's rule); ``None`` when every rank finishes, else where each one waits.

    The transport's blocking (gloo under NCCL's rules, and the CPU side on NCCL): a send is posted and left, a group's
    receive is waited for before the rank goes on. ``rendezvous``: a stricter model, every operation of a group
    (sends too) waits until its peer has posted the matching one, as an NCCL stream holds the groups queued behind a
    send whose receiver has not posted it yet (for messages beyond NCCL's eager buffers).
    """
    s_, p = spec_of(spec), len(programs)
    queues, position = [], {}
    for r in range(p):
        groups = []
        for group in posting_groups(s_, programs[r], r, p):
            ops = []
            for op, msg in group:
                key = (op, msg[0], msg[1])
                position[key] = position.get(key, -1) + 1
                ops.append((op, msg[0], msg[1], position[key], msg))
            groups.append(ops)
        queues.append(groups)
    posted: dict[tuple, Message] = {}
    at = [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(queues[r]):
                group = queues[r][at[r]]
                for op, a, b, i, msg in group:
                    posted[op, a, b, i] = msg
                waits = [(op, a, b, i) for op, a, b, i, _ in group if op == "recv" or rendezvous]
                if any(("send" if op == "recv" else "recv", a, b, i) not in posted for op, a, b, i in waits):
                    break
                at[r] += 1
                moved = True
    for (op, a, b, i), msg in posted.items():
        other = posted.get(("send" if op == "recv" else "recv", a, b, i))
        if other is not None and other != msg:
            return f"rank {a} -> rank {b}: message {i} is sent as {msg if op == 'send' else other} but received as " \
                   f"{other if op == 'send' else msg}"
    if all(at[r] == len(queues[r]) for r in range(p)):
        return None
    waiting = [f"rank {r} at {[(op, m[2], m[3], m[4]) for op, *_, m in queues[r][at[r]]]}" for r in range(p)
               if at[r] < len(queues[r])]
    return "no rank can go on: " + "; ".join(waiting)


def message_order_mismatches(schedule: "str | ScheduleSpec", lists: list[list[Action]], per_channel: bool = True,
                             reorder: bool = True) -> list[str]:
    """Rank pairs whose programs (``lists``: each rank's actions, lowered here with :func:`lower_all`) send messages in
    another order than the other side receives them.

    ``per_channel``: compare each channel (kind and receiving piece) on its own, as gloo's tags match them;
    otherwise all messages from one rank to another together, as NCCL (no tags) matches them: a schedule runs on
    NCCL only when that is empty (and :func:`stuck` finds no wait). ``reorder=False``: the sends in compute order,
    without :func:`order_sends` (ZB-V's then disagree).
    """
    s_ = spec_of(schedule)
    p = len(lists)
    traffic = [messages(s_, program, r, p) for r, program in enumerate(lower_all(s_, lists, reorder))]
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
