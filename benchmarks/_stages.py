"""Stage builders and gloo probes for ``benchmarks/pipeline_throughput.py`` (its process helpers: ``_bench``).

Two kinds of stages:

* ``sleep``: one tiny parameter and custom autograd functions whose forward sleeps ``tf`` seconds and whose
  backward sleeps ``tb`` seconds, the weight-gradient part (``tw``) in a node of its own so that split backwards
  (zero-bubble schedules, ours and torch's) run it separately. The stage time is fixed and uses no CPU, so a
  2-core machine can host 4 or 8 stages and the measurement isolates the schedule and the runtime's own overheads
  (Python, p2p, bookkeeping).
* ``real``: the ``tiny`` SmolLM2 cut into contiguous slices of its pipeline units (real compute; each process
  runs one thread).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import _bench

SLEEP_WIDTH = 8  # features per sleep-stage activation (a tiny message: latency, not bandwidth)


# ---------------------------------------------------------------------------------------------- sleep stages
class _SleepInput(torch.autograd.Function):
    """``x * w`` (``w`` detached): the forward sleeps ``tf``, the backward (the input gradient) ``ti``."""

    @staticmethod
    def forward(ctx, x, w, tf: float, ti: float):
        time.sleep(tf)
        ctx.save_for_backward(w)
        ctx.ti = ti
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        time.sleep(ctx.ti)
        return grad * w, None, None, None


class _SleepWeight(torch.autograd.Function):
    """Zero, but connected to ``w``: its backward is the weight gradient of ``x * w`` and sleeps ``tw``; while a
    split backward is collecting (our runtime's ``I``) it is deferred to ``W``, like a linear layer's."""

    @staticmethod
    def forward(ctx, x, w, tw: float):
        ctx.save_for_backward(x, w)
        ctx.tw = tw
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        from lightning_async.pipeline.weight_grad import accumulate_grad, collecting_now

        x, w = ctx.saved_tensors
        tw = ctx.tw

        def weight_grad() -> torch.Tensor:
            time.sleep(tw)
            return (grad * x).sum().reshape(w.shape)

        collection = collecting_now()
        if collection is None:
            return None, weight_grad(), None
        collection.defer(lambda: accumulate_grad(w, weight_grad()))
        return None, None, None


class SleepStage(nn.Module):
    """``y = x * w`` with one scalar parameter; the forward sleeps ``tf``, the backward ``tb``: ``tb - tw`` for the
    input gradient and ``tw`` for the weight gradient, as two autograd nodes, so both our split backward and
    torch's (``torch.autograd.grad`` with respect to the inputs, then the weights) run each part alone.

    ``weights``: that many more (zero) parameter tensors, each added to the output: a real stage's count of weight
    tensors (a SmolLM2-360M stage of 4 has about 75), for what a runtime pays per tensor per action."""

    def __init__(self, tf: float, tb: float, tw: float | None = None, weights: int = 0) -> None:
        super().__init__()
        self.tf, self.tb = tf, tb
        self.tw = tb / 2 if tw is None else tw
        self.w = nn.Parameter(torch.ones(1))
        self.extra = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(weights)])

    def forward(self, x):
        y = _SleepInput.apply(x, self.w.detach(), self.tf, self.tb - self.tw) + _SleepWeight.apply(x.detach(), self.w, self.tw)
        for w in self.extra:
            y = y + w
        return y


def mse_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def split_identity(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return batch, batch


@dataclass
class Workload:
    """Everything a rank needs to build its pieces (fresh parameters for every schedule) and batches.

    ``tf``/``tb``/``tw``: sleep stages' seconds per micro-batch for a *rank's* share (a schedule with ``v`` chunks
    per rank gets ``p x v`` sleep units of ``1/v`` of it each). Real stages: the ``tiny`` SmolLM2 with ``layers``
    blocks (default: enough for ``p x 2`` pieces).
    """

    kind: str  # "sleep" or "real"
    p: int
    m: int
    tf: float = 0.0
    tb: float = 0.0
    tw: float | None = None
    microbatch_size: int = 1
    seq_len: int = 64
    layers: int | None = None
    weights: int = 0  # sleep: extra parameter tensors per rank (SleepStage's ``weights``)

    def units(self, pieces: int) -> list[tuple[str, nn.Module]]:
        """Fresh units for a split into ``pieces`` (sleep: one unit per piece; real: the model's units)."""
        if self.kind == "sleep":
            v = pieces // self.p
            tw = None if self.tw is None else self.tw / v
            return [(f"sleep{k}", SleepStage(self.tf / v, self.tb / v, tw, self.weights // v)) for k in range(pieces)]
        from lightning_async.models import SmolLM2, model_config

        torch.manual_seed(0)
        model = SmolLM2(model_config("tiny", num_layers=self.layers or max(4, 2 * self.p)))
        return [(f"model.{n}", u) for n, u in model.pipeline_units()]

    def split(self):
        if self.kind == "sleep":
            return split_identity
        from lightning_async.models.objective import split_next_token

        return split_next_token

    def loss(self):
        if self.kind == "sleep":
            return mse_loss
        from lightning_async.models.objective import next_token_loss

        return next_token_loss

    def batch(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        if self.kind == "sleep":
            return torch.randn(self.m * self.microbatch_size, SLEEP_WIDTH, generator=g)
        return torch.randint(0, 257, (self.m * self.microbatch_size, self.seq_len + 1), generator=g)


def ping_pong(shape, dtype=torch.float32, reps: int = 50, group=None) -> float:
    """One-hop latency (half the median round trip) between ranks 0 and 1 for a ``shape`` message.

    Uses ``batch_isend_irecv`` like the runtime. Other ranks do nothing.
    """
    rank = dist.get_rank()
    if rank > 1:
        return 0.0
    buf = torch.zeros(shape, dtype=dtype)
    rtts = []
    for i in range(reps + 5):
        t0 = time.perf_counter()
        if rank == 0:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, 1, group=group)]):
                w.wait()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1, group=group)]):
                w.wait()
        else:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0, group=group)]):
                w.wait()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, 0, group=group)]):
                w.wait()
        if i >= 5:
            rtts.append(time.perf_counter() - t0)
    return statistics.median(rtts) / 2


# ---------------------------------------------------------------------------------------------- p2p probes
def _stamp() -> torch.Tensor:
    return torch.tensor([time.perf_counter()], dtype=torch.float64)


def p2p_probe(reps: int = 15, idle: float = 0.02) -> dict:
    """Anatomy of one gloo hop between ranks 0 and 1 (all times share the machine's monotonic clock).

    * ``send_wait_late_recv``: rank 0 ``isend(...).wait()`` while rank 1 posts its ``irecv`` only ``idle``
      seconds later. If gloo sends eagerly this is ~0; with a rendezvous it is ~``idle``.
    * ``hop_blocked``: rank 1 already waits in ``irecv``; the time from rank 0's ``isend`` to rank 1 waking up.
    * ``wait_after_late_post``: rank 0 sent ``idle`` ago; rank 1 then posts ``irecv`` and waits (the message
      is not in its buffer yet if gloo waits for the posted receive before transferring).
    * ``wait_preposted``: rank 1 posts ``irecv`` first, computes (sleeps) ``idle`` while rank 0 sends halfway,
      then waits.
    """
    rank = dist.get_rank()
    if rank > 1:
        return {}
    buf = torch.zeros(1, dtype=torch.float64)
    out: dict[str, list[float]] = {k: [] for k in ("send_wait_late_recv", "hop_blocked", "wait_after_late_post", "wait_preposted")}
    for _ in range(reps):
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            dist.isend(_stamp(), 1).wait()
            out["send_wait_late_recv"].append(time.perf_counter() - t0)
        else:
            time.sleep(idle)
            dist.irecv(buf, 0).wait()
        dist.barrier()
        if rank == 0:
            time.sleep(idle)
            dist.isend(_stamp(), 1).wait()
        else:
            dist.irecv(buf, 0).wait()
            out["hop_blocked"].append(time.perf_counter() - float(buf[0]))
        dist.barrier()
        if rank == 0:
            work = dist.isend(_stamp(), 1)
            time.sleep(2 * idle)
            work.wait()
        else:
            time.sleep(idle)
            t0 = time.perf_counter()
            dist.irecv(buf, 0).wait()
            out["wait_after_late_post"].append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:
            time.sleep(idle / 2)
            dist.isend(_stamp(), 1).wait()
        else:
            work = dist.irecv(buf, 0)
            time.sleep(idle)
            t0 = time.perf_counter()
            work.wait()
            out["wait_preposted"].append(time.perf_counter() - t0)
    return _bench.medians({k: v for k, v in out.items() if v})
