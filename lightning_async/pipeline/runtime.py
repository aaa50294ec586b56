"""The pipeline runtime: executes a schedule's actions for one stage, with weight versions.

One :class:`PipelineRuntime` per process. It owns the stage's weight slots (two under ``2bw``, one
for the flushing schedules), runs forwards through ``torch.func.functional_call`` so each micro-batch
uses the slot of its batch's version and autograd accumulates into that slot, and applies updates with
:func:`~lightning_async.optim.delayed_step.delayed_step`, the same code as the single-device simulation.

2BW timing: when the stage has finished batch ``b``'s last backward it takes the gradient and starts its
reductions asynchronously (global norm for clipping, tied weights). The update ``V(b + 2)`` is applied as
soon as those have finished (checked between actions), and at the latest at the start of call ``b + 2``,
the first moment ``V(b + 2)`` is read. So clipping by the global norm and tied-weight sums never make one
stage wait for another in steady state, and a gradient buffer is held only while its reductions run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.func import functional_call

from lightning_async.optim.delayed_step import delayed_step, scheduled_values
from lightning_async.optim.corrections import Correction
from lightning_async.pipeline import schedules
from lightning_async.pipeline.boundary import flatten, rows, signature, split_rows
from lightning_async.pipeline.mesh import PipelineGroups
from lightning_async.pipeline.p2p import PeerFailure, StageTransport
from lightning_async.pipeline.stage import StageModule
from lightning_async.pipeline.schedules import BACKWARD, FORWARD, UPDATE


def average_over_replicas(grads: list[torch.Tensor], groups: PipelineGroups) -> None:
    """Average ``grads`` in place over the data-parallel replicas: one reduction per dtype, not per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for x in grads:
        by_dtype.setdefault(x.dtype, []).append(x)
    flats, works = [], []
    for same in by_dtype.values():
        flat = torch.cat([x.reshape(-1) for x in same]).div_(groups.data_parallel_size)
        flats.append((flat, same))
        works.append(dist.all_reduce(flat, group=groups.data_parallel, async_op=True))
    wait_collectives(works, "the data-parallel gradient average", groups, "data_parallel")  # replicas run in lockstep
    for flat, same in flats:
        for x, part in zip(same, flat.split([x.numel() for x in same])):
            x.copy_(part.view_as(x))


def wait_collectives(works, what: str, groups: PipelineGroups | None = None, kind: str = "metrics") -> None:
    """Wait for collective operations; a dead peer becomes a :class:`PeerFailure` naming the suspects."""
    try:
        for work in works:
            work.wait()
    except Exception as err:
        suspects = "a pipeline rank"
        if groups is not None:
            others = [r for r in groups.members(kind) if r != groups.rank]
            if len(others) == 1:
                suspects = f"Pipeline stage {groups.stage_of_rank(others[0])} (global rank {others[0]})"
            else:
                suspects = f"One of global ranks {others}"
        raise PeerFailure(
            f"{suspects} stopped answering while this rank waited for {what}: {err}. "
            "Look at the other ranks' logs for the original error."
        ) from err


@dataclass
class _PendingUpdate:
    batch: int
    grads: list[torch.Tensor | None]
    hyperparameters: list[dict]
    works: list = field(default_factory=list)
    norm_sq: torch.Tensor | None = None
    launch: Callable[[], None] | None = None  # cross-stage reductions not started yet (see _begin_update)


class PipelineRuntime:
    """Executes ``schedule`` for one stage.

    Args:
        stage_module: this stage's units.
        optimizer: optimizer over the stage's parameters (the module's ``nn.Parameter`` objects).
        schedule: ``"2bw"``, ``"1f1b"`` or ``"gpipe"`` (what each means: :data:`~lightning_async.pipeline.schedules.SPECS`).
        n_microbatches: micro-batches per batch ``m``.
        split_batch: ``batch -> (inputs, targets)``; every rank gets the same batch.
        loss_fn: ``(outputs, targets) -> scalar mean loss`` (last stage).
        groups: ranks and process groups; defaults to a single process.
        gradient_clip_val: global-norm clipping over all stages (``None``/0: off).
        correction: a staleness correction (``2bw`` only; gradient- or update-level: Error Feedback, adaptive
            EF, the Nesterov-style look-ahead, DC-ASGD).
        tied_parameters: names (in ``stage_module``) of weights shared between first and last stage.
        count_tied_in_norm: whether this stage counts the tied weights in the global norm.
        autocast: context manager factory for forwards (e.g. bf16 autocast).
        device: where activations live (default: the stage's parameters' device).
        context_fn: the module's ``pipeline_context(inputs)``: evaluated on this stage for every micro-batch and
            passed as ``context=`` to the units whose forward takes it (``None``: no context).
        activation_checkpointing: recompute each unit's forward in the backward instead of keeping its
            activations (only each unit's input stays in flight); the update rule is unchanged.
    """

    def __init__(
        self,
        stage_module: StageModule,
        optimizer: torch.optim.Optimizer,
        schedule: str,
        n_microbatches: int,
        split_batch: Callable,
        loss_fn: Callable,
        groups: PipelineGroups | None = None,
        gradient_clip_val: float | None = None,
        correction: Correction | None = None,
        tied_parameters: Sequence[str] = (),
        count_tied_in_norm: bool = True,
        autocast: Callable = contextlib.nullcontext,
        device: torch.device | None = None,
        context_fn: Callable | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        self.groups = groups or PipelineGroups()
        schedules.validate(schedule, self.groups.num_stages, n_microbatches)
        self.spec = schedules.spec(schedule)
        if correction is not None and correction.enabled:
            self.spec.require_delay(f"The {correction.method!r} correction")
        if correction is not None and correction.enabled and not correction.pipeline_supported:
            raise ValueError(
                f"The {correction.method!r} correction changes the weights the forward reads, which needs a third "
                "weight version per stage; the 2BW runtime keeps two. Study it on one device (DelaySimulation)."
            )
        self.module, self.optimizer, self.schedule = stage_module, optimizer, schedule
        self.n_microbatches = n_microbatches
        self.split_batch, self.loss_fn = split_batch, loss_fn
        self.clip = gradient_clip_val or None
        self.correction = correction
        self.autocast = autocast
        self.context_fn = context_fn
        self.activation_checkpointing = bool(activation_checkpointing)
        self.device = device or next(stage_module.parameters()).device
        named = dict(stage_module.named_parameters())
        self.names = list(named)
        self.params = [named[n] for n in self.names]
        self.tied = [self.names.index(n) for n in tied_parameters]
        self.count_tied_in_norm = count_tied_in_norm
        g = self.groups
        self.is_first, self.is_last = g.stage == 0, g.stage == g.num_stages - 1
        last_unit = stage_module.unit_names[-1] if getattr(stage_module, "unit_names", None) else None
        self.transport = StageTransport(
            g.prev_rank, g.next_rank, g.p2p, self.device, g.stage_of_rank,
            name=f"pipeline stage {g.stage}" + (f" (last unit {last_unit!r})" if last_unit else ""),
        )
        self.slots = [[p.detach().clone().requires_grad_(True) for p in self.params] for _ in range(self.spec.weight_versions)]
        for p, t in zip(self.params, self.slots[-1]):
            p.data = t.data  # the module's parameters always show the newest weights
        self.batches_done = 0  # training calls finished
        self.fresh = True  # pipeline empty: the next call starts with warmup
        self.batch_shape: tuple | None = None  # signature (structure, dtypes, shapes) of the last batch's inputs
        self._inflight: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # mb -> (inputs, outputs) with grads
        self._pending: dict[int, _PendingUpdate] = {}
        self._hyper: dict[int, list[dict]] = {}
        self._losses: list[torch.Tensor] = []
        self._batch_data: dict[int, tuple[list, list]] = {}
        self.reported_losses: dict[int, torch.Tensor] = {}  # batch -> mean loss (after the metrics reduce)
        self._loss_works: dict[int, tuple[object, torch.Tensor]] = {}
        self.last_grad_norm: torch.Tensor | None = None

    # ---- version bookkeeping -------------------------------------------------------------------
    def _slot(self, batch: int) -> list[torch.Tensor]:
        return self.slots[batch % len(self.slots)]

    def newest(self) -> list[torch.Tensor]:
        return [p.data for p in self.params]

    # ---- actions --------------------------------------------------------------------------------
    def _forward(self, mb: int, batch: int, x, inputs, targets, training: bool):
        """Run this stage on ``x`` (the received value, or the micro-batch ``inputs`` on the first stage)."""
        slot = self._slot(batch) if training else self.newest()
        weights = dict(zip(self.names, slot))
        kwargs = {"recompute": True} if training and self.activation_checkpointing else {}
        with self.autocast():
            if self.context_fn is not None:  # under autocast, as in the module's own forward
                kwargs["context"] = self.context_fn(inputs)
            y = functional_call(self.module, weights, (x,), kwargs)
            if self.is_last:
                y = self.loss_fn(y, targets)
        if training:
            grad_inputs = [] if self.is_first else [t for t in flatten(x)[0] if t.requires_grad]
            grad_outputs = [y] if self.is_last else [t for t in flatten(y)[0] if t.requires_grad]
            self._inflight[mb] = (grad_inputs, grad_outputs)
        return y

    def _backward(self, mb: int, grads: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Backward of micro-batch ``mb``; the gradients of its received leaves (``None`` on the first stage)."""
        inputs, outputs = self._inflight.pop(mb)
        if self.is_last:
            (outputs[0] / self.n_microbatches).backward()
        elif outputs:
            torch.autograd.backward(outputs, grads)
        if self.is_first:
            return None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]

    def _record_loss(self, batch: int, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float())
        if len(self._losses) == self.n_microbatches:
            self._reduce_loss(batch, torch.stack(self._losses).mean())
            self._losses = []

    def _reduce_loss(self, batch: int, value: torch.Tensor | None) -> None:
        """Start sending batch ``batch``'s mean loss from the last stage to every rank (asynchronously)."""
        g = self.groups
        if g.metrics is None:
            self.reported_losses[batch] = value
            return
        buf = torch.zeros((), device=self.device) if value is None else value.clone()
        work = dist.all_reduce(buf, group=g.metrics, async_op=True)
        self._loss_works[batch] = (work, buf)

    def collect_loss(self, batch: int, wait: bool = True) -> torch.Tensor | None:
        """Mean training loss of ``batch`` on every rank (``None`` if not reduced yet and ``wait=False``)."""
        if batch in self._loss_works:
            work, buf = self._loss_works[batch]
            if not wait and not work.is_completed():
                return None
            wait_collectives([work], f"the loss of batch {batch}", self.groups, "metrics")
            del self._loss_works[batch]
            self.reported_losses[batch] = buf / self.groups.data_parallel_size
        return self.reported_losses.pop(batch, None)

    def _begin_update(self, batch: int) -> None:
        """Last backward of ``batch`` done: take its gradients and start their reductions."""
        slot = self._slot(batch)
        grads = [t.grad for t in slot]
        for t in slot:
            t.grad = None
        pending = _PendingUpdate(batch, grads, self._hyper.pop(batch))
        g = self.groups
        present = [x for x in grads if x is not None]
        if g.data_parallel is not None and g.data_parallel_size > 1:
            average_over_replicas(present, g)

        def launch() -> None:
            pending.launch = None
            if g.tied is not None and self.tied:
                pending.works += [dist.all_reduce(grads[i], group=g.tied, async_op=True) for i in self.tied if grads[i] is not None]
                if self.is_first:  # the last stage posted long ago; the first stage's norm needs the sum
                    wait_collectives(pending.works, "the tied-weight gradient sum", g, "tied")
            if self.clip:
                skip = set() if self.count_tied_in_norm else set(self.tied)
                sq = sum((x.float().pow(2).sum() for i, x in enumerate(grads) if x is not None and i not in skip), torch.zeros((), device=self.device))
                pending.norm_sq = sq
                if g.pipeline is not None:
                    pending.works.append(dist.all_reduce(sq, group=g.pipeline, async_op=True))

        self._pending[batch] = pending
        if self.is_last and self.spec.delayed and not self.is_first:
            # Under 2BW the last stage finishes batch b inside call b, but the first stage joins these reductions
            # only in call b+1. Started now, an NCCL reduction would sit on this GPU across the step boundary, and
            # any device-wide sync there (torch.cuda.synchronize, empty_cache, an allocator retry) would wait for
            # this rank's own next call: a deadlock. So they start with the next call (or the drain).
            pending.launch = launch
        else:
            launch()

    def _launch_deferred(self) -> None:
        for pending in self._pending.values():
            if pending.launch is not None:
                pending.launch()

    def _apply_ready_updates(self) -> None:
        """Apply pending updates whose reductions have finished (frees their gradient buffers early)."""
        for batch in list(self._pending):
            if self._pending[batch].launch is not None or not all(work.is_completed() for work in self._pending[batch].works):
                return  # updates are applied in batch order
            self._apply_update(batch)

    def _apply_update(self, batch: int) -> None:
        pending = self._pending.pop(batch)
        if pending.launch is not None:
            pending.launch()
        wait_collectives(pending.works, f"the gradient reductions of batch {batch}", self.groups, "pipeline")
        if self.clip and pending.norm_sq is not None:
            norm = pending.norm_sq.sqrt()
            self.last_grad_norm = norm  # global norm before clipping, for logging
            coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            for x in pending.grads:
                if x is not None:
                    x.mul_(coef.to(x.dtype))
        delayed_step(
            self.optimizer,
            self.params,
            pending.grads,
            newest=self.newest(),
            out=self._slot(batch + len(self.slots)),  # 2BW: V(b+2) replaces V(b); sync: in place
            correction=self.correction,
            hyperparameters=pending.hyperparameters,
        )

    # ---- calls ------------------------------------------------------------------------------------
    def _microbatches(self, inputs, targets) -> tuple[list, list]:
        size = rows(inputs)
        if size % self.n_microbatches:
            raise ValueError(
                f"Batch size {size} is not divisible by n_microbatches={self.n_microbatches}; "
                "choose a batch size that is a multiple of n_microbatches."
            )
        if rows(targets) != size:
            raise ValueError(
                f"The batch's inputs have {size} rows but its targets {rows(targets)}; pipeline_split_batch must "
                "return inputs and targets of the same batch size."
            )
        return split_rows(inputs, self.n_microbatches), split_rows(targets, self.n_microbatches)

    def _run(self, actions: Sequence[schedules.Action], training: bool = True) -> None:
        try:
            self._run_actions(actions, training)
        except BaseException:
            self.transport.abandon()  # a later drain must report nothing about this call's receive
            raise

    def _run_actions(self, actions: Sequence[schedules.Action], training: bool) -> None:
        t = self.transport
        for k, action in enumerate(actions):
            nxt = actions[k + 1] if k + 1 < len(actions) else None
            self._apply_ready_updates()
            if action.kind == UPDATE:
                self._begin_update(action.batch)
                if self.spec.flushes:
                    self._apply_update(action.batch)
                else:
                    self._apply_ready_updates()
                continue
            i = action.microbatch % self.n_microbatches
            inputs, targets = self._batch_data[action.batch]
            needs = self._input_kind(nxt)  # what the next action receives, if anything
            if action.kind == FORWARD:
                x = inputs[i] if self.is_first else t.receive("act")
                preposted = needs is not None and t.prepost(needs)
                y = self._forward(action.microbatch, action.batch, x, inputs[i], targets[i], training)
                if self.is_last:
                    self._record_loss(action.batch, y)
                    continue
                t.exchange(y, "act", "grad" if needs == "grad" and not preposted else None)
            else:  # BACKWARD
                grad = None if self.is_last else t.receive("grad")
                preposted = needs is not None and t.prepost(needs)
                dx = self._backward(action.microbatch, grad)
                if self.is_first:
                    continue
                t.exchange(dx, "grad", "act" if needs == "act" and not preposted else None)

    def _input_kind(self, action: schedules.Action | None) -> str | None:
        """``"act"``/``"grad"`` if ``action`` receives its input from a neighbour, else None."""
        if action is None:
            return None
        if action.kind == FORWARD and not self.is_first:
            return "act"
        if action.kind == BACKWARD and not self.is_last:
            return "grad"
        return None

    def train_batch(self, batch_data) -> None:
        """Run the call for the next training batch (2BW: without flushing the pipeline)."""
        b = self.batches_done
        inputs, targets = self.split_batch(batch_data)
        shape = signature(inputs)
        if not self.fresh and shape != self.batch_shape:
            self.drain()  # a new shape needs a fresh pipeline (and a new header exchange)
        self.batch_shape = shape
        if self.fresh:
            self.transport.reset()
        self.transport.begin_call()  # frees the sends of two calls ago (gloo never frees them by itself)
        self._batch_data[b] = self._microbatches(inputs, targets)
        self._launch_deferred()
        self._hyper[b] = scheduled_values(self.optimizer)  # the update of batch b uses batch b's lr, momentum...
        for old in [k for k in self._pending if k <= b - 2]:
            self._apply_update(old)
        actions = schedules.call_actions(self.schedule, self.groups.stage, self.groups.num_stages, self.n_microbatches, b, self.fresh)
        self._run(actions)
        if not self.is_last:
            self._reduce_loss(b, None)  # join the last stage's loss reduction for this batch
        self.fresh = False
        self.batches_done = b + 1
        for done in [k for k in self._batch_data if k < b - 1]:
            del self._batch_data[done]

    def drain(self) -> None:
        """Empty the pipeline: finish in-flight backwards and apply every pending update.

        Runs with autograd on and outside inference mode whatever the caller's context: Lightning evaluates
        under ``torch.inference_mode`` on NCCL, and optimizer state created there could not be updated later.
        """
        if self.fresh or self.batches_done == 0:
            self.fresh = True
            return
        with torch.inference_mode(False), torch.enable_grad():
            self._drain()

    def _drain(self) -> None:
        last = self.batches_done - 1
        self._run(schedules.drain_actions(self.schedule, self.groups.stage, self.groups.num_stages, self.n_microbatches, last))
        for b in sorted(self._pending):
            self._apply_update(b)
        self._batch_data.clear()
        self.transport.flush()
        self.fresh = True

    def eval_batch(self, batch_data) -> torch.Tensor | None:
        """Forward-only pipeline at the newest weights; returns the mean loss over the rows of every replica's batch,
        on every rank.

        Evaluation batches may have any size: micro-batches are cut with ``tensor_split`` (sizes may
        differ; a header announces each new size, one per run of equal sizes) and the loss is weighted by micro-batch size.
        """
        self.drain()
        inputs, targets = self.split_batch(batch_data)
        rows(inputs), rows(targets)  # every leaf has the batch dimension first
        pieces = zip(split_rows(inputs, self.n_microbatches, even=False), split_rows(targets, self.n_microbatches, even=False))
        chunks = [(x, y) for x, y in pieces if rows(x)]
        t = self.transport
        total, count = torch.zeros((), device=self.device), 0
        shape = None
        with torch.no_grad():
            for i, (x, target) in enumerate(chunks):
                if signature(x) != shape:  # every rank holds the batch, so all agree when a new shape (and header) comes
                    t.reset()
                    shape = signature(x)
                value = x if self.is_first else t.receive("act")
                y = self._forward(i, -1, value, x, target, training=False)
                if self.is_last:
                    total += y.float() * rows(target)
                    count += rows(target)
                else:
                    t.exchange(y, "act", None)
        t.reset()
        # (sum of row losses, rows) over every replica's last stage: the mean over all rows evaluated, exact even
        # when the replicas' batches differ in size
        stats = torch.stack([total, torch.tensor(float(count), device=self.device)]) if self.is_last else torch.zeros(2, device=self.device)
        if self.groups.metrics is not None:
            wait_collectives([dist.all_reduce(stats, group=self.groups.metrics, async_op=True)], "the evaluation loss", self.groups, "metrics")
        return stats[0] / stats[1]

    # ---- accounting -------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this stage holds: one weight version, all versions, optimizer state, the correction's buffers."""

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

        state = [v for per_param in self.optimizer.state.values() for v in per_param.values()]
        ef = self.correction.buffers() if self.correction is not None else []
        return {
            "parameters": nbytes(self.params),
            "weight_versions": sum(nbytes(slot) for slot in self.slots),
            "optimizer_state": nbytes(state),
            "correction": nbytes(ef),
            "in_flight_microbatches": len(self._inflight),
        }

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Both weight versions, counters and the correction's buffers (call after :meth:`drain`)."""
        if not self.fresh:
            raise RuntimeError("PipelineRuntime.state_dict() needs an empty pipeline: call drain() first.")
        return {
            "schedule": self.schedule,
            "batches_done": self.batches_done,
            "slots": [[t.detach().to("cpu", copy=True) for t in slot] for slot in self.slots],  # no GPU spike
            "newest_slot": next(i for i, s in enumerate(self.slots) if s[0].data_ptr() == self.params[0].data_ptr()),
            "correction": None if self.correction is None else self.correction.state_dict(self.params),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["schedule"] != self.schedule:
            raise ValueError(f"Checkpoint was written with schedule {state['schedule']!r}, this run uses {self.schedule!r}.")
        self.batches_done = state["batches_done"]
        with torch.no_grad():
            for slot, saved in zip(self.slots, state["slots"]):
                for t, s in zip(slot, saved):
                    t.copy_(s)
        for p, t in zip(self.params, self.slots[state["newest_slot"]]):
            p.data = t.data
        saved = state.get("correction", state.get("error_feedback"))  # (the key of checkpoints before 0.2)
        if self.correction is not None and saved is not None:
            self.correction.load_state_dict(saved, self.params)
        self.fresh = True
