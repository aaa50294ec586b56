"""Point-to-point transport between neighbouring stages (our own small layer over torch.distributed).

Why not ``torch.distributed.pipelining.PipelineStage``: its communication helpers are private
(``_batch_p2p``, ``_initialize_stage``) and its schedules clear their state every step, while 2BW keeps
micro-batches in flight across steps. This layer is ~100 lines on public APIs only.

Ordering rule (NCCL-safe): a send that is followed by a receive from the same neighbour is posted in one
``batch_isend_irecv`` group (forward-send with backward-receive and vice versa, as Megatron does), so
both sides always post in matching order. Receives are waited on at once; sends are not: a gloo send
of a large tensor completes only when the receiver has posted its receive, and under 2BW the receiver
of a stage's last send of a batch is already in the next batch. Waiting there would tie every
training call to the neighbour's next one (and deadlock against any collective Lightning runs between
batches). Pending sends keep their buffers alive and are reaped as they complete; :meth:`flush`
waits for all of them (drain, evaluation, checkpoints).

Pre-posted receives (gloo): gloo moves a message only once its receive is posted, so a receive posted
after the compute that precedes it costs a late round trip (about 1 ms against 0.15 ms on a loaded CPU,
``benchmarks/pipeline_throughput.py --probe``). On gloo the runtime therefore posts the receive of the
*next* action's input before running the current action (:meth:`StageTransport.prepost`), and sends on
their own. At most one receive is outstanding and it is consumed by the very next action, so receives
from a neighbour are still posted in the order it sends. NCCL keeps the fused, matching-order groups
above: an unmatched receive posted early on both sides of a pair could block each other's stream.

Shapes: the first activation sent after a (re)start is preceded by a small header (dtype and shape);
afterwards every message between the same pair has that shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8]
_HEADER_LEN = 10


class PeerFailure(RuntimeError):
    """A neighbouring stage stopped answering (it died or raised)."""


class StageTransport:
    """Sends and receives activations/gradients of one stage; ``prev``/``next`` are global ranks or None."""

    def __init__(
        self, prev: int | None, next: int | None, group, device: torch.device, stage_of_rank, prepost: bool | None = None
    ) -> None:
        self.prev, self.next, self.group, self.device = prev, next, group, device
        self.stage_of_rank = stage_of_rank
        #: post the next action's receive before the current action (default: on gloo only)
        self._gloo = dist.is_initialized() and dist.get_backend(group) == "gloo"
        self.prepost_enabled = self._gloo if prepost is None else prepost
        self.preposted = 0  # receives posted ahead so far (for tests and benchmarks)
        self.act_spec: tuple[torch.Size, torch.dtype] | None = None  # what we receive from prev
        self.sent_spec: tuple[torch.Size, torch.dtype] | None = None  # what we send to next (= grads we receive)
        self._pending_sends: list[tuple[object, torch.Tensor, int]] = []  # (work, buffer kept alive, peer)
        self._inbox: tuple[str, object | None, torch.Tensor, int] | None = None  # (kind, work or None, buffer, peer)

    @property
    def prepost_enabled(self) -> bool:
        """Whether the next action's receive is posted before the current action runs (gloo only)."""
        return self._prepost

    @prepost_enabled.setter
    def prepost_enabled(self, value: bool) -> None:
        if value and not self._gloo:
            raise ValueError(
                "Pre-posted receives need the gloo backend: on NCCL a lone receive uses another communicator than "
                "the batched send it waits for, and would never be matched. Leave it off (the default there)."
            )
        self._prepost = bool(value)

    def reset(self) -> None:
        """Forget shapes: the next activation exchange starts with a header."""
        self.flush()
        self.act_spec = None
        self.sent_spec = None

    def flush(self) -> None:
        """Wait until every posted send has been received (and no receive is left outstanding)."""
        if self._inbox is not None:
            raise RuntimeError(f"a received {self._inbox[0]!r} was never consumed; the schedule and transport disagree")
        pending, self._pending_sends = self._pending_sends, []
        for work, _, peer in pending:
            self._wait([work], peer)

    def abandon(self) -> None:
        """Forget a received or pre-posted message after a failed call (the pipeline will not continue)."""
        self._inbox = None

    def _reap(self) -> None:
        self._pending_sends = [entry for entry in self._pending_sends if not entry[0].is_completed()]

    # -- helpers --------------------------------------------------------------------------------
    def _wait(self, works, peer: int) -> None:
        try:
            for w in works:
                w.wait()
        except Exception as err:  # gloo raises RuntimeError, NCCL DistBackendError
            raise PeerFailure(
                f"Pipeline stage {self.stage_of_rank(peer)} (global rank {peer}) stopped answering: {err}. "
                "Look at that rank's log for the original error."
            ) from err

    def _header(self, tensor: torch.Tensor) -> torch.Tensor:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = _DTYPES.index(tensor.dtype)
        header[1] = tensor.ndim
        header[2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
        return header.to(self.device)

    def _exchange_header(self, tensor: torch.Tensor | None, peer: int, sending: bool) -> tuple[torch.Size, torch.dtype]:
        if sending:
            header = self._header(tensor)
            self._pending_sends.append((dist.isend(header, peer, group=self.group), header, peer))
            return tensor.shape, tensor.dtype
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
        self._wait([dist.irecv(header, peer, group=self.group)], peer)
        header = header.cpu()
        ndim = int(header[1])
        return torch.Size(header[2 : 2 + ndim].tolist()), _DTYPES[int(header[0])]

    def _buffer(self, kind: str) -> torch.Tensor:
        shape, dtype = self.act_spec if kind == "act" else self.sent_spec
        return torch.empty(shape, dtype=dtype, device=self.device)

    # -- API ------------------------------------------------------------------------------------
    def exchange(self, send: torch.Tensor | None, send_kind: str | None, recv: str | None = None) -> None:
        """Send ``send`` (an ``"act"`` to next or a ``"grad"`` to prev) and/or receive ``recv`` in one group.

        A received tensor is waited for here and handed out by the next :meth:`receive` of its kind.
        """
        self._reap()
        ops = []
        if send is not None:
            send_peer = self.next if send_kind == "act" else self.prev
            if send_kind == "act" and self.sent_spec is None:
                self.sent_spec = self._exchange_header(send, send_peer, sending=True)
            send = send.contiguous()
            ops.append(dist.P2POp(dist.isend, send, send_peer, group=self.group))
        if recv is not None:
            out, recv_peer = self._recv_buffer(recv)
            ops.append(dist.P2POp(dist.irecv, out, recv_peer, group=self.group))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if send is not None:
            self._pending_sends.append((works[0], send, send_peer))
        if recv is not None:
            self._wait(works[-1:], recv_peer)
            self._inbox = (recv, None, out, recv_peer)

    def prepost(self, kind: str) -> bool:
        """Post the receive of the next ``kind`` message now, unwaited (when enabled and its shape is known)."""
        spec = self.act_spec if kind == "act" else self.sent_spec
        if not self.prepost_enabled or spec is None or self._inbox is not None:
            return False
        out, peer = self._recv_buffer(kind)
        self._inbox = (kind, dist.irecv(out, peer, group=self.group), out, peer)
        self.preposted += 1
        return True

    def receive(self, kind: str) -> torch.Tensor:
        """The next ``"act"`` (from prev) or ``"grad"`` (from next): already received, pre-posted, or fetched now."""
        if self._inbox is None:
            self.exchange(None, None, kind)
        got, work, out, peer = self._inbox
        if got != kind:
            raise RuntimeError(f"expected to receive {kind!r} but {got!r} is outstanding; the schedule and transport disagree")
        self._inbox = None
        if work is not None:
            self._wait([work], peer)
        return out

    def _recv_buffer(self, kind: str) -> tuple[torch.Tensor, int]:
        peer = self.prev if kind == "act" else self.next
        if kind == "act" and self.act_spec is None:
            self.act_spec = self._exchange_header(None, peer, sending=False)
        return self._buffer(kind), peer
