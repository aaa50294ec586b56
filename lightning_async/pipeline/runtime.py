"""The pipeline runtime: dispatches a rank's lowered program, one step at a time.

One :class:`PipelineRuntime` per process. Each call's actions (:mod:`~lightning_async.pipeline.schedules`) are
lowered to the rank's program (:mod:`~lightning_async.pipeline.program`) and dispatched here on the step's kind:
a forward runs its chunk with the version its batch reads in place of the module's parameters
(:class:`~lightning_async.pipeline.weight_swap.WeightSwap`), so autograd accumulates each micro-batch's weight
gradients into that version; a backward, split or whole, sends the input gradient on; the update steps go to the
update pipeline. What runs where is decided elsewhere, each in one module:

* the update clock (:mod:`~lightning_async.pipeline.clock`): which version a batch reads, which one an update
  writes, when it must have landed, which loss and gradient norm a step reports;
* the weight versions (:mod:`~lightning_async.pipeline.versions`): the slots the clock names, FSDP's variant;
* the update pipeline (:mod:`~lightning_async.pipeline.updates`): gradients taken, averaged, reduced, clipped, and
  the step of :func:`~lightning_async.optim.delayed_step.delayed_step` (the one-device simulation's code);
* the loss reduction (:mod:`~lightning_async.pipeline.losses`) and evaluation
  (:mod:`~lightning_async.pipeline.evaluation`);
* the transport (:mod:`~lightning_async.pipeline.p2p`).

A rank may hold several pieces of the model (*chunks*: the interleaved and V schedules). Each action names its
chunk; a chunk's input comes from the piece before it, on another rank (the transport) or on this one (a local
hand-over, ZB-V's turn of the V), and its output goes to the piece after it. The weights of all chunks form one
parameter list, one optimizer and one update per batch; a weight two chunks share (ZB-V's tied embedding and
head) is one parameter. A split backward (``I``, ``W``) defers the linear layers' weight gradients
(:mod:`~lightning_async.pipeline.weight_grad`) from ``I`` to ``W``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_async.optim.corrections import Correction, check_applicable
from lightning_async.pipeline import schedules
from lightning_async.pipeline.boundary import flatten, rows, signature, split_rows, unflatten
from lightning_async.pipeline.compute import ChunkCompute
from lightning_async.pipeline.evaluation import evaluate_batch
from lightning_async.pipeline.hooks import StepHooks
from lightning_async.pipeline.losses import LossReduction
from lightning_async.pipeline.mesh import PipelineGroups
from lightning_async.pipeline.p2p import StageTransport
from lightning_async.pipeline.program import APPLY_UPDATE, BEGIN_UPDATE, START_REDUCTIONS, CallPrograms, Step, lower
from lightning_async.pipeline.sharding import OptimizerShards
from lightning_async.pipeline.schedules import FORWARD, INPUT_GRAD, UPDATE, WEIGHT_GRAD, ScheduleSpec
from lightning_async.pipeline.stage import PieceModule
from lightning_async.pipeline.updates import UpdatePipeline
from lightning_async.pipeline.versions import WeightVersions, tensor_bytes



@dataclass
class UpdateGroup:
    """Chunks of a rank that update together (all of them, or one each under ``wpipe``): their parameters (a slice of
    the rank's), weight versions and update pipeline."""

    chunks: tuple[int, ...]
    params: list[torch.Tensor]
    versions: WeightVersions
    updates: UpdatePipeline
    shards: OptimizerShards | None = None  # the sharded optimizer's share of ``params`` and their transfers


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
        correction: a staleness correction (delayed schedules; gradient- or update-level: Error Feedback, adaptive
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
        fsdp: the chunks' weights are FSDP-sharded over the replicas (:mod:`~lightning_async.pipeline.fsdp`); each
            chunk is called as a module so that FSDP gathers its weights.
        hooks: :class:`~lightning_async.pipeline.hooks.StepHooks` run around the rank's backwards and updates (the
            strategy's run Lightning's ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``
            and ``on_before_zero_grad``).
        transport: the transport's mode (:class:`~lightning_async.pipeline.p2p.StageTransport`): ``"auto"`` or
            ``"nccl-rules"`` (NCCL's matching rules on gloo).
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
        hooks: StepHooks | None = None,
        transport: str = "auto",
    ) -> None:
        self.groups = g = groups or PipelineGroups()
        self.spec = schedules.spec(schedule)
        self.spec.validate(g.num_stages, n_microbatches)
        check_applicable(correction, schedule=self.spec)
        self.chunks = list(stage_module) if isinstance(stage_module, nn.ModuleList) else [stage_module]
        if len(self.chunks) != self.spec.chunks:
            raise ValueError(
                f"Schedule {self.spec.name!r} runs {self.spec.chunks} chunk(s) per rank, but this rank was given "
                f"{len(self.chunks)}. Plan the rank with pipeline.rank.plan_rank(..., schedule) and build it with pipeline.rank.build."
            )
        self.module, self.optimizer, self.schedule = stage_module, optimizer, self.spec.name
        self.n_microbatches = n_microbatches
        self.split_batch = split_batch
        self.correction = correction
        self.device = device or next(stage_module.parameters()).device
        self.fsdp = fsdp
        self.hooks = hooks or StepHooks()
        named = dict(stage_module.named_parameters())
        self.names = list(named)
        self.params = [named[n] for n in self.names]
        stages = g.num_stages
        self.clock = self.spec.clock(stages)
        self.pieces = [self.spec.piece(g.stage, c, stages) for c in range(self.spec.chunks)]  # each chunk's piece
        self.last_piece = self.spec.virtual_stages(stages) - 1
        self.is_first, self.is_last = 0 in self.pieces, self.last_piece in self.pieces
        last_unit = self.chunks[-1].unit_names[-1] if getattr(self.chunks[-1], "unit_names", None) else None
        self.transport = StageTransport(
            g.p2p, self.device, lambda piece: g.mesh.rank_of(self.spec.holder(piece, stages)[0], g.replica), g.stage_of_rank,
            name=f"pipeline stage {g.stage}" + (f" (last unit {last_unit!r})" if last_unit else ""), transport=transport,
        )
        self.update_groups = self._make_update_groups(g, fsdp, shard_optimizer, gradient_clip_val, correction,
                                                      tied_parameters, count_tied_in_norm)
        self._group_of_chunk = {c: k for k, group in enumerate(self.update_groups) for c in group.chunks}
        self.compute = ChunkCompute(
            self.chunks, [self.update_groups[self._group_of_chunk[c]].versions for c in range(len(self.chunks))],
            self.pieces, self.last_piece, n_microbatches, loss_fn, autocast,
            context_fn, activation_checkpointing, self.spec.split_backward, fsdp, self.hooks, self.device,
            stale_forwards=self.clock.stale_forwards(g.stage),
        )
        self.losses = LossReduction(g, self.device, n_microbatches)
        self._programs = CallPrograms(self.spec, g.stage, stages, n_microbatches)  # each call shape lowered once
        self.batches_done = 0  # training calls finished
        self.fresh = True  # pipeline empty: the next call starts with warmup
        self.started = 0  # the batch whose call last began with an empty pipeline (a warm-up may span calls)
        self.batch_shape: tuple | None = None  # signature (structure, dtypes, shapes) of the last batch's inputs
        self._handover: dict[tuple[str, int, int], object] = {}  # (kind, chunk, mb) -> a value between two chunks of this rank
        self._batch_data: dict[int, tuple[list, list]] = {}

    def _make_update_groups(self, g: PipelineGroups, fsdp: bool, shard_optimizer: bool, clip, correction,
                            tied_parameters: Sequence[str], count_tied_in_norm: bool) -> list["UpdateGroup"]:
        """The rank's update groups (the clock's ``update_groups``): each with its parameters (a slice of
        ``self.params``: the chunks' parameters come in chunk order), weight versions and update pipeline."""
        clock_groups = self.clock.update_groups(g.stage)
        if len(clock_groups) > 1 and fsdp:  # (refused before any group by fsdp.check_fsdp_applicable)
            raise ValueError(f"fsdp=True: schedule {self.spec.name!r} updates each chunk of a rank on its own.")
        defers = self.clock.defers_reductions(g.stage)
        out, named, delays = [], dict(self.module.named_parameters()), {}
        for chunks, clock in clock_groups:
            ids = {id(p) for c in chunks for p in self.chunks[c].parameters()}
            names = [n for n in self.names if id(named[n]) in ids]
            params = [named[n] for n in names]
            delays.update({p: clock.delay for p in params})
            versions = WeightVersions(params, clock, fsdp)
            shards = self._make_shards(params) if shard_optimizer else None  # (a group's own share and transfers)
            tied = [names.index(n) for n in tied_parameters if n in names]
            updates = UpdatePipeline(
                self.optimizer, versions, g, self.device, clip, correction, tied, count_tied_in_norm,
                wait_tied_sum=self.is_first, defer_reductions=defers, shards=shards, hooks=self.hooks,
            )
            out.append(UpdateGroup(tuple(chunks), params, versions, updates, shards))
        if correction is not None:  # (a k-step correction needs each parameter's delay; 2BW's is the default 1)
            correction.set_delays(delays)
        if [p for group in out for p in group.params] != self.params:
            raise AssertionError("the update groups must cover the rank's parameters in order, each once")
        return out

    @property
    def owned(self) -> list[bool] | None:
        """Under the sharded optimizer: per parameter (in ``params``' order), whether this replica updates it and keeps
        its optimizer state and correction buffers (``None``: not sharded)."""
        if self.update_groups[0].shards is None:
            return None
        return [mine for group in self.update_groups for mine in group.shards.owned]

    def _make_shards(self, params: Sequence[torch.Tensor]) -> OptimizerShards:
        g = self.groups
        if g.data_parallel_size < 2 or g.weight_gather is None:
            raise ValueError(
                "shard_optimizer=True shards the optimizer state over data-parallel replicas, but this run has "
                f"{g.data_parallel_size} replica. Add replicas (processes = stages x replicas, data_parallel_size > 1) "
                "or set shard_optimizer=False."
            )
        return OptimizerShards(params, g.replica, g.data_parallel_size, g.weight_gather,
                               lambda replica: g.mesh.rank_of(g.stage, replica))

    @property
    def versions(self) -> WeightVersions:
        """The rank's weight versions (a rank that updates its chunks together; else each group's ``versions``)."""
        return self._single_group().versions

    @property
    def updates(self) -> UpdatePipeline:
        """The rank's update pipeline (a rank that updates its chunks together; else each group's ``updates``)."""
        return self._single_group().updates

    def _single_group(self) -> "UpdateGroup":
        if len(self.update_groups) != 1:
            raise AttributeError(f"schedule {self.schedule!r} updates each chunk on its own: use runtime.update_groups")
        return self.update_groups[0]

    @property
    def slots(self) -> list[list[torch.Tensor]]:
        """The weight versions' slots (see :class:`~lightning_async.pipeline.versions.WeightVersions`; several update
        groups: each group's slots in turn, each over that group's parameters)."""
        return [slot for group in self.update_groups for slot in group.versions.slots]

    def newest(self) -> list[torch.Tensor]:
        """The newest weights (in the order of ``params``)."""
        return [t for group in self.update_groups for t in group.versions.newest()]

    @property
    def loss_fn(self) -> Callable:
        """``(outputs, targets) -> loss`` on the last piece (predict swaps it for the outputs themselves)."""
        return self.compute.loss_fn

    @loss_fn.setter
    def loss_fn(self, fn: Callable) -> None:
        self.compute.loss_fn = fn

    def _begin_update(self, batch: int, group: int) -> None:
        """The last backward of ``batch`` on update group ``group`` is done: Lightning's ``on_after_backward``, then
        the update begins."""
        versions, updates = self.update_groups[group].versions, self.update_groups[group].updates
        if self.hooks.active:
            self.compute.backwards_begun.discard(batch)
            with self.hooks.gradients_shown(versions.params, [t.grad for t in versions.gradient_holders(batch)]):
                self.hooks.after_backward(batch)
        updates.begin(batch)

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

    def _run(self, program: Sequence[Step], training: bool = True, base: int = 0) -> None:
        try:
            self._run_program(program, training, base)
        except BaseException:
            self.transport.abandon()  # a later drain must report nothing about this call's receive
            raise

    def _run_program(self, program: Sequence[Step], training: bool, base: int = 0) -> None:
        """Dispatch each step of the rank's lowered program (:mod:`~lightning_async.pipeline.program`) on its kind.
        ``base``: the batch the program's batch and micro-batch numbers are relative to (a cached call program,
        :class:`~lightning_async.pipeline.program.CallPrograms`; 0 for an absolute one)."""
        t, compute, n = self.transport, self.compute, self.n_microbatches
        pipelines = [group.updates for group in self.update_groups]
        batch_data, mb0 = self._batch_data, base * n
        for step in program:
            kind = step.kind
            batch = step.batch + base
            if step.poll:
                for updates in pipelines:
                    if updates.pending:
                        updates.apply_ready()
            if kind == FORWARD:
                mb = step.microbatch + mb0
                i = mb % n
                inputs, targets = batch_data[batch]
                x = inputs[i] if step.source is None else self._input(step, "act", mb)
                preposted = step.prepost is not None and t.prepost(*step.prepost)
                y = compute.forward(step.chunk, mb, batch, x, inputs[i], targets[i], training)
                if step.target is None:
                    self.losses.record(batch, y)
                    continue
                self._output(y, step, None if preposted else step.next_receive, mb)
            elif kind == APPLY_UPDATE:
                pipelines[step.chunk].apply_if_pending(batch)
                if step.barrier:
                    pipelines[step.chunk].finish_weight_transfers(through=batch)
            elif kind == START_REDUCTIONS:
                pipelines[step.chunk].start_reductions(batch)
            elif kind == BEGIN_UPDATE or kind == WEIGHT_GRAD:
                if step.prepost is not None:
                    t.prepost(*step.prepost)
                if kind == BEGIN_UPDATE:
                    self._begin_update(batch, step.chunk)
                else:
                    compute.weight_grad(step.chunk, step.microbatch + mb0)
            else:  # BACKWARD, INPUT_GRAD
                mb = step.microbatch + mb0
                grad = None if step.source is None else self._input(step, "grad", mb)
                if step.settle is not None:  # (the rank that begins updates last: see program.lower)
                    pipelines[step.settle[1]].apply_if_pending(step.settle[0] + base)
                preposted = step.prepost is not None and t.prepost(*step.prepost)
                dx = compute.backward(step.chunk, mb, batch, grad, split=kind == INPUT_GRAD)
                if step.target is None:
                    continue
                self._output(dx, step, None if preposted else step.next_receive, mb)

    def _input(self, step: Step, kind: str, mb: int):
        """``step``'s input (of micro-batch ``mb``): received from another rank, or handed over by a chunk of this
        rank."""
        if step.remote_input:
            return self.transport.receive(kind, step.piece)
        return self._handover.pop((kind, step.piece, mb))

    def _output(self, value, step: Step, receive: tuple[str, int] | None, mb: int) -> None:
        """Hand ``value`` (of micro-batch ``mb``) to the neighbouring piece: send it (together with the next step's
        receive ``receive`` when that is not pre-posted: the fused send/receive pairs NCCL needs), or keep it for a
        chunk of this rank (as a fresh leaf, like a received one)."""
        kind, piece = step.target
        if step.remote_output:
            self.transport.exchange((value, kind, step.piece), receive, step.send_order)
            return
        if kind == "act":
            leaves, structure = flatten(value)
            value = unflatten([x.detach().requires_grad_(x.requires_grad) for x in leaves], structure)
        self._handover[kind, piece, mb] = value  # (the next step's receive is posted when it asks for it)

    def _program(self, actions: Sequence[schedules.Action], **updates) -> tuple[Step, ...]:
        return lower(self.spec, self.groups.stage, self.groups.num_stages, actions, **updates)

    @property
    def chunk_order(self) -> list[int]:
        """This rank's chunks in model order (the order a forward-only pass runs them)."""
        return self.compute.chunk_order

    def forward_program(self, pairs: Sequence[tuple[int, int]]) -> tuple[Step, ...]:
        """The forward-only program (evaluation, predict) of ``(chunk, micro-batch)`` pairs, in that order."""
        return self._program([schedules.Action(FORWARD, i, -1, c) for c, i in pairs])

    def run_forward(self, step: Step, x, target):
        """One forward-only step at the newest weights on ``x`` (the micro-batch; received or handed over unless
        the step runs the first piece): the last piece's output, else ``None`` once the output is passed on."""
        value = x if step.source is None else self._input(step, "act", step.microbatch)
        y = self.compute.forward(step.chunk, step.microbatch, -1, value, x, target, training=False)
        if step.target is None:
            return y
        self._output(y, step, None, step.microbatch)  # (no pre-posting: a plain forward chain)
        return None

    def train_batch(self, batch_data) -> None:
        """Run the call for the next training batch (a delayed schedule: without flushing the pipeline)."""
        b = self.batches_done
        inputs, targets = self.split_batch(batch_data)
        shape = signature(inputs)
        if not self.fresh and shape != self.batch_shape:
            self.drain()  # a new shape needs a fresh pipeline (and a new header exchange)
        self.batch_shape = shape
        if self.fresh:
            self.transport.reset()
            self.started = b
        self.transport.begin_call()  # frees the sends of two calls ago (gloo never frees them by itself)
        self._batch_data[b] = self._microbatches(inputs, targets)
        groups = self.update_groups
        for group in groups:
            group.updates.record_hyperparameters(b)
        actions = self.spec.checked_call_actions(self.groups.stage, self.groups.num_stages, self.n_microbatches, b, self.started)
        due = tuple((d, k) for k, group in enumerate(groups) if (d := group.versions.clock.due_before(b)) is not None)
        program = self._programs.get(actions, b, start=self._held_back(), apply_first=due)
        self._run(program, base=b)
        if self.fsdp:
            self.versions.hold_newest()  # between calls the module shows the newest weights, as without FSDP
        if not self.is_last:
            self.losses.reduce(b, None)  # join the last stage's loss reduction for this batch
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
        actions = self.spec.drain_actions(self.groups.stage, self.groups.num_stages, self.n_microbatches, last, self.started)
        pending = tuple(
            (b, k) for k, group in enumerate(self.update_groups)
            for b in sorted({*group.updates.pending, last, *(a.batch for a in actions if a.kind == UPDATE and a.chunk == k)})
        )
        self._run(self._program(actions, start=self._held_back(), apply_last=pending))
        self._batch_data.clear()
        self.transport.flush()
        self.fresh = True

    def _held_back(self) -> tuple[tuple[int, int], ...]:
        """``(batch, group)`` of the updates whose cross-stage reductions have not started yet."""
        return tuple((b, k) for k, group in enumerate(self.update_groups) for b in group.updates.held_back())

    def eval_batch(self, batch_data) -> torch.Tensor:
        """:func:`~lightning_async.pipeline.evaluation.evaluate_batch`: the mean loss at the newest weights, on every rank."""
        return evaluate_batch(self, batch_data)

    # ---- reporting --------------------------------------------------------------------------------
    def collect_loss(self, batch: int, wait: bool = True) -> torch.Tensor | None:
        """Mean training loss of ``batch`` on every rank (``None`` if not reduced yet and ``wait=False``)."""
        return self.losses.collect(batch, wait)

    def reported_loss_batch(self) -> int | None:
        """The batch whose loss the step just run reports (the clock's loss lag)."""
        return self.clock.reported_loss(self.batches_done - 1)

    def settled_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm (before clipping, with clipping on) of the newest update landed on every rank."""
        return self.update_groups[0].updates.settled_grad_norm(self.batches_done)  # (clipping: one group)

    def memory_report(self) -> dict[str, int]:
        """Bytes this stage holds: one weight version, all versions, optimizer state, the correction's buffers."""
        state = [v for per_param in self.optimizer.state.values() for v in per_param.values()]
        ef = self.correction.buffers() if self.correction is not None else []
        return {
            "parameters": tensor_bytes(self.params),
            "weight_versions": sum(group.versions.nbytes() for group in self.update_groups),
            "optimizer_state": tensor_bytes(state),
            "correction": tensor_bytes(ef),
            "in_flight_microbatches": len(self.compute.inflight),
        }

    # ---- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every weight version, counters and the correction's buffers (call after :meth:`drain`)."""
        if not self.fresh:
            raise RuntimeError("PipelineRuntime.state_dict() needs an empty pipeline: call drain() first.")
        return {
            "schedule": self.schedule,
            "batches_done": self.batches_done,
            **self._versions_state(),
            "correction": None if self.correction is None else self.correction.state_dict(self.params),
        }

    def version_layout(self) -> list[tuple[int, int]]:
        """Per update group, ``(its parameters, its weight versions)``; the groups' parameters are consecutive runs
        of ``params``."""
        return [(len(group.params), group.versions.clock.versions) for group in self.update_groups]

    def _versions_state(self) -> dict:
        """The weight versions' state: ``slots`` and ``newest_slot`` (one update group), or one such dict per group
        under ``update_groups``."""
        if len(self.update_groups) == 1:
            return self.versions.state_dict()
        return {"update_groups": [group.versions.state_dict() for group in self.update_groups]}

    def optimizer_share(self, optimizer_state: dict) -> dict:
        """``optimizer_state`` (an ``optimizer.state_dict()``, possibly merged from every replica's share) reduced to
        the parameters this replica updates under the sharded optimizer (unchanged without sharding)."""
        if self.owned is None:
            return optimizer_state
        owned = {id(p) for p, mine in zip(self.params, self.owned) if mine}
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {i: v for i, v in optimizer_state["state"].items() if id(order[int(i)]) in owned}
        return {**optimizer_state, "state": state}

    def load_state_dict(self, state: dict) -> None:
        if state["schedule"] != self.schedule:
            raise ValueError(f"Checkpoint was written with schedule {state['schedule']!r}, this run uses {self.schedule!r}.")
        self.batches_done = state["batches_done"]
        if len(self.update_groups) == 1:
            self.versions.load_state_dict(state)
        else:
            for group, saved in zip(self.update_groups, state["update_groups"]):
                group.versions.load_state_dict(saved)
        saved = state.get("correction", state.get("error_feedback"))  # (the key of checkpoints before 0.2)
        owned = self.owned
        if owned is not None and saved is not None:  # keep this replica's share of the buffers
            saved = {k: [b if mine else None for b, mine in zip(v, owned)] if isinstance(v, list) else v
                     for k, v in saved.items()}
        if self.correction is not None and saved is not None:
            self.correction.load_state_dict(saved, self.params)
        self.fresh = True
