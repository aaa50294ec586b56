"""Point-to-point transport between neighbouring stages (our own small layer over torch.distributed).

Why not ``torch.distributed.pipelining.PipelineStage``: its communication helpers are private
(``_batch_p2p``, ``_initialize_stage``) and its schedules clear their state every step, while 2BW keeps
micro-batches in flight across steps. This layer uses public ``torch.distributed`` APIs only.

Channels: a rank may hold several pieces of the model (virtual stages: the interleaved and V schedules), so
a message is addressed to a piece and a kind (an activation from the piece before, a gradient from the piece
after). On gloo each channel has its own tag and messages of different channels between two ranks may be
posted in any order; NCCL has no tags, so a schedule runs there only if every pair of ranks posts its
messages in matching order. The lowering sees to that (``program.order_sends``: a send the receiver consumes after
one computed later is held back and released after it, :meth:`StageTransport.exchange`'s ``order``), and
``program.message_order_mismatches`` checks it before launch.

Ordering rule (NCCL-safe): a send that is followed by a receive is posted in one ``batch_isend_irecv`` group
(forward-send with backward-receive and vice versa, as Megatron does), so both sides always post in matching
order. Receives are waited on at once; sends are not: a gloo send
of a large tensor completes only when the receiver has posted its receive, and under 2BW the receiver
of a stage's last send of a batch is already in the next batch. Waiting there would tie every
training call to the neighbour's next one (and deadlock against any collective Lightning runs between
batches). Pending sends keep their buffers alive until they are released: NCCL sends as soon as they report
completion (``is_completed()`` turns true when the kernel has run); gloo sends never report completion before
``wait()``, so :meth:`StageTransport.begin_call` waits for (and frees) every send posted two or more calls
ago, which the neighbours have provably received by then (the argument is in :meth:`begin_call`), so the wait
returns at once and never ties a call to a neighbour's. :meth:`flush` waits for all of them (drain,
evaluation, checkpoints). Without the release, a 2BW run with no drain kept every activation it ever sent.

Pre-posted receives (gloo): gloo moves a message only once its receive is posted, so a receive posted
after the compute that precedes it costs a late round trip (about 1 ms against 0.15 ms on a loaded CPU,
``benchmarks/pipeline_throughput.py --probe``). On gloo the runtime therefore posts the receive of the
*next* action's input before running the current action (:meth:`StageTransport.prepost`), and sends on
their own. At most one receive is outstanding and it is consumed by the very next action, so receives
from a neighbour are still posted in the order it sends. NCCL keeps the fused, matching-order groups
above: an unmatched receive posted early on both sides of a pair could block each other's stream.

NCCL's rules on gloo (``transport="nccl-rules"``): the transport takes the path it takes on NCCL while the
messages travel over gloo: tag 0 on every message (so two ranks' messages match in posting order, as NCCL matches
them), every group posted through ``batch_isend_irecv``, the headers through unbatched ``isend``/``irecv`` with tag
0, and no pre-posted receives; sends held back for the receiver's order (``program.order_sends``, ZB-V) wait in
:attr:`StageTransport._held` as on NCCL. Programs whose two ends of a pair post in different orders would train wrong
or hang on the CPU as on GPUs; they are refused before any group is made (as on NCCL:
``run_checks.check_message_order``), and no built-in schedule's are. What it cannot show: NCCL's streams (an
unbatched NCCL receive blocks the ops queued after it on its stream, a gloo one does not) and its communicators (the headers' unbatched messages use
another one than the batched groups, created lazily mid-run): ``docs/pipeline.md``, "NCCL's rules on gloo".

Boundary values (:mod:`~lightning_async.pipeline.boundary`): an activation is a tensor or a small pytree
of tensors; every leaf is its own message of the same group. The first activation sent after a
(re)start is preceded by a header (:class:`BoundarySpec`: structure, dtypes, shapes, which leaves
carry gradients); afterwards every activation between the same pair must match it, and a stage whose
output changes within a batch raises :class:`BoundaryChanged` before sending anything. Gradients travel
back for the leaves that required grad only (integer leaves never do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_async.pipeline.boundary import flatten, unflatten


#: the transport modes: ``"auto"`` (the backend's own rules: tags and pre-posted receives on gloo, NCCL's path on
#: NCCL) and ``"nccl-rules"`` (NCCL's path on any backend: tag 0, ``batch_isend_irecv`` groups, no pre-posting)
TRANSPORTS = ("auto", "nccl-rules")


def check_transport(transport: str) -> str:
    """``transport`` if it names a mode of :data:`TRANSPORTS`, else a ``ValueError`` naming them."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"transport must be one of {', '.join(repr(t) for t in TRANSPORTS)}, got {transport!r}: 'auto' follows the "
            "process group's backend, 'nccl-rules' keeps NCCL's matching rules on gloo (tag 0, batched groups, no "
            "pre-posted receives) to find on CPUs what would hang or mismatch on GPUs."
        )
    return transport


class PeerFailure(RuntimeError):
    """A neighbouring stage stopped answering (it died or raised)."""


class BoundaryChanged(ValueError):
    """A stage's output changed structure, dtype or shape between micro-batches of one batch."""


@dataclass
class BoundarySpec:
    """What crosses one stage boundary: the pytree structure and each leaf's dtype, shape and requires_grad."""

    structure: object
    leaves: tuple[tuple[torch.dtype, torch.Size, bool], ...]

    @staticmethod
    def leaf_specs(tensors) -> tuple[tuple[torch.dtype, torch.Size, bool], ...]:
        return tuple((x.dtype, x.shape, x.requires_grad) for x in tensors)

    @property
    def grads(self) -> list[tuple[torch.dtype, torch.Size]]:
        """(dtype, shape) of the gradients that travel back: one per leaf that requires grad."""
        return [(dtype, shape) for dtype, shape, requires_grad in self.leaves if requires_grad]

    def describe(self) -> str:
        return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}{' (grad)' if g else ''}" for d, s, g in self.leaves)

    def encode(self) -> bytes:
        leaves = [[str(d).removeprefix("torch."), list(s), g] for d, s, g in self.leaves]
        return json.dumps({"structure": self.structure, "leaves": leaves}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "BoundarySpec":
        raw = json.loads(data.decode())
        leaves = tuple((getattr(torch, d), torch.Size(s), bool(g)) for d, s, g in raw["leaves"])
        return cls(raw["structure"], leaves)


class StageTransport:
    """Sends and receives the activations and gradients of one rank's pieces (virtual stages).

    A message belongs to a *channel*: the piece that receives it and its kind (``"act"`` from the piece before,
    ``"grad"`` from the piece after). ``rank_of_piece(k)`` is the global rank holding piece ``k``; hand-overs
    between two pieces of the same rank never reach the transport. On gloo every channel has its own tag, so a
    schedule may interleave channels between two ranks in any order (ZB-V does); NCCL ignores tags and matches
    messages between two ranks in posting order, so on NCCL's path the sends follow the lowering's ``send_order``
    (held back and released in the receiver's order: ``program.order_sends``). ``name`` describes this rank in
    error messages. ``transport``: ``"auto"`` (the backend's rules) or ``"nccl-rules"`` (NCCL's path on gloo too: tag
    0, ``batch_isend_irecv`` groups, no pre-posting).
    """

    def __init__(
        self, group, device: torch.device, rank_of_piece, stage_of_rank, prepost: bool | None = None,
        name: str = "this pipeline stage", transport: str = "auto",
    ) -> None:
        self.group, self.device = group, device
        self.rank_of_piece, self.stage_of_rank, self.name = rank_of_piece, stage_of_rank, name
        self._peers: dict[int, int] = {}  # piece -> its rank (``rank_of_piece``, asked once per piece)
        self.transport = check_transport(transport)
        #: gloo's rules (tags per channel, one post per message, pre-posting allowed); False: NCCL's path, on NCCL
        #: or under ``transport="nccl-rules"``
        self._gloo = dist.is_initialized() and dist.get_backend(group) == "gloo" and transport != "nccl-rules"
        #: post the next action's receive before the current action (default: under gloo's rules only)
        self.prepost_enabled = self._gloo if prepost is None else prepost
        self.preposted = 0  # receives posted ahead so far (for tests and benchmarks)
        self.headers_sent = 0  # boundary specs announced so far (for tests)
        self.groups_batched = 0  # groups posted through ``batch_isend_irecv`` so far (NCCL's path; for tests)
        self.act_spec: dict[int, BoundarySpec] = {}  # piece -> what it receives from the piece before
        self.sent_spec: dict[int, BoundarySpec] = {}  # piece -> what it sends to the piece after (its gradients come back)
        self._pending_sends: list[tuple[list, list[torch.Tensor], int, int]] = []  # (works, buffers kept alive, peer, call)
        self.calls = 0  # training calls begun since this transport was made (each send is tagged with its call)
        self._inbox: tuple[str, int, list | None, list[torch.Tensor], int] | None = None  # (kind, piece, works, buffers, peer)
        self._held: dict[int, list] = {}  # peer -> sends held back for it (NCCL's path), in the order it consumes them

    @property
    def prepost_enabled(self) -> bool:
        """Whether the next action's receive is posted before the current action runs (gloo only)."""
        return self._prepost

    @prepost_enabled.setter
    def prepost_enabled(self, value: bool) -> None:
        if value and not self._gloo:
            raise ValueError(
                "Pre-posted receives need the gloo backend: on NCCL a lone receive uses another communicator than "
                "the batched send it waits for, and would never be matched. Leave it off (the default there"
                + (", and under transport='nccl-rules', which keeps NCCL's rules on gloo)." if self.transport != "auto" else ").")
            )
        self._prepost = bool(value)

    def _tag(self, piece: int, kind: str) -> int:
        """The channel's tag under gloo's rules (0 on NCCL, which ignores tags, and under ``"nccl-rules"``)."""
        return 2 * piece + (kind == "grad") if self._gloo else 0

    def flush(self) -> None:
        """Wait until every posted send has been received (and no receive is left outstanding)."""
        if self._inbox is not None:
            raise RuntimeError(f"a received {self._inbox[0]!r} was never consumed; the schedule and transport disagree")
        if any(self._held.values()):
            raise RuntimeError("a send held back for the receiver's order was never released; the schedule and "
                               "transport disagree")
        pending, self._pending_sends = self._pending_sends, []
        for works, _, peer, _ in pending:
            self._wait(works, peer)

    def reset(self) -> None:
        """Forget shapes: the next activation exchange on every channel starts with a header."""
        self.flush()
        self.act_spec.clear()
        self.sent_spec.clear()

    def abandon(self) -> None:
        """Forget a received or pre-posted message and held sends after a failed call (the pipeline will not
        continue)."""
        self._inbox = None
        self._held.clear()

    def _peer(self, piece: int) -> int:
        """``rank_of_piece(piece)``, remembered (the placement does not change)."""
        peer = self._peers.get(piece)
        if peer is None:
            peer = self._peers[piece] = self.rank_of_piece(piece)
        return peer

    def _reap(self) -> None:
        """Free the sends that report completion (NCCL: their kernel ran; gloo: only once waited, so there is nothing
        to look at: :meth:`begin_call` and :meth:`flush` free them)."""
        if self._gloo:
            return
        self._pending_sends = [entry for entry in self._pending_sends if not all(w.is_completed() for w in entry[0])]

    def begin_call(self) -> None:
        """A new training call begins: free every send posted two or more calls ago.

        Why waiting for them cannot block: let stage ``s`` begin call ``b``. (1) Its activations of call ``b - 2``
        are micro-batches whose backwards stage ``s`` ran in call ``b - 1`` at the latest (a stage keeps fewer than
        ``m`` forwards in flight), and each of those backwards needed a gradient that stage ``s + 1`` could only
        send after its forward had received the activation. (2) Its gradients of call ``b - 2`` reached stage
        ``s - 1`` before that stage sent the activations stage ``s`` received in call ``b - 1`` (1F1B order:
        ``B(j)`` precedes ``F(j + warmup + 1)``). Flushing schedules finish every exchange within the call.
        So the neighbours have received these sends and ``wait()`` returns at once.
        """
        self.calls += 1
        old = [entry for entry in self._pending_sends if entry[3] <= self.calls - 2]
        if old:
            self._pending_sends = [entry for entry in self._pending_sends if entry[3] > self.calls - 2]
            for works, _, peer, _ in old:
                self._wait(works, peer)
        self._reap()

    # -- helpers --------------------------------------------------------------------------------
    def _talking_to(self, peer: int) -> "_TalkingTo":
        """Turn a communication error with ``peer`` (posting or waiting: gloo raises ``RuntimeError`` as soon as a
        dead peer's connection resets, NCCL ``DistBackendError``) into a :class:`PeerFailure` naming it."""
        return _TalkingTo(self, peer)

    def _failure(self, peer: int, err: Exception) -> PeerFailure:
        return PeerFailure(
            f"Pipeline stage {self.stage_of_rank(peer)} (global rank {peer}) stopped answering: {err}. "
            "Look at that rank's log for the original error."
        )

    def _wait(self, works, peer: int) -> None:
        try:
            for w in works:
                w.wait()
        except Exception as err:
            raise self._failure(peer, err) from err

    def _send_header(self, spec: BoundarySpec, peer: int, tag: int) -> None:
        self.headers_sent += 1
        payload = torch.tensor(list(spec.encode()), dtype=torch.uint8, device=self.device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        for tensor in (length, payload):
            with self._talking_to(peer):
                work = dist.isend(tensor, peer, group=self.group, tag=tag)
            self._pending_sends.append(([work], [tensor], peer, self.calls))

    def _receive_header(self, peer: int, tag: int) -> BoundarySpec:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        with self._talking_to(peer):
            dist.irecv(length, peer, group=self.group, tag=tag).wait()
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
            dist.irecv(payload, peer, group=self.group, tag=tag).wait()
        return BoundarySpec.decode(payload.cpu().numpy().tobytes())

    def _activation_tensors(self, value, piece: int, peer: int) -> list[torch.Tensor]:
        """The leaves of ``value`` (``piece``'s output) to send, after announcing (first time) or checking
        (afterwards) its spec."""
        leaves, structure = flatten(value, self.name)
        specs = BoundarySpec.leaf_specs(leaves)
        sent = self.sent_spec.get(piece)
        if sent is None:
            self.sent_spec[piece] = BoundarySpec(structure, specs)
            self._send_header(self.sent_spec[piece], peer, self._tag(piece + 1, "act"))
        elif specs != sent.leaves or structure != sent.structure:
            raise BoundaryChanged(
                f"The output of {self.name} changed within a batch: it was {sent.describe()} and is now "
                f"{BoundarySpec(structure, specs).describe()}. Every micro-batch of a batch must cross a stage boundary "
                "with the same structure, dtypes and shapes (only a new batch shape announces new ones): make the "
                "units' outputs depend on the batch's shape only, e.g. pad to a fixed length."
            )
        return [x.detach().contiguous() for x in leaves]

    # -- API ------------------------------------------------------------------------------------
    def exchange(self, send=None, recv: tuple[str, int] | None = None, order: tuple[str, int] | None = None) -> None:
        """Send ``send`` and/or receive ``recv`` in one group.

        ``send`` is ``(value, kind, piece)``: an ``"act"`` (a boundary value, ``piece``'s output, to the piece after)
        or a ``"grad"`` (a list of tensors, one per leaf of ``piece``'s received activation that requires grad, to
        the piece before). ``recv`` is ``(kind, piece)``: the next message of that channel, waited for here and
        handed out by the next :meth:`receive` of its channel. A receive whose channel still owes its header is
        left to :meth:`receive` (after the send is posted: waiting for a header first could wait for a peer that
        waits for this very send).

        ``order`` (the step's ``send_order``, :func:`~lightning_async.pipeline.program.order_sends`), on NCCL's path
        only (gloo's tags match any order, so there it sends at once): ``("hold", k)`` keeps ``send`` back at place
        ``k`` of the peer's held sends; ``("release", n)`` sends it, then the first ``n`` held ones, each in its own
        group after its header, ``recv`` with the last.
        """
        self._reap()
        if order is not None and send is not None and not self._gloo:
            send = self._ordered(send, order)
        if recv is not None and (self._inbox is not None or (send is not None and not self._shape_known(*recv))):
            recv = None  # one receive outstanding at a time (it is consumed first); a header-owing one waits
        ops, sent, send_peer = [], [], None
        if send is not None:
            value, kind, piece = send
            target = piece + 1 if kind == "act" else piece - 1
            send_peer, tag = self._peer(target), self._tag(target, kind)
            sent = self._activation_tensors(value, piece, send_peer) if kind == "act" else [g.contiguous() for g in value]
            ops += [self._op(dist.isend, x, send_peer, tag) for x in sent]
        if recv is not None:
            out, recv_peer, tag = self._recv_buffers(*recv)
            ops += [self._op(dist.irecv, x, recv_peer, tag) for x in out]
            self._inbox = (recv[0], recv[1], None, out, recv_peer)
        if not ops:
            return
        with self._talking_to(send_peer if send is not None else recv_peer):
            works = self._post(ops)
        if len(works) == len(ops):
            send_works, recv_works = works[: len(sent)], works[len(sent) :]
        else:  # coalesced (NCCL): one work for the whole group
            send_works = recv_works = works
        if sent:
            self._pending_sends.append((send_works, sent, send_peer, self.calls))
        if recv is not None and out:
            self._wait(recv_works, recv_peer)

    def _ordered(self, send, order: tuple[str, int]):
        """Hold ``send`` back (None) or post it and the held sends ``order`` releases but the last (returned)."""
        _, kind, piece = send
        queue = self._held.setdefault(self._peer(piece + 1 if kind == "act" else piece - 1), [])
        how, n = order
        if how == "hold":
            queue.insert(n, send)
            return None
        released = [send, *queue[:n]]
        del queue[:n]
        for each in released[:-1]:
            self.exchange(each)
        return released[-1]

    def _post(self, ops: list) -> list:
        """Post ``ops`` as one group: ``batch_isend_irecv`` on NCCL (the fused, matching-order groups); on gloo, which
        posts a group's operations one by one anyway, each on its own (its coalescing manager costs 15-30 us per
        call on a CPU, on the hop's critical path: ``benchmarks/pipeline_throughput.py``)."""
        if not self._gloo:
            self.groups_batched += 1
            return dist.batch_isend_irecv(ops)
        return [post(tensor, peer, group=self.group, tag=tag) for post, tensor, peer, tag in ops]

    def _op(self, post, tensor: torch.Tensor, peer: int, tag: int):
        """One operation of a group: a ``P2POp`` for ``batch_isend_irecv`` (NCCL); on gloo, which posts each on its
        own, the plain ``(post, tensor, peer, tag)`` (a ``P2POp`` resolves its group again on every message)."""
        if self._gloo:
            return post, tensor, peer, tag
        return dist.P2POp(post, tensor, peer, group=self.group, tag=tag)

    def _shape_known(self, kind: str, piece: int) -> bool:
        return (self.act_spec if kind == "act" else self.sent_spec).get(piece) is not None

    def prepost(self, kind: str, piece: int) -> bool:
        """Post the receive of ``piece``'s next ``kind`` message now, unwaited (when enabled and its shape is known);
        True when that receive is posted (now or already)."""
        if self._inbox is not None:
            return self._inbox[:2] == (kind, piece)
        if not self.prepost_enabled or not self._shape_known(kind, piece):
            return False
        out, peer, tag = self._recv_buffers(kind, piece)
        with self._talking_to(peer):
            works = [dist.irecv(x, peer, group=self.group, tag=tag) for x in out]
        self._inbox = (kind, piece, works, out, peer)
        self.preposted += 1
        return True

    def receive(self, kind: str, piece: int):
        """``piece``'s next ``"act"`` (from the piece before; a boundary value) or ``"grad"`` (from the piece after;
        a list of tensors), already received, pre-posted, or fetched now. Received activation leaves that carried
        gradients require grad."""
        if self._inbox is None:
            self.exchange(None, (kind, piece))
        got, got_piece, works, out, peer = self._inbox
        if (got, got_piece) != (kind, piece):
            raise RuntimeError(
                f"expected to receive {kind!r} for piece {piece} but {got!r} for piece {got_piece} is outstanding; "
                "the schedule and transport disagree"
            )
        self._inbox = None
        if works is not None:
            self._wait(works, peer)
        if kind == "grad":
            return out
        for x, (_, _, requires_grad) in zip(out, self.act_spec[piece].leaves):
            x.requires_grad_(requires_grad)
        return unflatten(out, self.act_spec[piece].structure)

    def _recv_buffers(self, kind: str, piece: int) -> tuple[list[torch.Tensor], int, int]:
        tag = self._tag(piece, kind)
        if kind == "act":
            peer = self._peer(piece - 1)
            if piece not in self.act_spec:
                self.act_spec[piece] = self._receive_header(peer, tag)
            specs = [(d, s) for d, s, _ in self.act_spec[piece].leaves]
        else:
            peer = self._peer(piece + 1)
            specs = self.sent_spec[piece].grads
        return [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs], peer, tag


class _TalkingTo:
    """:meth:`StageTransport._talking_to`'s context (a class: a generator-based one costs a few microseconds, several
    times per action)."""

    __slots__ = ("transport", "peer")

    def __init__(self, transport: StageTransport, peer: int) -> None:
        self.transport, self.peer = transport, peer

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, traceback) -> bool:
        if kind is not None and issubclass(kind, Exception):
            raise self.transport._failure(self.peer, err) from err
        return False
