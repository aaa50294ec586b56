"""``AsyncPipelineStrategy``: PipeDream-2BW (and synchronous 1F1B/GPipe) pipelines in Lightning.

Thin glue between Lightning and :class:`~lightning_async.pipeline.runtime.PipelineRuntime`:
process groups (pipeline x data parallel), pruning the LightningModule to this rank's stage,
logging the loss computed on the last stage, global-norm clipping, flushes before validation and
checkpoints, and per-stage checkpoints. Launching, cluster environments (torchrun, SLURM) and the
process-group connection are Lightning's own, inherited from ``DDPStrategy``.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _get_sigkill_signal
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lightning_async.callbacks.divergence import DivergenceGuard
from lightning_async.optim.corrections import ErrorFeedback, build_correction
from lightning_async.pipeline import checkpoint as pipeline_checkpoint
from lightning_async.pipeline import schedules
from lightning_async.pipeline.groups import make_pipeline_groups
from lightning_async.pipeline.p2p import PeerFailure
from lightning_async.pipeline.partition import partition_units
from lightning_async.pipeline.runtime import PipelineRuntime, StageModule, build_stage

CONTRACT = ("pipeline_units", "pipeline_split_batch", "pipeline_loss")


class NotOnThisStage(nn.Module):
    """Placeholder for a pipeline unit that lives on another rank."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.unit, self.stage = name, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"Pipeline unit {self.unit!r} lives on stage {self.stage}; call it through the pipeline.")

    def extra_repr(self) -> str:
        return f"{self.unit!r} on stage {self.stage}"


class _ValidateBeforeLaunch:
    """Checks the configuration in the launching process before the other ranks start: a refused configuration
    must not leave ranks running on (each would re-run the whole script, data and model included, first)."""

    def launch(self, function, *args, trainer=None, **kwargs):
        if trainer is not None:
            trainer.strategy.validate_mesh()
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _PipelineScriptLauncher(_ValidateBeforeLaunch, _SubprocessScriptLauncher):
    """Lightning's script re-running launcher (CLI), validating first."""


class _PipelineSpawnLauncher(_ValidateBeforeLaunch, _MultiProcessingLauncher):
    """Lightning's spawn launcher hands rank 0's ``state_dict`` back to the main process; under a pipeline
    rank 0 holds only stage 0, so every stage's weights are gathered first."""

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        full = self._strategy.gather_full_state_dict()
        module.state_dict = lambda *args, **kwargs: full
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


def _add_divergence_guard(trainer) -> None:
    """A pipeline never trains on silently after a non-finite loss: without a ``DivergenceGuard`` of the user's,
    one with ``stop=True`` is added (before the checkpoint callbacks, so the diverged step is not saved)."""
    if any(isinstance(cb, DivergenceGuard) for cb in trainer.callbacks):
        return
    first_checkpoint = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks))
    trainer.callbacks.insert(first_checkpoint, DivergenceGuard(stop=True))


def check_pipeline_contract(module: nn.Module) -> None:
    missing = [name for name in CONTRACT if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(
            f"{type(module).__name__} cannot be split into pipeline stages: it lacks {', '.join(missing)}. "
            "Define pipeline_units() -> [(name, module), ...], pipeline_split_batch(batch) -> (inputs, targets) and "
            "pipeline_loss(outputs, targets) -> loss (see docs/pipeline.md)."
        )


def _checked_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """``timeout`` as a ``timedelta``; a clear error for a value that is not a positive duration."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if timeout is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0):
        raise ValueError(
            f"timeout must be a positive number of seconds (how long a stage waits for another before it gives up), "
            f"got {seconds!r}."
        )
    return None if timeout is None else timedelta(seconds=seconds)


class StageTerminated(SIGTERMException):
    """SIGTERM reached this pipeline stage; it stopped at the next batch boundary (exit status 1, with the message)."""


class AsyncPipelineStrategy(DDPStrategy):
    """One process per pipeline stage; trains with PipeDream-2BW (``schedule="2bw"``) or flushing 1F1B/GPipe.

    Args:
        schedule: ``"2bw"`` (asynchronous, one-step delay), ``"1f1b"`` or ``"gpipe"`` (synchronous).
        n_microbatches: micro-batches per batch (``>=`` stages for 2bw and 1f1b); default: 2 x stages.
        pipeline_parallel_size: stages per pipeline; default: all processes (``data_parallel_size=1``).
        data_parallel_size: pipeline replicas; gradients of each stage are averaged over replicas.
        partition: ``"uniform"``, ``"parameters"``, ``"time"`` or the unit names where stages 1.. begin.
        error_feedback: EF strength (2bw only); usually set by the ``ErrorFeedback`` callback.
        extrapolate_weight_decay: whether EF extrapolates decoupled weight decay.
        activation_checkpointing: recompute each pipeline unit's forward in the backward, so a stage keeps only
            its units' inputs for the micro-batches in flight (less memory, about one more forward of compute).
        start_method: ``"popen"`` (re-run the script: CLI, torchrun, SLURM) or ``"spawn"`` (notebooks, tests).
        timeout: seconds any wait on another rank may last (every send, receive and collective of the pipeline's
            groups) before it raises ``PeerFailure`` naming the silent stage.

    Fitting adds ``DivergenceGuard(stop=True)`` unless the trainer has a ``DivergenceGuard`` already: a non-finite
    loss stops every rank at the same step (pass ``DivergenceGuard(stop=False)`` to keep training).
    """

    strategy_name = "async_pipe"

    def __init__(
        self,
        schedule: str = "2bw",
        n_microbatches: int | None = None,
        pipeline_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        partition: str | list[str] = "uniform",
        error_feedback: float = 0.0,
        extrapolate_weight_decay: bool = True,
        activation_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | int | None = 300,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
        if schedule not in schedules.SCHEDULES:
            raise ValueError(
                f"Unknown pipeline schedule {schedule!r}. Choose one of: {', '.join(schedules.SCHEDULES)} "
                "(or strategy='async_pipe', 'sync_pipe', 'gpipe_pipe')."
            )
        timeout = _checked_timeout(timeout)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs)
        if error_feedback and schedule != "2bw":
            raise ValueError(f"error_feedback needs the delayed schedule '2bw'; schedule {schedule!r} has no delay.")
        self.schedule = schedule
        self._n_microbatches = n_microbatches
        self._pp_size, self._dp_size = pipeline_parallel_size, data_parallel_size
        self.partition = partition
        self.error_feedback = float(error_feedback)
        self.extrapolate_weight_decay = extrapolate_weight_decay
        self.correction_settings: dict | None = None  # set by a DelayCorrection callback (build_correction's kwargs)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.runtime: PipelineRuntime | None = None
        self.stage_units: list[list[str]] = []

    # ---- mesh ---------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def pipeline_parallel_size(self) -> int:
        if self._pp_size:
            return self._pp_size
        return self.world // (self._dp_size or 1)

    @property
    def data_parallel_size(self) -> int:
        return self.world // self.pipeline_parallel_size

    @property
    def n_microbatches(self) -> int:
        return self._n_microbatches or 2 * self.pipeline_parallel_size

    @property
    def stage(self) -> int:
        return self.global_rank % self.pipeline_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.pipeline_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module must be pruned to its stage before its weights are loaded

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # micro-batches are the accumulation

    def validate_mesh(self) -> None:
        """Every check that needs no communication; raised identically on every rank."""
        pp, world = self.pipeline_parallel_size, self.world
        if pp < 1 or world % pp or (self._dp_size and pp * self._dp_size != world):
            raise ValueError(
                f"Cannot arrange {world} processes as pipeline_parallel_size={self._pp_size} x "
                f"data_parallel_size={self._dp_size}. Choose sizes whose product is the number of processes "
                f"(devices x nodes = {world})."
            )
        schedules.validate(self.schedule, pp, self.n_microbatches)
        backend = self._process_group_backend
        if backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                "process_group_backend='nccl' needs CUDA tensors, but this run is on the CPU. "
                "Use accelerator='gpu', or process_group_backend='gloo' on CPUs."
            )
        if backend == "gloo" and self.root_device.type == "cuda":
            raise ValueError(
                "process_group_backend='gloo' cannot send CUDA tensors between pipeline stages. Leave "
                "process_group_backend unset (NCCL on GPUs), or use accelerator='cpu' with gloo."
            )
        module = self.lightning_module
        if module is not None:
            check_pipeline_contract(module)
            if self.partition != "time":  # time needs the model on its device; checked in setup
                partition_units(list(module.pipeline_units()), pp, self.partition)

    def setup_environment(self) -> None:
        self.validate_mesh()
        super().setup_environment()

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _PipelineSpawnLauncher(self, start_method=self._start_method)
        elif isinstance(self._launcher, _SubprocessScriptLauncher):
            self._launcher = _PipelineScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit module's state dict (newest weights) on global rank 0; other ranks get their own part.

        A collective. Gathered to rank 0 only (not to every rank): on NCCL each receiving GPU would stage the
        whole model once per rank.
        """
        if self.runtime is not None:
            self.runtime.drain()
        local = {k: v.detach().cpu() for k, v in self.lightning_module.state_dict().items()}
        if not (dist.is_initialized() and self.world > 1):
            return local
        gathered: list | None = [None] * self.world if self.global_rank == 0 else None
        dist.gather_object(local if self.data_parallel_rank == 0 else {}, gathered, dst=0)
        if gathered is None:
            return local
        return {k: v for part in gathered for k, v in part.items()}

    # ---- setup --------------------------------------------------------------------------------
    def configure_ddp(self) -> None:  # no DDP wrapper: gradients are reduced by the runtime
        pass

    def _prune(self, module: nn.Module, units: list[tuple[str, nn.Module]]) -> tuple[StageModule, list[str]]:
        """Replace other stages' units by placeholders; return this stage's module and cross-stage tied weights."""
        stage_module, tied = build_stage(units, self.stage_units, self.stage)
        stage_of = {name: s for s, names in enumerate(self.stage_units) for name in names}
        for name, _ in units:
            if stage_of[name] != self.stage:
                module.set_submodule(name, NotOnThisStage(name, stage_of[name]))
        return stage_module, tied

    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        module = self.lightning_module
        check_pipeline_contract(module)
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "accumulate_grad_batches must be 1 with a pipeline strategy: raise n_microbatches (and the batch size) instead."
            )
        self.accelerator.setup(trainer)
        self._stop_on_sigterm(trainer)
        if self.data_parallel_size == 1:
            # Every stage must read the same batches in the same order as a single-device run (so the
            # two can be compared step for step). Lightning would insert a shuffling DistributedSampler
            # into training loaders; with one replica there is nothing to shard, so keep the user's.
            trainer._accelerator_connector.use_distributed_sampler = False
        units = list(module.pipeline_units())
        split_before = getattr(module, "_lightning_async_split", None)
        if split_before is not None:
            # validate/test/fit again on a module this strategy already split: reuse that split
            if len(split_before["stage_units"]) != self.pipeline_parallel_size:
                raise ValueError(
                    f"This module was already split into {len(split_before['stage_units'])} pipeline stages; it cannot "
                    f"be re-split into {self.pipeline_parallel_size}. Build a fresh module (or load the consolidated checkpoint)."
                )
            self.stage_units, tied = split_before["stage_units"], split_before["tied"]
            local = [(n, u) for n, u in units if n in self.stage_units[self.stage]]
            stage_module = StageModule(local)
        else:
            example = getattr(module, "example_input_array", None)
            if self.partition == "time" and example is None:
                raise ValueError("partition='time' measures each unit on module.example_input_array: set it (a batch of inputs).")
            stage_units = partition_units(
                units, self.pipeline_parallel_size, self.partition, example_input=example,
                context_fn=getattr(module, "pipeline_context", None),
            )
            self.stage_units = self.broadcast(stage_units)  # measured times differ per rank: rank 0 decides
            stage_module, tied = self._prune(module, units)
            module._lightning_async_split = {"stage_units": self.stage_units, "tied": tied}
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        groups = make_pipeline_groups(self.global_rank, self.world, self.pipeline_parallel_size, timeout=self._timeout)
        rank_zero_info(
            f"async_pipe: schedule={self.schedule}, stages={self.pipeline_parallel_size}, replicas={self.data_parallel_size}, "
            f"micro-batches={self.n_microbatches}; stage units: {self.stage_units}"
        )
        if trainer.state.fn == TrainerFn.FITTING:
            _add_divergence_guard(trainer)
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError("The pipeline strategy supports exactly one optimizer per stage (use the zoo's composite optimizers).")
        self.setup_precision_plugin()
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "precision='16-mixed' needs loss scaling, which the pipeline strategy does not do yet. "
                "Use precision='bf16-mixed' (or '32-true')."
            )
        if isinstance(self.cluster_environment, SLURMEnvironment):
            # Lightning's requeue handler saves a checkpoint from inside a signal handler, at an arbitrary point
            # of a pipeline call on every rank; that cannot be drained consistently.
            self.cluster_environment.auto_requeue = False
        self._synchronize_initial_weights(groups, stage_module, tied)
        correction = self.build_correction()
        # validate/test without fit: the runtime needs an optimizer object but never steps it
        optimizer = self.optimizers[0] if self.optimizers else torch.optim.SGD(stage_module.parameters(), lr=0.0)
        clip = trainer.gradient_clip_val if trainer.state.fn == TrainerFn.FITTING else None
        if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError("The pipeline strategy clips by the global norm only: set gradient_clip_algorithm='norm'.")
        self.runtime = PipelineRuntime(
            stage_module,
            optimizer,
            self.schedule,
            self.n_microbatches,
            split_batch=module.pipeline_split_batch,
            loss_fn=module.pipeline_loss,
            groups=groups,
            gradient_clip_val=clip,
            correction=correction,
            tied_parameters=tied,
            count_tied_in_norm=self.stage == 0,
            autocast=self.precision_plugin.forward_context,
            device=self.root_device,
            context_fn=getattr(module, "pipeline_context", None),
            activation_checkpointing=self.activation_checkpointing,
        )

    def build_correction(self):
        """This stage's staleness correction: the callback's, else ``error_feedback`` of the constructor."""
        if self.correction_settings is not None:
            if self.error_feedback:
                raise ValueError("AsyncPipelineStrategy(error_feedback=...) and a DelayCorrection callback are both set; "
                                 "choose one correction.")
            return build_correction(**self.correction_settings)
        return ErrorFeedback(self.error_feedback, self.extrapolate_weight_decay) if self.error_feedback else None

    def _stop_on_sigterm(self, trainer) -> None:
        """SIGTERM to any rank stops the whole pipeline within seconds, with exit status 1.

        Lightning 2.6 broadcasts a SIGTERM flag from rank 0 before every training batch, and from its signal
        handler. Under a pipeline both hang: a world collective per step would hold the stages in lockstep (and
        deadlock against the 2BW stream, where the stages are in different batches at the same moment), and a
        handler on a rank other than 0 would wait for a broadcast rank 0 never makes. So the signalled rank
        stops by itself at its next batch boundary (after a checkpoint save in progress, which stays whole) and
        the ranks it started get the signal too; the other stages raise ``PeerFailure`` once it has gone.
        """
        self._sigterm_received = False

        def on_sigterm(signum, frame) -> None:
            if not self._sigterm_received and self._launcher is not None and getattr(self._launcher, "procs", None):
                self._launcher.kill(signum)
            self._sigterm_received = True

        def stop_if_terminated() -> None:
            if self._sigterm_received:
                raise StageTerminated(
                    f"SIGTERM: pipeline stage {self.stage} (global rank {self.global_rank}) stopped at step "
                    f"{trainer.global_step}. The other stages stop when they notice (PeerFailure, within timeout)."
                )

        trainer._signal_connector._sigterm_notifier_fn = on_sigterm  # registered after setup
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = stop_if_terminated

    def on_exception(self, exception: BaseException) -> None:
        """The launching process (rank 0 of Lightning's script launcher) ends the ranks it started: none outlives it."""
        super().on_exception(exception)
        if isinstance(self._launcher, _SubprocessScriptLauncher) and getattr(self._launcher, "procs", None):
            self._launcher.kill(_get_sigkill_signal())

    def _synchronize_initial_weights(self, groups, stage_module: StageModule, tied: list[str]) -> None:
        """Tied copies start equal to stage 0's, replicas to replica 0's (the strategy has no DDP wrapper to do it)."""
        if not (dist.is_initialized() and self.world > 1):
            return
        named = dict(stage_module.named_parameters())
        with torch.no_grad():
            if groups.tied is not None and tied:
                first = self.data_parallel_rank * self.pipeline_parallel_size
                for name in tied:
                    dist.broadcast(named[name].data, src=first, group=groups.tied)
            if groups.data_parallel is not None and self.data_parallel_size > 1:
                for p in stage_module.parameters():
                    dist.broadcast(p.data, src=self.stage, group=groups.data_parallel)

    # ---- steps --------------------------------------------------------------------------------
    def _log_loss(self, split: str, loss: torch.Tensor | None, batch) -> None:
        if loss is None:
            return
        module = self.lightning_module
        if callable(getattr(module, "log_loss", None)):
            module.log_loss(split, loss, batch)
        else:
            module.log(f"{split}/loss", loss, prog_bar=True)

    def training_step(self, *args: Any, **kwargs: Any):
        batch = args[0]
        runtime = self.runtime
        runtime.train_batch(batch)
        done = runtime.batches_done - 1
        # 2BW: the last stage finishes batch b's loss while the first stage already runs batch b+1,
        # so the loss logged at step b is batch b-1's (waiting for batch b would re-create the bubble).
        report = done - 1 if self.schedule == "2bw" else done
        loss = runtime.collect_loss(report) if report >= 0 else None
        self._log_loss("train", loss, batch)
        if runtime.last_grad_norm is not None:
            self.lightning_module.log("train/grad_norm", runtime.last_grad_norm)
        return loss if loss is not None else torch.zeros((), device=self.root_device)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # backwards ran inside the pipeline

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        result = closure()  # updates happen inside the pipeline, at each stage's batch boundary
        # The batch's update is applied later (under 2BW) with the learning rate recorded now, so the scheduler
        # may step first; record the step where torch's LRScheduler looks, or it warns that the first value
        # of the schedule is skipped (it is not).
        getattr(optimizer, "optimizer", optimizer)._opt_called = True
        return result

    def validation_step(self, *args: Any, **kwargs: Any):
        loss = self.runtime.eval_batch(args[0])
        self._log_loss("val", loss, args[0])
        return loss

    def test_step(self, *args: Any, **kwargs: Any):
        loss = self.runtime.eval_batch(args[0])
        self._log_loss("test", loss, args[0])
        return loss

    def predict_step(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("predict is not supported by the pipeline strategy; load the checkpoint into the plain module.")

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.root_device)  # the logged peak is this fit's

    def on_train_end(self) -> None:
        if self.runtime is not None:
            self.runtime.drain()
            self.log_memory()

    def log_memory(self) -> list[dict]:
        """Gather every rank's :meth:`PipelineRuntime.memory_report`; log it per stage (MiB) on rank 0."""
        report = dict(self.runtime.memory_report(), stage=self.stage, replica=self.data_parallel_rank)
        if self.root_device.type == "cuda":
            report["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(self.root_device)
        reports = [report]
        if dist.is_initialized() and self.world > 1:
            reports = [None] * self.world
            dist.all_gather_object(reports, report)
        self.memory_reports = reports
        logger = self.lightning_module.logger if self.lightning_module is not None else None
        if self.global_rank == 0:
            for r in reports:
                if r["replica"] != 0:
                    continue
                sizes = {k: v / 2**20 for k, v in r.items() if k not in ("stage", "replica", "in_flight_microbatches")}
                rank_zero_info(f"async_pipe memory, stage {r['stage']}: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in sizes.items()))
                if logger is not None:
                    logger.log_metrics({f"memory/stage{r['stage']}/{k}_mib": v for k, v in sizes.items()})
        return reports

    # ---- checkpoints ----------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.runtime is not None:
            self.runtime.drain()  # apply pending updates before the weights are read
        return self.lightning_module.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """A directory with one file per stage (``stage-NN.ckpt``) plus ``meta.json``, written atomically.

        The stages write into ``<filepath>.partial``; rank 0 writes ``meta.json`` last and renames the directory
        into place (:mod:`lightning_async.pipeline.checkpoint`). A save that fails (a rank died or stopped
        answering) removes its partial directory on every surviving rank; the previous checkpoints stay whole.
        """
        filepath = str(filepath)
        try:
            if self.global_rank == 0:
                pipeline_checkpoint.begin_save(filepath)
            self._checkpoint_barrier("prepared", filepath)
            if self.data_parallel_rank == 0:
                if self.runtime is not None:
                    checkpoint["pipeline_runtime"] = self.runtime.state_dict()
                checkpoint["pipeline"] = {
                    "stage": self.stage, "stages": self.pipeline_parallel_size, "units": self.stage_units, "schedule": self.schedule,
                }
                staged = pipeline_checkpoint.stage_file(pipeline_checkpoint.staging_dir(filepath), self.stage)
                self.checkpoint_io.save_checkpoint(checkpoint, staged)
            self._checkpoint_barrier("written", filepath)
            if self.global_rank == 0:
                meta = {
                    "stages": self.pipeline_parallel_size, "units": self.stage_units, "schedule": self.schedule,
                    "global_step": checkpoint.get("global_step"),
                }
                pipeline_checkpoint.publish(filepath, meta)
            self._checkpoint_barrier("published", filepath)
        except BaseException:
            pipeline_checkpoint.discard_save(filepath)
            raise

    def _checkpoint_barrier(self, what: str, filepath: str) -> None:
        try:
            self.barrier(f"pipeline_checkpoint_{what}")
        except Exception as err:
            raise PeerFailure(
                f"A pipeline rank stopped answering while checkpoint {filepath} was saved ({err}). The partial save is "
                "removed; earlier checkpoints are whole. Look at the other ranks' logs for the original error."
            ) from err

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict[str, Any]:
        """This stage's file of a pipeline checkpoint directory (a collective: every rank checks its file, and all
        refuse alike, before training, a checkpoint that is incomplete, damaged, mixed or split differently)."""
        path = pipeline_checkpoint.resolve(str(checkpoint_path))
        checkpoint, identity, problem = None, None, None
        try:
            meta = pipeline_checkpoint.read_meta(path)
            if meta["stages"] != self.pipeline_parallel_size:
                raise ValueError(
                    f"Checkpoint {path} has {meta['stages']} stages, this run has {self.pipeline_parallel_size}. "
                    "Resume with the same pipeline_parallel_size, or consolidate it with lightning_async.pipeline.checkpoint."
                )
            checkpoint = pipeline_checkpoint.load_stage(
                path, self.stage, lambda file: self.checkpoint_io.load_checkpoint(file, weights_only=False)
            )
            identity = pipeline_checkpoint.stage_identity(checkpoint)
        except ValueError as err:
            meta, problem = None, str(err)
        reports = [(self.stage, problem, identity)]
        if dist.is_initialized() and self.world > 1:
            reports = [None] * self.world
            dist.all_gather_object(reports, (self.stage, problem, identity))
        problems = list(dict.fromkeys(p for _, p, _ in reports if p))
        if problems:
            raise ValueError(" ".join(problems))
        by_stage = {stage: ident for stage, _, ident in reports}
        problem = pipeline_checkpoint.mismatch(path, [by_stage[s] for s in range(self.pipeline_parallel_size)], meta)
        if problem:
            raise ValueError(problem)
        self._check_resumable(path, identity)
        return checkpoint

    def _check_resumable(self, path: str, identity: dict) -> None:
        """The checkpoint's split (and, to train on, its schedule) must be this run's."""
        saved = identity["units"]
        if saved is not None and [list(u) for u in saved] != [list(u) for u in self.stage_units]:
            raise ValueError(
                f"Checkpoint {path} splits the model into stages as {saved}, this run as {self.stage_units} "
                f"(partition={self.partition!r}). Resume with the checkpoint's split: "
                f"partition={pipeline_checkpoint.split_boundaries(saved)!r} (the units where stages 1.. begin)."
            )
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting and identity["schedule"] not in (None, self.schedule):
            raise ValueError(
                f"Checkpoint {path} was written with schedule {identity['schedule']!r}, this run uses {self.schedule!r}: "
                "resume with the same schedule (evaluation may use any)."
            )

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=strict)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if self.runtime is not None and "pipeline_runtime" in checkpoint and fitting:
            self.runtime.load_state_dict(checkpoint["pipeline_runtime"])  # evaluation needs the newest weights only

    def remove_checkpoint(self, filepath) -> None:
        if self.global_rank == 0 and os.path.isdir(str(filepath)):
            shutil.rmtree(str(filepath))

    def teardown(self) -> None:
        self.runtime = None  # frees the weight slots (on the GPU) with the rest of the strategy's state
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("async_pipe", cls, description="PipeDream-2BW pipeline (asynchronous)", schedule="2bw")
        strategy_registry.register("sync_pipe", cls, description="1F1B pipeline with a flush per step", schedule="1f1b")
        strategy_registry.register("gpipe_pipe", cls, description="GPipe pipeline with a flush per step", schedule="gpipe")

