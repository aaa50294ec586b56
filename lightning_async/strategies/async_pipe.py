"""``AsyncPipelineStrategy``: pipelines in Lightning under every schedule, PipeDream-2BW's and the synchronous ones.

``Trainer(strategy="async_pipe")`` builds one (2BW); its ``schedule`` argument, or the names ``"sync_pipe"``,
``"gpipe_pipe"`` and ``"zb_pipe"``, run the synchronous baselines on the same runtime. ``PipelineStrategy`` is
another name for the same class.

Thin glue between Lightning and :class:`~lightning_async.pipeline.runtime.PipelineRuntime`: it cuts the
LightningModule down to this rank's stage (:mod:`~lightning_async.pipeline.stage`), makes the mesh's process
groups, hands training, evaluation and logging of the loss to the runtime, and saves per-stage checkpoints
(:mod:`~lightning_async.strategies.checkpoints`). Launching, cluster environments (torchrun, SLURM) and the
process-group connection are Lightning's own, inherited from ``DDPStrategy``; the few private Lightning
internals it touches are in :mod:`~lightning_async.compat`.
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_async.callbacks.delay import check_corrections, pipeline_correction_setting
from lightning_async.callbacks.divergence import ensure_divergence_guard
from lightning_async.optim.corrections import Correction, as_correction
from lightning_async.pipeline import schedules
from lightning_async.pipeline.contract import check_pipeline_contract
from lightning_async.pipeline.fsdp import whole
from lightning_async.pipeline.groups import release_process_groups
from lightning_async.pipeline.mesh import PipelineMesh
from lightning_async.pipeline.metrics import LossExtras
from lightning_async.pipeline.predict import predict_batch
from lightning_async.pipeline.rank import RankPlan, build
from lightning_async.pipeline.config import PipelineConfig
from lightning_async.pipeline.runtime import PipelineRuntime
from lightning_async import compat
from lightning_async.strategies.checkpoints import PipelineCheckpoints
from lightning_async.strategies.memory_log import gather_memory_reports, log_memory_reports
from lightning_async.strategies.metric_logging import add_metrics_logger, log_values
from lightning_async.strategies import refusals
from lightning_async.strategies.sigterm import SigtermStop
from lightning_async.strategies.step_hooks import LightningStepHooks
from lightning_async.strategies.summary import log_parameter_counts
from lightning_async.strategies.split import decide_stage_units, record_split, recorded_split


def _setting(name: str, doc: str | None = None) -> property:
    """A read-only attribute of the strategy that is its config's setting ``name``."""
    return property(lambda self: getattr(self.config, name), doc=doc or f"The config's ``{name}``.")


class AsyncPipelineStrategy(DDPStrategy):
    """One process per pipeline stage; trains with PipeDream-2BW (``schedule="2bw"``) or a synchronous schedule.

    Args:
        schedule: an asynchronous one: ``"2bw"`` (one-step delay; ``"2bw-split"`` with the backward split),
            ``"pipedream"`` (PipeDream with weight stashing: stage ``s`` ``p - 1 - s`` steps stale,
            ``strategy="pipedream_pipe"``), ``"paci"`` (no stash: a batch's first forwards read the previous
            version, ``strategy="paci_pipe"``) or ``"wpipe"`` (two chunks per stage, each its own update: the
            first half of the model one step stale, the second current, ``strategy="wpipe_pipe"``); or a synchronous one: ``"1f1b"``, ``"gpipe"``, ``"zbh1"``
            (zero-bubble H1), ``"interleaved"`` (interleaved 1F1B over ``virtual_stages`` chunks per stage) or
            ``"zbv"`` (zero-bubble V: two chunks per stage; the best synchronous baseline, ``strategy="zb_pipe"``).
            See ``docs/schedules.md``.
        virtual_stages: chunks per stage for ``schedule="interleaved"`` (default 2).
        n_microbatches: micro-batches per batch (``>=`` stages for 2bw, 1f1b, zbh1 and interleaved, a multiple of
            the stages for interleaved and wpipe, ``>=`` stages - 1 for paci, any for pipedream, gpipe and zbv); default:
            2 x stages.
        pipeline_parallel_size: stages per pipeline; default: all processes (``data_parallel_size=1``).
        data_parallel_size: pipeline replicas; gradients of each stage are averaged over replicas.
        partition: ``"uniform"``, ``"parameters"``, ``"time"`` or the unit names where stages 1.. begin.
        correction: a staleness correction for the delayed schedules (``2bw``, ``2bw-split``, ``pipedream``, ``wpipe``
            (its first half); not
            ``paci``, which takes every gradient at the current weights): a method name
            (``"ef"``), ``build_correction``'s arguments (``{"method": "ef", "strength": 0.5}``) or a ``Correction``.
            The ``ErrorFeedback`` / ``DelayCorrection`` callbacks set the same thing (the CLI's ``correction:``
            section); give it one way.
        activation_checkpointing: recompute each pipeline unit's forward in the backward, so a stage keeps only
            its units' inputs for the micro-batches in flight (less memory, about one more forward of compute).
        shard_optimizer: ZeRO-1 over the data-parallel replicas (Megatron's distributed optimizer): each replica of
            a stage keeps and steps the optimizer state (and the correction's buffers) of its share of the
            stage's parameters, whole parameters balanced by size, and sends the new weights to the others; the
            update rule is unchanged (``docs/pipeline.md``, "Many replicas"). Needs ``data_parallel_size > 1``.
        fsdp: FSDP2 inside each stage (torchtitan's composition): every unit's weights, gradients and optimizer
            state sharded over the stage's replicas, gathered per forward and backward. The schedules with one
            backward action (``gpipe``, ``1f1b``, ``interleaved``, ``2bw``: both versions sharded), element-wise
            optimizers, checkpoints through ``checkpoint_format="dcp"`` only; needs ``data_parallel_size > 1`` (``docs/pipeline.md``, "Many replicas: FSDP2 inside a stage").
        checkpoint_format: ``"stages"`` (default: a file per stage, the same layout to resume) or ``"dcp"``
            (``torch.distributed.checkpoint``, keyed by global names, written by every rank in parallel: resumes on
            another stage count, split, replica count, sharded or not). Both are atomic directories; either loads.
        start_method: ``"popen"`` (re-run the script: CLI, torchrun, SLURM) or ``"spawn"`` (notebooks, tests).
        timeout: seconds any wait on another rank may last (every send, receive and collective of the pipeline's
            groups) before it raises ``PeerFailure`` naming the silent stage.
        transport: ``"auto"`` (the backend's rules) or ``"nccl-rules"``: NCCL's matching rules on gloo (tag 0, batched
            groups, no pre-posted receives), to find on CPUs what would hang or mismatch on GPUs (``docs/pipeline.md``).

    Fitting adds ``DivergenceGuard(stop=True)`` unless the trainer has a ``DivergenceGuard`` already: a non-finite
    loss stops every rank at the same step (pass ``DivergenceGuard(stop=False)`` to keep training).
    """

    strategy_name = "async_pipe"

    def __init__(
        self,
        schedule: str = "2bw",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        pipeline_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        partition: str | list[str] = "uniform",
        correction: str | dict | Correction | None = None,
        activation_checkpointing: bool = False,
        shard_optimizer: bool = False,
        fsdp: bool = False,
        checkpoint_format: str = "stages",
        process_group_backend: str | None = None,
        timeout: timedelta | int | None = 300,
        start_method: str = "popen",
        transport: str = "auto",
        **kwargs: Any,
    ) -> None:
        if "error_feedback" in kwargs:
            raise ValueError("AsyncPipelineStrategy(error_feedback=S) was removed in 0.2.0: pass "
                             "correction={'method': 'ef', 'strength': S} (CHANGELOG.md, 'Migrating from 0.1').")
        #: every pipeline setting, validated once (:class:`~lightning_async.pipeline.config.PipelineConfig`)
        self.config = PipelineConfig.of(
            schedule, virtual_stages, timeout=timeout, n_microbatches=n_microbatches,
            pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size, partition=partition,
            correction=correction, activation_checkpointing=activation_checkpointing, shard_optimizer=shard_optimizer,
            fsdp=fsdp, checkpoint_format=checkpoint_format, transport=transport,
        )
        super().__init__(process_group_backend=process_group_backend, timeout=self.config.timeout,
                         start_method=start_method, **kwargs)
        self.runtime: PipelineRuntime | None = None
        #: the batch whose backward or update the Lightning hook now running belongs to (``None`` outside them;
        #: under 2BW it may be the step before the current one: :mod:`~lightning_async.strategies.step_hooks`)
        self.hook_batch: int | None = None
        self.loss_extras: LossExtras | None = None
        self.stage_units: list[list[str]] = []
        self.checkpoints = PipelineCheckpoints(self)
        self.sigterm = SigtermStop(self.describe_rank)  # (a bound method: the strategy is pickled under spawn)

    # ---- settings (read from the config) ---------------------------------------------------------
    @property
    def schedule_spec(self) -> schedules.ScheduleSpec:
        return self.config.schedule

    @property
    def schedule(self) -> str:
        return self.config.schedule.name

    correction = _setting("correction", "The ``correction=`` setting (a name, a dict or a Correction; built per rank by "
                                        ":meth:`make_correction`).")
    partition = _setting("partition")
    activation_checkpointing = _setting("activation_checkpointing")
    shard_optimizer = _setting("shard_optimizer")
    fsdp = _setting("fsdp")
    checkpoint_format = _setting("checkpoint_format")
    transport = _setting("transport")

    # ---- mesh ---------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def mesh(self) -> PipelineMesh:
        """The pipeline x data-parallel mesh of this run's processes (a clear error if the sizes do not fit)."""
        return self.config.mesh(self.world)

    @property
    def pipeline_parallel_size(self) -> int:
        return self.mesh.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.data_parallel_size

    @property
    def n_microbatches(self) -> int:
        return self.config.microbatches(self.pipeline_parallel_size)

    @property
    def stage(self) -> int:
        return self.mesh.stage_of(self.global_rank)

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.replica_of(self.global_rank)

    def describe_rank(self) -> str:
        """This rank in messages: ``pipeline stage S (global rank R)``."""
        return f"pipeline stage {self.stage} (global rank {self.global_rank})"

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module must be pruned to its stage before its weights are loaded

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True  # micro-batches are the accumulation

    def validate_mesh(self) -> None:
        """Every check of the run's settings that needs no communication (:func:`~lightning_async.pipeline.run_checks.check_run`);
        raised identically on every rank."""
        self.config.check(self.world, backend=self._process_group_backend, device_type=self.root_device.type,
                          module=self.lightning_module)

    def validate_launch(self, trainer) -> None:
        """What the launching process does before other ranks start: check the mesh and the run's corrections,
        finish checkpoint saves a crash interrupted."""
        self.validate_mesh()
        refusals.warn_bypassed_steps(self.lightning_module)
        self._optimizers_counted = refusals.refuse_before_launch(trainer, self.lightning_module)
        check_corrections(trainer)
        self._refuse_checkpoints_under_fsdp(trainer)
        self.checkpoints.recover_before_launch(trainer)

    @override
    def setup_environment(self) -> None:
        self.validate_mesh()
        super().setup_environment()
        # Lightning leaves the groups open after ``fit`` (a ``test`` may follow): they are destroyed and freed at exit
        atexit.unregister(release_process_groups)  # once per process, however many trainers
        atexit.register(release_process_groups)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = compat.pipeline_launcher(self._launcher, self)

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit module's state dict (newest weights) on global rank 0; other ranks get their own part.

        A collective. Gathered to rank 0 only (not to every rank): on NCCL each receiving GPU would stage the
        whole model once per rank.
        """
        if self.runtime is not None:
            self.runtime.drain()
        local = {k: whole(v).cpu() for k, v in self.lightning_module.state_dict().items()}
        if not (dist.is_initialized() and self.world > 1):
            return local
        gathered: list | None = [None] * self.world if self.global_rank == 0 else None
        dist.gather_object(local if self.data_parallel_rank == 0 else {}, gathered, dst=0)
        if gathered is None:
            return local
        return {k: v for part in gathered for k, v in part.items()}

    # ---- setup --------------------------------------------------------------------------------
    @override
    def configure_ddp(self) -> None:  # no DDP wrapper: gradients are reduced by the runtime
        pass

    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        module = self.lightning_module
        check_pipeline_contract(module)
        if trainer.state.fn == TrainerFn.FITTING and not getattr(self, "_optimizers_counted", False):
            refusals.refuse_optimizers(module, refusals.count_optimizers(module))  # it needed the trainer: now, unpruned
        self.accelerator.setup(trainer)
        add_metrics_logger(trainer, self)
        self.sigterm.install(trainer, self._launcher)
        self.checkpoints.recover_at_setup(trainer)
        self._refuse_checkpoints_under_fsdp(trainer)
        if self.data_parallel_size == 1:  # every stage reads the batches a single-device run would, in its order
            compat.keep_training_sampler(trainer)
        units = list(module.pipeline_units())
        before = recorded_split(module)
        pieces = self.schedule_spec.virtual_stages(self.pipeline_parallel_size)
        self.stage_units = decide_stage_units(module, units, pieces, self.partition, self.broadcast)
        rank_zero_info(
            f"pipeline: schedule={self.schedule}, mode={'async' if self.schedule_spec.delayed else 'sync'}, "
            f"stages={self.pipeline_parallel_size}, replicas={self.data_parallel_size}, "
            f"micro-batches={self.n_microbatches}, chunks per stage={self.schedule_spec.chunks}; units: {self.stage_units}"
        )
        log_parameter_counts(self, module, units)
        self.loss_extras = LossExtras(module.pipeline_loss)
        plan = self.config.plan_rank(units, self.global_rank, self.world, stage_units=self.stage_units,
                                     tied=None if before is None else before.tied)
        optimizer = self._prepare_rank(trainer, module, units, plan, first_setup=before is None)
        built = build(plan, optimizer, module.pipeline_split_batch, self.loss_extras, **self._runtime_options(trainer, module))
        self.runtime = built.runtime
        self.loss_extras.attach(self.runtime)

    def _refuse_checkpoints_under_fsdp(self, trainer) -> None:
        if self.fsdp and self.checkpoint_format != "dcp" and (trainer.checkpoint_callbacks or trainer.ckpt_path):
            raise ValueError(
                "fsdp=True writes and reads checkpoints through torch.distributed.checkpoint only (the sharded weights "
                "stay sharded): pass checkpoint_format='dcp', or enable_checkpointing=False."
            )

    def _prepare_rank(self, trainer, module, units, plan: RankPlan, first_setup: bool):
        """Lightning's part before the rank is built: prune the module to the plan, move it, set up the optimizer."""
        if first_setup:
            plan.prune(module, units)
            record_split(module, plan.stage_units, plan.tied)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            ensure_divergence_guard(trainer)
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError("The pipeline strategy supports exactly one optimizer per stage (use the zoo's composite optimizers).")
        self.setup_precision_plugin()
        self._check_precision_and_cluster()
        # validate/test without fit: the runtime needs an optimizer object but never steps it
        return self.optimizers[0] if self.optimizers else torch.optim.SGD(plan.rank_stage.module.parameters(), lr=0.0)

    def _check_precision_and_cluster(self) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "precision='16-mixed' needs loss scaling, which the pipeline strategy does not do yet. "
                "Use precision='bf16-mixed' (or '32-true')."
            )
        if isinstance(self.cluster_environment, SLURMEnvironment):
            # Lightning's requeue handler saves a checkpoint from inside a signal handler, at an arbitrary point
            # of a pipeline call on every rank; that cannot be drained consistently.
            self.cluster_environment.auto_requeue = False

    def _runtime_options(self, trainer, module) -> dict:
        fitting = trainer.state.fn == TrainerFn.FITTING
        return dict(
            gradient_clip_val=trainer.gradient_clip_val if fitting else None, correction=self.make_correction(trainer),
            autocast=self.precision_plugin.forward_context, device=self.root_device,
            context_fn=getattr(module, "pipeline_context", None), hooks=LightningStepHooks(self) if fitting else None,
            **self.config.runtime_options(training=fitting),
        )

    def make_correction(self, trainer=None) -> Correction | None:
        """A fresh correction object for this rank's runtime (its buffers are per stage): the ``correction=`` given
        here, or an active correction callback's of ``trainer``."""
        setting = self.correction if trainer is None else pipeline_correction_setting(trainer, self.correction)
        return as_correction(setting)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The launching process (rank 0 of Lightning's script launcher) ends the ranks it started: none outlives it."""
        super().on_exception(exception)
        compat.kill_started(self._launcher)

    # ---- steps --------------------------------------------------------------------------------
    def _log_loss(self, split: str, loss: torch.Tensor | None, batch) -> None:
        if loss is None:
            return
        module = self.lightning_module
        if callable(getattr(module, "log_loss", None)):
            module.log_loss(split, loss, batch)
        else:
            module.log(f"{split}/loss", loss, prog_bar=True)

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        batch = args[0]
        runtime = self.runtime
        runtime.train_batch(batch)
        self.loss_extras.end_training_call(runtime.batches_done - 1)
        report = runtime.reported_loss_batch()  # (2BW: the batch before this step's; see UpdateClock.reported_loss)
        loss = runtime.collect_loss(report) if report is not None else None
        self._log_loss("train", loss, batch)
        if report is not None:
            log_values(self.lightning_module, "train", self.loss_extras.training_values(report))
        grad_norm = runtime.settled_grad_norm()
        if grad_norm is not None:
            self.lightning_module.log("train/grad_norm", grad_norm)
        return loss if loss is not None else torch.zeros((), device=self.root_device)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # backwards ran inside the pipeline

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        compat.skip_closure_zero_grad(closure)  # (the runtime calls on_before_zero_grad before each stage's update)
        result = closure()  # updates happen inside the pipeline, at each stage's batch boundary
        compat.mark_optimizer_stepped(optimizer)  # (the update is applied later, with the lr recorded now)
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any):
        self.sigterm.stop_if_received_in_evaluation(self.lightning_module.trainer, args[1] if len(args) > 1 else None)
        loss = self.runtime.eval_batch(args[0])
        self._log_loss("val", loss, args[0])
        log_values(self.lightning_module, "val", *self.loss_extras.end_eval_batch("val"))
        return loss

    @override
    def test_step(self, *args: Any, **kwargs: Any):
        self.sigterm.stop_if_received_in_evaluation(self.lightning_module.trainer, args[1] if len(args) > 1 else None)
        loss = self.runtime.eval_batch(args[0])
        self._log_loss("test", loss, args[0])
        log_values(self.lightning_module, "test", *self.loss_extras.end_eval_batch("test"))
        return loss

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.sigterm.stop_if_received_in_evaluation(self.lightning_module.trainer)

    @override
    def on_test_end(self) -> None:
        super().on_test_end()
        self.sigterm.stop_if_received_in_evaluation(self.lightning_module.trainer)

    @override
    def predict_step(self, *args: Any, **kwargs: Any):
        """The batch's predictions on the first stage of each pipeline (:func:`~lightning_async.pipeline.predict.predict_batch`)."""
        return predict_batch(self.runtime, args[0], getattr(self.lightning_module, "pipeline_predict", None))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.root_device)  # the logged peak is this fit's

    @override
    def on_train_end(self) -> None:
        if self.runtime is not None:
            self.runtime.drain()
            self.log_memory()
        self.sigterm.stop_if_received(f"after the final drain (step {self.lightning_module.trainer.global_step})")

    def log_memory(self) -> list[dict]:
        """Gather every rank's :meth:`PipelineRuntime.memory_report`; log it per stage (MiB) on rank 0."""
        self.memory_reports = gather_memory_reports(self)
        if self.global_rank == 0:
            module = self.lightning_module
            log_memory_reports(self.memory_reports, module.logger if module is not None else None)
        return self.memory_reports

    # ---- checkpoints ----------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.runtime is not None:
            self.runtime.drain()  # apply pending updates before the weights are read
        return self.lightning_module.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """A directory with one file per stage plus ``meta.json``, written atomically (:class:`PipelineCheckpoints`)."""
        self.checkpoints.save(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """This stage's file of a pipeline checkpoint directory, after every rank checked its own."""
        return self.checkpoints.load(checkpoint_path)

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if self.runtime is not None and "pipeline_runtime" in checkpoint and fitting:
            self.runtime.load_state_dict(checkpoint["pipeline_runtime"])  # evaluation needs the newest weights only

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        """As Lightning does, keeping only this replica's share under the sharded optimizer (a checkpoint holds every
        replica's share, or the whole state from an unsharded run)."""
        if self.runtime is not None and "optimizer_states" in checkpoint:
            checkpoint = {**checkpoint, "optimizer_states": [self.runtime.optimizer_share(s) for s in checkpoint["optimizer_states"]]}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def remove_checkpoint(self, filepath) -> None:
        self.checkpoints.remove(filepath)

    @override
    def teardown(self) -> None:
        # Frees the weight slots (on the GPU) and every reference to the pipeline's process groups: the trainer
        # outlives ``fit`` (the CLI's instantiator holds it until exit), and a group it still references is freed,
        # gloo's threads with it, only during interpreter finalization (a rare abort at exit).
        self.runtime = self.loss_extras = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, (schedule, description) in schedules.STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=description, schedule=schedule)


#: another name of the same class (it runs every schedule, the synchronous baselines included)
PipelineStrategy = AsyncPipelineStrategy
