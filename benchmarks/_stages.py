"""Stage builders and process helpers for ``benchmarks/pipeline_throughput.py``.

Two kinds of stages:

* ``sleep``: one tiny parameter and a custom autograd function whose forward sleeps ``tf`` seconds and whose
  backward sleeps ``tb`` seconds. The stage time is fixed and uses no CPU, so a 2-core machine can host 4 or 8
  stages and the measurement isolates the schedule and the runtime's own overheads (Python, p2p, bookkeeping).
* ``real``: the ``tiny`` SmolLM2 cut into ``p`` contiguous slices of its pipeline units (real compute; each
  process runs one thread).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lightning_async.pipeline.local import run_local

SLEEP_WIDTH = 8  # features per sleep-stage activation (a tiny message: latency, not bandwidth)


# ---------------------------------------------------------------------------------------------- sleep stages
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, tf: float, tb: float):
        time.sleep(tf)
        ctx.save_for_backward(x, w)
        ctx.tb = tb
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        time.sleep(ctx.tb)
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class SleepStage(nn.Module):
    """Forward sleeps ``tf``, backward sleeps ``tb``; ``y = x * w`` with one scalar parameter."""

    def __init__(self, tf: float, tb: float) -> None:
        super().__init__()
        self.tf, self.tb = tf, tb
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.tf, self.tb)


def mse_loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def split_identity(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return batch, batch


@dataclass
class Workload:
    """Everything a rank needs to build its stage (fresh parameters for every schedule) and batches."""

    kind: str  # "sleep" or "real"
    p: int
    m: int
    tf: float = 0.0
    tb: float = 0.0
    microbatch_size: int = 1
    seq_len: int = 64

    def build(self, stage: int):
        """Return ``(units, named_params, tied_names)`` for ``stage``: units for ``StageModule``."""
        if self.kind == "sleep":
            unit = SleepStage(self.tf, self.tb)
            return [("sleep", unit)], [("sleep.w", unit.w)], []
        from lightning_async.models import SmolLM2, model_config
        from lightning_async.pipeline.stage import build_rank_stage

        torch.manual_seed(0)
        model = SmolLM2(model_config("tiny"))
        built = build_rank_stage([(f"model.{n}", u) for n, u in model.pipeline_units()], stage, num_stages=self.p)
        return list(zip(built.module.unit_names, built.module.units)), built.named_parameters, built.tied

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

    def microbatch_input(self, stage: int, module: nn.Module) -> torch.Tensor:
        """A representative input of ``stage`` for timing (activations from the previous stages)."""
        inputs, _ = self.split()(self.batch(0))
        x = inputs[: self.microbatch_size]
        if self.kind == "sleep" or stage == 0:
            return x
        with torch.no_grad():
            from lightning_async.models import SmolLM2, model_config

            torch.manual_seed(0)
            model = SmolLM2(model_config("tiny"))
            units = dict(model.pipeline_units())
            from lightning_async.pipeline.partition import partition_units

            names = partition_units([(f"model.{n}", u) for n, u in model.pipeline_units()], self.p, "uniform")
            for s in range(stage):
                for n in names[s]:
                    x = units[n.removeprefix("model.")](x)
        return x


def time_stage(work: Workload, stage: int, reps: int = 15) -> tuple[float, float]:
    """Median forward and backward seconds of one micro-batch on this stage (real compute)."""
    from lightning_async.pipeline.stage import StageModule

    units, _, _ = work.build(stage)
    module = StageModule(units)
    x0 = work.microbatch_input(stage, module)
    _, targets = work.split()(work.batch(0))
    target = targets[: work.microbatch_size]
    fwd, bwd = [], []
    for i in range(reps + 3):
        x = x0.detach().requires_grad_(x0.is_floating_point())
        t0 = time.perf_counter()
        y = module(x)
        if stage == work.p - 1:
            y = work.loss()(y, target)
        t1 = time.perf_counter()
        if stage == work.p - 1:
            y.backward()
        else:
            y.backward(torch.ones_like(y))
        t2 = time.perf_counter()
        module.zero_grad(set_to_none=True)
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


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


# ---------------------------------------------------------------------------------------------- processes
def spawn(world: int, fn: Callable, *args, timeout: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``world`` gloo processes (one thread each); return results by rank."""
    return run_local(world, fn, *args, timeout=timeout)


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
    return {k: statistics.median(v) for k, v in out.items() if v}
