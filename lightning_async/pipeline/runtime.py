"""The pipeline runtime: executes a schedule's actions for one rank, with weight versions.

One :class:`PipelineRuntime` per process. It owns the rank's weight slots (two under ``2bw``, one
for the flushing schedules), runs each forward with its batch's version in place of the module's parameters
(:class:`~lightning_async.pipeline.weight_swap.WeightSwap`, a precomputed ``functional_call``) so each micro-batch
uses the slot of its batch's version and autograd accumulates into that slot, and applies updates with
:func:`~lightning_async.optim.delayed_step.delayed_step`, the same code as the single-device simulation.

A rank may hold several pieces of the model (*chunks*: the interleaved and V schedules). Each action names its
chunk; a chunk's input comes from the piece before it, on another rank (the transport) or on this one (a local
hand-over, ZB-V's turn of the V), and its output goes to the piece after it. The weights of all chunks form one
parameter list, one optimizer and one update per batch; a weight two chunks share (ZB-V's tied embedding and
head) is one parameter. A split backward (``I``, ``W``) defers the linear layers' weight gradients
(:mod:`~lightning_async.pipeline.weight_grad`) from ``I`` to ``W``.

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
from torch import nn

from lightning_async.optim.delayed_step import delayed_step, scheduled_values
from lightning_async.optim.corrections import GRADIENT, Correction, check_applicable
from lightning_async.pipeline import schedules
from lightning_async.pipeline.fsdp import local, set_gradient_sync
from lightning_async.pipeline.boundary import flatten, rows, signature, split_rows, unflatten
from lightning_async.pipeline.mesh import PipelineGroups
from lightning_async.pipeline.p2p import PeerFailure, StageTransport
from lightning_async.pipeline.program import APPLY_UPDATE, BEGIN_UPDATE, START_REDUCTIONS, Step, lower
from lightning_async.pipeline.sharding import OptimizerShards
from lightning_async.pipeline.schedules import FORWARD, INPUT_GRAD, WEIGHT_GRAD, ScheduleSpec
from lightning_async.pipeline.stage import PieceModule
from lightning_async.pipeline.weight_grad import DeferredWeightGrads, split_linear_backward
from lightning_async.pipeline.weight_swap import WeightSwap


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
    """Executes ``schedule`` for one rank.

    Args:
        stage_module: this rank's units: a :class:`PieceModule`, or an ``nn.ModuleList`` of them, one per chunk
            (in chunk order) for schedules with several chunks per rank (:class:`~.stage.RankStage` ``.module``).
        optimizer: optimizer over the rank's parameters (the modules' ``nn.Parameter`` objects).
        schedule: a :class:`~lightning_async.pipeline.schedules.ScheduleSpec` (or a schedule's name).
        n_microbatches: micro-batches per batch ``m``.
        split_batch: ``batch -> (inputs, targets)``; every rank gets the same batch.
        loss_fn: ``(outputs, targets) -> scalar mean loss`` (the rank holding the last piece).
        groups: ranks and process groups; defaults to a single process.
        gradient_clip_val: global-norm clipping over all stages (``None``/0: off).
        correction: a staleness correction (``2bw`` only; gradient- or update-level: Error Feedback, adaptive
            EF, the Nesterov-style look-ahead, DC-ASGD).
        tied_parameters: names (in ``stage_module``) of weights shared with another rank (tied embeddings).
        count_tied_in_norm: whether this rank counts the tied weights in the global norm.
        autocast: context manager factory for forwards (e.g. bf16 autocast).
        device: where activations live (default: the stage's parameters' device).
        context_fn: the module's ``pipeline_context(inputs)``: evaluated on this rank for every micro-batch and
            passed as ``context=`` to the units whose forward takes it (``None``: no context).
        activation_checkpointing: recompute each unit's forward in the backward instead of keeping its
            activations (only each unit's input stays in flight); the update rule is unchanged.
        shard_optimizer: ZeRO-1 over the data-parallel replicas (:mod:`~lightning_async.pipeline.sharding`): each
            replica steps and keeps the optimizer state and correction buffers of its share of the parameters
            only; the update rule is unchanged. Needs ``data_parallel_size > 1``.
    """

    def __init__(
        self,
        stage_module: PieceModule | nn.ModuleList,
        optimizer: torch.optim.Optimizer,
        schedule: "ScheduleSpec | str",
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
        shard_optimizer: bool = False,
        fsdp: bool = False,
    ) -> None:
        self.groups = groups or PipelineGroups()
        self.spec = schedules.spec(schedule)
        self.spec.validate(self.groups.num_stages, n_microbatches)
        check_applicable(correction, schedule=self.spec)
        self.chunks = list(stage_module) if isinstance(stage_module, nn.ModuleList) else [stage_module]
        if len(self.chunks) != self.spec.chunks:
            raise ValueError(
                f"Schedule {self.spec.name!r} runs {self.spec.chunks} chunk(s) per rank, but this rank was given "
                f"{len(self.chunks)}. Plan the rank with pipeline.rank.plan_rank(..., schedule) and build it with pipeline.rank.build."
            )
        self.module, self.optimizer, self.schedule = stage_module, optimizer, self.spec.name
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
        index = {id(p): i for i, p in enumerate(self.params)}
        #: per chunk: (name in the chunk, index in ``params``), every name a weight has in the chunk
        self.chunk_weights = [[(n, index[id(p)]) for n, p in c.named_parameters(remove_duplicate=False)] for c in self.chunks]
        #: per chunk: its forward with a version's weights in place of its parameters (not under FSDP, whose
        #: parameters are the sharded storage it gathers from)
        self.swaps = [WeightSwap(c, dict(w)) for c, w in zip(self.chunks, self.chunk_weights)] if not fsdp else []
        self.tied = [self.names.index(n) for n in tied_parameters]
        self.count_tied_in_norm = count_tied_in_norm
        if self.spec.split_backward:
            for chunk in self.chunks:
                split_linear_backward(chunk)
        g = self.groups
        stages = g.num_stages
        self.pieces = [self.spec.piece(g.stage, c, stages) for c in range(self.spec.chunks)]  # each chunk's piece
        self.last_piece = self.spec.virtual_stages(stages) - 1
        self.is_first, self.is_last = 0 in self.pieces, self.last_piece in self.pieces
        last_unit = self.chunks[-1].unit_names[-1] if getattr(self.chunks[-1], "unit_names", None) else None
        self.transport = StageTransport(
            g.p2p, self.device, lambda piece: g.mesh.rank_of(self.spec.holder(piece, stages)[0], g.replica), g.stage_of_rank,
            name=f"pipeline stage {g.stage}" + (f" (last unit {last_unit!r})" if last_unit else ""),
        )
        #: the chunks' weights are FSDP-sharded over the replicas (:mod:`~lightning_async.pipeline.fsdp`) and each
        #: chunk is called as a module so that FSDP gathers its weights. One version: the parameters themselves. Two
        #: (2BW): each version a sharded copy, loaded into the parameters' shards before an action of its batch
        self.fsdp = fsdp
        if fsdp:
            versions = self.spec.weight_versions
            self.slots = [list(self.params)] if versions == 1 else [[p.detach().clone() for p in self.params] for _ in range(versions)]
            self._held = self._newest = versions - 1  # the slot the parameters hold; the newest slot
        else:
            self.slots = [[p.detach().clone().requires_grad_(True) for p in self.params] for _ in range(self.spec.weight_versions)]
            for p, t in zip(self.params, self.slots[-1]):
                p.data = t.data  # the module's parameters always show the newest weights
            self._newest = len(self.slots) - 1  # the slot they show
        self.batches_done = 0  # training calls finished
        self.fresh = True  # pipeline empty: the next call starts with warmup
        self.batch_shape: tuple | None = None  # signature (structure, dtypes, shapes) of the last batch's inputs
        self._inflight: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # (chunk, mb) -> (inputs, outputs)
        self._handover: dict[tuple[str, int, int], object] = {}  # (kind, chunk, mb) -> a value between two chunks of this rank
        self._deferred: dict[tuple[int, int], DeferredWeightGrads] = {}  # (chunk, mb) -> weight gradients I left for W
        self._pending: dict[int, _PendingUpdate] = {}
        self._hyper: dict[int, list[dict]] = {}
        self._losses: list[torch.Tensor] = []
        self._batch_data: dict[int, tuple[list, list]] = {}
        self.reported_losses: dict[int, torch.Tensor] = {}  # batch -> mean loss (after the metrics reduce)
        self._loss_works: dict[int, tuple[object, torch.Tensor]] = {}
        self._grad_norms: dict[int, torch.Tensor] = {}  # batch -> its global gradient norm (before clipping)
        self.shards = self._make_shards() if shard_optimizer else None

    def _make_shards(self) -> OptimizerShards:
        g = self.groups
        if g.data_parallel_size < 2 or g.weight_gather is None:
            raise ValueError(
                "shard_optimizer=True shards the optimizer state over data-parallel replicas, but this run has "
                f"{g.data_parallel_size} replica. Add replicas (processes = stages x replicas, data_parallel_size > 1) "
                "or set shard_optimizer=False."
            )
        return OptimizerShards(self.params, g.replica, g.data_parallel_size, g.weight_gather,
                               lambda replica: g.mesh.rank_of(g.stage, replica))

    def _finish_weight_transfers(self, through: int | None = None) -> None:
        """Sharded optimizer: the other replicas' new weights from the updates of batches ``<= through`` (all:
        ``None``) are in the slots (a no-op otherwise). See :meth:`OptimizerShards.finish` for where it may wait."""
        if self.shards is not None and self.shards.in_flight:
            self.shards.finish(lambda works, what: wait_collectives(works, what, self.groups, "data_parallel"), through)

    # ---- version bookkeeping -------------------------------------------------------------------
    def _slot(self, batch: int) -> list[torch.Tensor]:
        return self.slots[batch % len(self.slots)]

    @property
    def _versioned_shards(self) -> bool:
        """FSDP under 2BW: the versions are sharded copies beside the parameters (not the parameters' own storage)."""
        return self.fsdp and len(self.slots) > 1

    def newest(self) -> list[torch.Tensor]:
        """The newest weights: the slot the parameters show (FSDP under 2BW: the newest sharded copy)."""
        return self.slots[self._newest]

    @torch.no_grad()
    def _hold(self, slot: int) -> None:
        """FSDP with two versions: load version slot ``slot`` into the parameters' shards (the ones FSDP gathers)."""
        if self._versioned_shards and slot != self._held:
            torch._foreach_copy_([local(p) for p in self.params], [local(t) for t in self.slots[slot]])
            self._held = slot

    # ---- actions --------------------------------------------------------------------------------
    def _forward(self, chunk: int, mb: int, batch: int, x, inputs, targets, training: bool):
        """Run chunk ``chunk`` on ``x`` (the received value, or the micro-batch ``inputs`` on the first piece)."""
        kwargs = {"recompute": True} if training and self.activation_checkpointing else {}
        first, last = self.pieces[chunk] == 0, self.pieces[chunk] == self.last_piece
        with self.autocast():
            if self.context_fn is not None:  # under autocast, as in the module's own forward
                kwargs["context"] = self.context_fn(inputs)
            if self.fsdp:
                self._hold(batch % len(self.slots) if training else self._newest)
                y = self.chunks[chunk](x, **kwargs)  # FSDP gathers the chunk's weights (of the version held)
            elif training:  # autograd accumulates into the batch's version
                with self.swaps[chunk].using(self._slot(batch)):
                    y = self.chunks[chunk](x, **kwargs)
            else:  # the module's parameters show the newest weights
                y = self.chunks[chunk](x, **kwargs)
            if last:
                y = self.loss_fn(y, targets)
        if training:
            grad_inputs = [] if first else [t for t in flatten(x)[0] if t.requires_grad]
            grad_outputs = [y] if last else [t for t in flatten(y)[0] if t.requires_grad]
            self._inflight[chunk, mb] = (grad_inputs, grad_outputs)
        return y

    def _backward(self, chunk: int, mb: int, batch: int, grads: list[torch.Tensor] | None, split: bool = False) -> list[torch.Tensor] | None:
        """Backward of micro-batch ``mb`` of ``batch`` on ``chunk``; the gradients of its received leaves (``None`` on
        the first piece). ``split``: the input gradient only, the linear layers' weight gradients left for
        :meth:`_weight_grad`."""
        inputs, outputs = self._inflight.pop((chunk, mb))
        if self.fsdp:  # FSDP gathers again: the forward's version; reduce-scatter once per batch, at its last backward
            self._hold(batch % len(self.slots))
            set_gradient_sync(self.chunks[chunk], mb % self.n_microbatches == self.n_microbatches - 1)
        deferred = DeferredWeightGrads()
        with deferred.collecting() if split else contextlib.nullcontext():
            if self.pieces[chunk] == self.last_piece:
                (outputs[0] / self.n_microbatches).backward()
            elif outputs:
                torch.autograd.backward(outputs, grads)
        if split:
            self._deferred[chunk, mb] = deferred
        if self.pieces[chunk] == 0:
            return None
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]

    def _weight_grad(self, chunk: int, mb: int) -> None:
        """The weight gradients the input-gradient action of ``mb`` on ``chunk`` deferred."""
        self._deferred.pop((chunk, mb)).compute()

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

    def settled_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm (before clipping, with clipping on) of the newest batch whose update has been
        applied on every rank whatever the timing: batch ``b - 1`` after call ``b`` of a flushing schedule, ``b - 2``
        under 2BW (an update lands as soon as its reductions finish, so the newest applied one varies)."""
        settled = self.batches_done - 1 - len(self.slots)
        for done in [k for k in self._grad_norms if k < settled]:
            del self._grad_norms[done]
        return self._grad_norms.get(settled)

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
        holders = self.params if self.fsdp else self._slot(batch)  # (FSDP reduce-scatters into the parameters)
        grads = [t.grad for t in holders]
        for t in holders:
            t.grad = None
        pending = _PendingUpdate(batch, grads, self._hyper.pop(batch))
        g = self.groups
        present = [x for x in grads if x is not None]
        if g.data_parallel is not None and g.data_parallel_size > 1 and not self.fsdp:  # (FSDP has averaged them)
            average_over_replicas(present, g)

        def launch() -> None:
            pending.launch = None
            if g.tied is not None and self.tied:
                pending.works += [dist.all_reduce(local(grads[i]), group=g.tied, async_op=True) for i in self.tied if grads[i] is not None]
                if self.is_first:  # the last stage posted long ago; the first stage's norm needs the sum
                    wait_collectives(pending.works, "the tied-weight gradient sum", g, "tied")
            if self.clip:
                skip = set() if self.count_tied_in_norm else set(self.tied)
                sq = sum((local(x).float().pow(2).sum() for i, x in enumerate(grads) if x is not None and i not in skip), torch.zeros((), device=self.device))
                if self.fsdp:  # each replica holds a shard of every gradient: sum the stage's shards first
                    wait_collectives([dist.all_reduce(sq, group=g.data_parallel, async_op=True)], "the gradient norm", g, "data_parallel")
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

    def _apply_ready_updates(self) -> None:
        """Apply pending updates whose reductions have finished (frees their gradient buffers early)."""
        for batch in list(self._pending):
            if self._pending[batch].launch is not None or not all(work.is_completed() for work in self._pending[batch].works):
                return  # updates are applied in batch order
            self._apply_update(batch)

    def _apply_update(self, batch: int) -> None:
        pending = self._pending.pop(batch)  # (sharded: reads and writes only this replica's parameters, all local)
        if pending.launch is not None:
            pending.launch()
        wait_collectives(pending.works, f"the gradient reductions of batch {batch}", self.groups, "pipeline")
        if self.clip and pending.norm_sq is not None:
            norm = pending.norm_sq.sqrt()
            self._grad_norms[batch] = norm  # global norm before clipping, for logging
            coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0)
            for x in pending.grads:
                if x is not None:
                    local(x).mul_(coef.to(x.dtype))
        out = self._slot(batch + len(self.slots))  # 2BW: V(b+2) replaces V(b); sync: in place
        versioned = self._versioned_shards
        if versioned and self.correction is not None and self.correction.level == GRADIENT:
            self._hold(batch % len(self.slots))  # the gradient's own weights V(b), which such a correction reads
        delayed_step(
            self.optimizer,
            self.params,
            pending.grads,
            newest=self.newest(),
            out=self.params if versioned else out,
            correction=self.correction,
            hyperparameters=pending.hyperparameters,
            updated=None if self.shards is None else self.shards.owned,
        )
        if versioned:
            with torch.no_grad():
                torch._foreach_copy_([local(t) for t in out], [local(p) for p in self.params])
            self._held = batch % len(self.slots)
        self._newest = batch % len(self.slots)  # (the slot ``out``; the parameters show it now)
        if self.shards is not None:
            self.shards.start(batch, out)  # waited for at the start of the call that reads the slot

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

    def _run(self, program: Sequence[Step], training: bool = True) -> None:
        try:
            self._run_program(program, training)
        except BaseException:
            self.transport.abandon()  # a later drain must report nothing about this call's receive
            raise

    def _run_program(self, program: Sequence[Step], training: bool) -> None:
        """Dispatch each step of the rank's lowered program (:mod:`~lightning_async.pipeline.program`) on its kind."""
        t = self.transport
        for step in program:
            kind = step.kind
            if step.poll:
                self._apply_ready_updates()
            if kind == APPLY_UPDATE:
                if step.batch in self._pending:
                    self._apply_update(step.batch)
                if step.barrier:
                    self._finish_weight_transfers(through=step.batch)
                continue
            if kind == START_REDUCTIONS:
                pending = self._pending.get(step.batch)
                if pending is not None and pending.launch is not None:
                    pending.launch()
                continue
            if kind in (BEGIN_UPDATE, WEIGHT_GRAD):
                if step.prepost is not None:
                    t.prepost(*step.prepost)
                if kind == BEGIN_UPDATE:
                    self._begin_update(step.batch)
                else:
                    self._weight_grad(step.chunk, step.microbatch)
                continue
            c, mb = step.chunk, step.microbatch
            i = mb % self.n_microbatches
            inputs, targets = self._batch_data[step.batch]
            if kind == FORWARD:
                x = inputs[i] if step.source is None else self._input(step, "act")
                preposted = step.prepost is not None and t.prepost(*step.prepost)
                y = self._forward(c, mb, step.batch, x, inputs[i], targets[i], training)
                if step.target is None:
                    self._record_loss(step.batch, y)
                    continue
                self._output(y, step, None if preposted else step.next_receive)
            else:  # BACKWARD, INPUT_GRAD
                grad = None if step.source is None else self._input(step, "grad")
                preposted = step.prepost is not None and t.prepost(*step.prepost)
                dx = self._backward(c, mb, step.batch, grad, split=kind == INPUT_GRAD)
                if step.target is None:
                    continue
                self._output(dx, step, None if preposted else step.next_receive)

    def _input(self, step: Step, kind: str):
        """``step``'s input: received from another rank, or handed over by a chunk of this rank."""
        if step.remote_input:
            return self.transport.receive(kind, step.piece)
        return self._handover.pop((kind, step.piece, step.microbatch))

    def _output(self, value, step: Step, receive: tuple[str, int] | None) -> None:
        """Hand ``value`` to the neighbouring piece: send it (together with the next step's receive ``receive`` when
        that is not pre-posted: the fused send/receive pairs NCCL needs), or keep it for a chunk of this rank (as a
        fresh leaf, like a received one)."""
        kind, piece = step.target
        if step.remote_output:
            self.transport.exchange((value, kind, step.piece), receive)
            return
        if kind == "act":
            leaves, structure = flatten(value)
            value = unflatten([x.detach().requires_grad_(x.requires_grad) for x in leaves], structure)
        self._handover[kind, piece, step.microbatch] = value  # (the next step's receive is posted when it asks for it)

    def _program(self, actions: Sequence[schedules.Action], **updates) -> tuple[Step, ...]:
        return lower(self.spec, self.groups.stage, self.groups.num_stages, actions, **updates)

    @property
    def chunk_order(self) -> list[int]:
        """This rank's chunks in model order (the order a forward-only pass runs them)."""
        return sorted(range(len(self.chunks)), key=lambda c: self.pieces[c])

    def forward_program(self, pairs: Sequence[tuple[int, int]]) -> tuple[Step, ...]:
        """The forward-only program (evaluation, predict) of ``(chunk, micro-batch)`` pairs, in that order."""
        return self._program([schedules.Action(FORWARD, i, -1, c) for c, i in pairs])

    def run_forward(self, step: Step, x, target):
        """One forward-only step at the newest weights on ``x`` (the micro-batch; received or handed over unless
        the step runs the first piece): the last piece's output, else ``None`` once the output is passed on."""
        value = x if step.source is None else self._input(step, "act")
        y = self._forward(step.chunk, step.microbatch, -1, value, x, target, training=False)
        if step.target is None:
            return y
        self._output(y, step, None)  # (no pre-posting: a plain forward chain)
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
        self._hyper[b] = scheduled_values(self.optimizer)  # the update of batch b uses batch b's lr, momentum...
        actions = self.spec.call_actions(self.groups.stage, self.groups.num_stages, self.n_microbatches, b, self.fresh)
        reads = b - len(self.slots)  # V(b) is written by 2BW's update b-2, a flush's update b-1
        held = tuple(k for k, pending in sorted(self._pending.items()) if pending.launch is not None)
        self._run(self._program(actions, start=held, apply_first=(reads,) if reads >= 0 else ()))
        if self.fsdp:
            self._hold(self._newest)  # between calls the module shows the newest weights, as without FSDP
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
        actions = self.spec.drain_actions(self.groups.stage, self.groups.num_stages, self.n_microbatches, last)
        held = tuple(k for k, pending in sorted(self._pending.items()) if pending.launch is not None)
        self._run(self._program(actions, start=held, apply_last=tuple(sorted({*self._pending, last}))))
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
        runs: list[list[tuple[int, object, object]]] = []  # micro-batches of one shape, in order
        for i, (x, target) in enumerate((x, y) for x, y in pieces if rows(x)):
            if not runs or signature(x) != signature(runs[-1][0][1]):
                runs.append([])
            runs[-1].append((i, x, target))
        total, count = torch.zeros((), device=self.device), 0
        with torch.no_grad():
            for run in runs:  # every rank holds the batch, so all agree where a new shape (and header) comes
                self.transport.reset()
                items = {i: (x, target) for i, x, target in run}
                for step in self.forward_program([(c, i) for c in self.chunk_order for i in items]):
                    y = self.run_forward(step, *items[step.microbatch])
                    if y is not None:
                        total += y.float() * rows(items[step.microbatch][1])
                        count += rows(items[step.microbatch][1])
        self.transport.reset()
        # (sum of row losses, rows) over every replica's last stage: the mean over all rows evaluated, exact even
        # when the replicas' batches differ in size
        stats = torch.stack([total, torch.tensor(float(count), device=self.device)]) if self.is_last else torch.zeros(2, device=self.device)
        if self.groups.metrics is not None:
            wait_collectives([dist.all_reduce(stats, group=self.groups.metrics, async_op=True)], "the evaluation loss", self.groups, "metrics")
        return stats[0] / stats[1]

    # ---- accounting -------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, int]:
        """Bytes this stage holds: one weight version, all versions, optimizer state, the correction's buffers."""

        def nbytes(tensors) -> int:  # (this rank's shard of an FSDP weight)
            return sum(local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

        state = [v for per_param in self.optimizer.state.values() for v in per_param.values()]
        ef = self.correction.buffers() if self.correction is not None else []
        return {
            "parameters": nbytes(self.params),
            # every copy of the weights: the slots (FSDP under 2BW: and the parameters' shards FSDP gathers from)
            "weight_versions": sum(nbytes(slot) for slot in self.slots) + (nbytes(self.params) if self._versioned_shards else 0),
            "optimizer_state": nbytes(state),
            "correction": nbytes(ef),
            "in_flight_microbatches": len(self._inflight),
        }

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Both weight versions, counters and the correction's buffers (call after :meth:`drain`)."""
        if not self.fresh:
            raise RuntimeError("PipelineRuntime.state_dict() needs an empty pipeline: call drain() first.")
        if self.fsdp:  # sharded DTensors, for torch.distributed.checkpoint (the only format that takes them)
            slots, newest = [[t.detach().clone() for t in slot] for slot in self.slots], self._newest
        else:
            slots = [[t.detach().to("cpu", copy=True) for t in slot] for slot in self.slots]  # no GPU spike
            newest = next(i for i, s in enumerate(self.slots) if s[0].data_ptr() == self.params[0].data_ptr())
        return {
            "schedule": self.schedule,
            "batches_done": self.batches_done,
            "slots": slots,
            "newest_slot": newest,
            "correction": None if self.correction is None else self.correction.state_dict(self.params),
        }

    def optimizer_share(self, optimizer_state: dict) -> dict:
        """``optimizer_state`` (an ``optimizer.state_dict()``, possibly merged from every replica's share) reduced to
        the parameters this replica updates under the sharded optimizer (unchanged without sharding)."""
        if self.shards is None:
            return optimizer_state
        owned = {id(p) for p, mine in zip(self.params, self.shards.owned) if mine}
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {i: v for i, v in optimizer_state["state"].items() if id(order[int(i)]) in owned}
        return {**optimizer_state, "state": state}

    def load_state_dict(self, state: dict) -> None:
        if state["schedule"] != self.schedule:
            raise ValueError(f"Checkpoint was written with schedule {state['schedule']!r}, this run uses {self.schedule!r}.")
        self.batches_done = state["batches_done"]
        with torch.no_grad():
            for slot, saved in zip(self.slots, state["slots"]):
                for t, s in zip(slot, saved):
                    t.copy_(s)
        if self.fsdp:
            self._newest, self._held = state["newest_slot"], None
            self._hold(self._newest)
        else:
            self._newest = state["newest_slot"]
            for p, t in zip(self.params, self.slots[self._newest]):
                p.data = t.data
        saved = state.get("correction", state.get("error_feedback"))  # (the key of checkpoints before 0.2)
        if self.shards is not None and saved is not None:  # keep this replica's share of the buffers
            saved = {k: [b if mine else None for b, mine in zip(v, self.shards.owned)] if isinstance(v, list) else v
                     for k, v in saved.items()}
        if self.correction is not None and saved is not None:
            self.correction.load_state_dict(saved, self.params)
        self.fresh = True
