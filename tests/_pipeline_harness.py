"""Helpers for multi-process pipeline tests: gloo workers and the single-device 2BW oracle."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_async.models import SmolLM2, model_config
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import DelayedOptimizer, build_correction, build_optimizer
from lightning_async.pipeline import profiles
from lightning_async.pipeline.boundary import split_rows
from lightning_async.pipeline.paci import PaciRule
from lightning_async.pipeline.fsdp import whole
from lightning_async.pipeline.local import join_default_group, run_local
from lightning_async.pipeline.rank import build, plan_rank
from workload import KWARGS, LRS, lr_lambda
from workload import SHAPE as SINGLE_DEVICE_SHAPE

SHAPE = {**SINGLE_DEVICE_SHAPE, "num_layers": 4}  # four blocks: up to six units to split into stages


def make_model(seed: int = 0) -> SmolLM2:
    torch.manual_seed(seed)
    return SmolLM2(model_config("tiny", **SHAPE))


SHRUNK_BATCH = 5  # batch index that is half as large (a shape change mid-run)


def make_batches(n: int, batch_size: int = 8, seq_len: int = 16, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, SHAPE["vocab_size"], (batch_size, seq_len + 1), generator=g) for _ in range(n)]
    if n > SHRUNK_BATCH:
        batches[SHRUNK_BATCH] = batches[SHRUNK_BATCH][: batch_size // 2]
    return batches


EVAL_BATCH_ROWS = 7  # not divisible by the micro-batch counts used


def eval_batch() -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (EVAL_BATCH_ROWS, 17), generator=torch.Generator().manual_seed(9))


@dataclass(frozen=True)
class Workload:
    """A model and its data for the oracle: ``make_model()`` (seeded, same weights every call) defines
    ``pipeline_units()`` whose names are its attribute paths; ``split_batch``/``loss`` as in the contract."""

    make_model: Callable
    make_batches: Callable[[int], list]
    eval_batch: Callable
    split_batch: Callable = split_next_token
    loss: Callable = next_token_loss


SMOLLM2 = Workload(make_model, make_batches, eval_batch)


def make_deep_model(seed: int = 0, tie_embeddings: bool = True) -> SmolLM2:
    """Six blocks: eight units, enough for two chunks per rank on four ranks (interleaved, ZB-V, WPipe untied)."""
    torch.manual_seed(seed)
    return SmolLM2(model_config("tiny", **{**SHAPE, "num_layers": 6}, tie_embeddings=tie_embeddings))


DEEP = Workload(make_deep_model, make_batches, eval_batch)


def make_untied_model(seed: int = 0) -> SmolLM2:
    """The harness's model with its own output projection (schedules with per-stage delays refuse tied weights)."""
    torch.manual_seed(seed)
    return SmolLM2(model_config("tiny", **SHAPE, tie_embeddings=False))


UNTIED = Workload(make_untied_model, make_batches, eval_batch)


def schedule_hyperparameters(optimizer, step: int) -> None:
    """Alternate momentum (or beta1) and weight decay every batch (as OneCycleLR's momentum cycling or a decay
    schedule would, only harder): each delayed update must use its own batch's values, not the current ones."""
    even = step % 2 == 0
    for group in optimizer.param_groups:
        if "momentum" in group:
            group["momentum"] = 0.95 if even else 0.8
        if "betas" in group:
            group["betas"] = (0.9 if even else 0.6, *group["betas"][1:])
        if group.get("weight_decay"):
            group["weight_decay"] = 0.1 if even else 0.4


def correction_of(setting):
    """A correction from a scenario's setting: an EF strength (0: none) or ``build_correction`` keyword arguments."""
    if isinstance(setting, dict):
        return build_correction(**setting)
    return build_correction("ef", setting) if setting else None


def reference_run(
    optimizer: str, delay: int, ef, steps: int, clip: float | None, microbatches: int = 1, workload: Workload = SMOLLM2,
    autocast: Callable = contextlib.nullcontext, optimizer_kwargs: dict | None = None, profile: str | None = None,
    stages: int | None = None, refills: tuple[int, ...] = (), replicas: int = 1,
) -> dict[str, torch.Tensor]:
    """Single-device run with DelayedOptimizer(pairing='2bw'); returns the newest weights by name.

    ``profile`` (with ``stages``): per-unit delays of a delay profile (``"pipedream"``) instead of ``delay`` for all;
    ``"paci"``: PACI's rule (``PaciRule``, ``microbatches`` per batch) instead of a delayed optimizer, its previous
    version forgotten before the batches in ``refills`` (where the pipeline runs empty: after a drain), over
    ``replicas`` data-parallel replicas (``microbatches`` is then all of theirs).

    ``ef``: the correction (:func:`correction_of`). ``autocast``: the forwards and losses run under it (as the
    pipeline's ``autocast`` option runs them); ``optimizer_kwargs`` go to ``build_optimizer`` (e.g. ``fused=True``).

    With ``microbatches`` the gradient is summed over chunks in the pipeline's order, so optimizers
    that amplify rounding (SOAP's eigenbases) can be compared exactly too.
    """
    w = workload
    model = w.make_model()
    named = [(f"model.{n}", p) for n, p in model.named_parameters()]
    opt = build_optimizer(optimizer, named, lr=LRS[optimizer], weight_decay=0.1,
                          **{**KWARGS.get(optimizer, {}), **(optimizer_kwargs or {})})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    by_parameter, rule = None, None
    units = [(f"model.{n}", u) for n, u in model.pipeline_units()] if profile is not None else []
    if profile == "paci":
        rule, contract = PaciRule(units, stages, microbatches, replicas=replicas), _Contract(w, model)
    elif profile is not None:
        by_parameter = profiles.parameter_delays(units, profiles.unit_delays(units, profile, stages, delay))
    wrapped = DelayedOptimizer(opt, delay=delay, pairing="2bw", correction=correction_of(ef) if delay or profile else None,
                               parameter_delays=by_parameter)
    schedule_hyperparameters(opt, 0)
    for step, batch in enumerate(w.make_batches(steps)):
        if rule is not None:
            if step in refills:
                rule.forget()
            with autocast():
                loss, _ = rule.batch_loss(contract, batch)
            loss.backward()
        else:
            for chunk in split_rows(batch, microbatches):
                inputs, targets = w.split_batch(chunk)
                with autocast():
                    loss = w.loss(model(inputs), targets)
                (loss / microbatches).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        wrapped.step()
        wrapped.zero_grad()
        sched.step()
        schedule_hyperparameters(opt, step + 1)
    newest = {id(p): w for p, w in zip(wrapped.params, wrapped.newest_weights())}
    weights = {f"model.{n}": newest[id(p)].clone() for n, p in model.named_parameters(remove_duplicate=False)}
    for p in model.parameters():
        p.data = newest[id(p)]
    with torch.no_grad():
        inputs, targets = w.split_batch(w.eval_batch())
        weights["eval_loss"] = w.loss(model(inputs), targets)
    return weights


class _Contract:
    """A workload's model with the pipeline contract (what ``PaciRule.batch_loss`` reads)."""

    def __init__(self, workload: Workload, model) -> None:
        self.pipeline_split_batch, self.pipeline_loss = workload.split_batch, workload.loss
        self.pipeline_context = getattr(model, "pipeline_context", None)


def sgd(named_parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for _, p in named_parameters], lr=0.1)


def rank_runtime(units, schedule: str, m: int, split_batch: Callable, loss: Callable, make_optimizer: Callable = sgd,
                 rank: int = 0, world_size: int = 1, stage_units=None, **options):
    """A rank's runtime built the one way the strategy builds it (``plan_rank``, then ``build``); one process by
    default. ``make_optimizer(named_parameters)`` gets the rank's parameters by global name."""
    plan = plan_rank(list(units), schedule, m, rank=rank, world_size=world_size, stage_units=stage_units)
    return build(plan, make_optimizer(plan.named_parameters), split_batch, loss, **options).runtime


def pipeline_run(
    stages: int, schedule: str, optimizer: str, ef: float, steps: int, clip: float | None, m: int, drain_at=(), prepost=None,
    workload: Workload = SMOLLM2, activation_checkpointing: bool = False, shard_optimizer: bool = False,
    fsdp: bool = False, transport: str = "auto", autocast: Callable = contextlib.nullcontext,
    optimizer_kwargs: dict | None = None,
):
    """Run inside a process of an initialised gloo group; returns this stage's weights by name, the losses,
    the number of receives the transport pre-posted (``prepost``: see ``StageTransport``), of the boundary
    headers it sent, the runtime's memory report at the end (``shard_optimizer``: ZeRO-1 over the replicas; ``fsdp``: FSDP2 inside each stage, the weights returned whole),
    and the number of groups the transport posted through ``batch_isend_irecv`` (``transport="nccl-rules"``: NCCL's
    path on gloo, the only one that batches there). ``autocast`` and ``optimizer_kwargs``: as in :func:`reference_run`.

    After the batches in ``drain_at`` the pipeline is evaluated under ``torch.inference_mode`` (as Lightning
    does on NCCL), which drains it; the update rule must not notice. The final evaluation uses a batch whose
    size the micro-batch count does not divide.
    """
    rank = dist.get_rank()
    w = workload
    model = w.make_model()
    units = [(f"model.{n}", u) for n, u in model.pipeline_units()]
    plan = plan_rank(units, schedule, m, rank=rank, world_size=dist.get_world_size(), pipeline_parallel_size=stages)
    opt = build_optimizer(optimizer, plan.named_parameters, lr=LRS[optimizer], weight_decay=0.1,
                          **{**KWARGS.get(optimizer, {}), **(optimizer_kwargs or {})})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    schedule_hyperparameters(opt, 0)
    built = build(
        plan, opt, w.split_batch, w.loss, gradient_clip_val=clip, correction=correction_of(ef),
        autocast=autocast, context_fn=getattr(model, "pipeline_context", None),
        activation_checkpointing=activation_checkpointing, shard_optimizer=shard_optimizer, fsdp=fsdp,
        transport=transport,
    )
    stage, runtime = plan.rank_stage, built.runtime
    mesh = built.groups.mesh
    if prepost is not None:
        runtime.transport.prepost_enabled = prepost
    replicas, replica = mesh.data_parallel_size, mesh.replica_of(rank)
    losses = []
    for b, batch in enumerate(w.make_batches(steps)):
        batch = split_rows(batch, replicas)[replica]  # data parallel: each replica its shard
        runtime.train_batch(batch)
        sched.step()
        schedule_hyperparameters(opt, b + 1)
        if b in drain_at:
            with torch.inference_mode():
                runtime.eval_batch(batch)
        lag = runtime.clock.loss_lag
        losses.append(runtime.collect_loss(b - lag) if b >= lag else None)
    runtime.drain()
    losses.append(runtime.collect_loss(steps - 1) if runtime.clock.loss_lag else None)
    by_param = {id(p): n for n, p in stage.named_parameters}
    weights = {by_param[id(p)]: whole(p) for p in runtime.params}
    weights["eval_loss"] = runtime.eval_batch(w.eval_batch())
    losses = [None if x is None else float(x) for x in losses]
    t = runtime.transport
    return weights, losses, t.preposted, t.headers_sent, runtime.memory_report(), t.groups_batched


def spawn(world: int, fn, *args, timeout: float = 240.0, reporting: int | None = None) -> list:
    """``run_local`` on gloo: ``fn(*args)`` on ``world`` processes, results by rank."""
    return run_local(world, fn, *args, timeout=timeout, reporting=reporting)


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def in_world(size: int, fn, *args):
    """Inside a ``spawn`` worker (after ``SPAWN_RANK`` is set): run ``fn`` as torchrun would on ranks ``0..size-1``
    (a fresh default group; every worker calls this in the same order, so scenarios of several sizes share one
    spawn); None elsewhere."""
    rank = int(os.environ["SPAWN_RANK"])
    if not join_default_group(300, world=size):
        return None
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    try:
        return fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key in TORCHRUN_VARIABLES:
            os.environ.pop(key, None)


def each_in_its_world(fn, runs, world_of) -> list:
    """Inside a ``spawn`` worker: ``fn(run)`` for each of ``runs`` on ranks ``0..world_of(run)-1`` (:func:`in_world`;
    ``None`` on the other ranks), so runs of several sizes share one spawn."""
    os.environ["SPAWN_RANK"] = str(dist.get_rank())  # (what in_world reads)
    return [in_world(world_of(run), fn, run) for run in runs]


def merged_weights(results: list, index: int, stages: int, replica: int = 0) -> dict[str, torch.Tensor]:
    """Run ``index`` of an :func:`each_in_its_world` spawn (``results`` by rank): the weights of the stages of
    ``replica`` (ranks ``replica * stages ..``), in one dict."""
    merged: dict[str, torch.Tensor] = {}
    for rank in range(replica * stages, (replica + 1) * stages):
        merged.update(results[rank][index][0])
    return merged


def worst_difference(weights: dict, reference: dict) -> float:
    """The largest absolute difference between two weight dicts (over ``weights``' names)."""
    return max((weights[n] - reference[n]).abs().max().item() for n in weights)


def assert_same_bits(results: list, ours: int, theirs: int, ranks: int) -> None:
    """Runs ``ours`` and ``theirs`` of a spawn (NCCL's matching rules and gloo's tags) trained to the same bits and
    reported the same losses on ranks ``0 .. ranks - 1``."""
    for rank in range(ranks):
        a, b = results[rank][ours], results[rank][theirs]
        assert all(torch.equal(a[0][n], b[0][n]) for n in a[0]) and a[1] == b[1], f"rank {rank}"


def as_torchrun(timeout: float = 300.0, **env: str) -> int:
    """Inside a ``spawn`` worker: a fresh default group (``timeout``: the strategy's, as Lightning would give it)
    and the environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``; ``env`` adds or
    overrides), so a Trainer started next runs as under torchrun, on that group. Returns the rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    join_default_group(timeout)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), **env})
    return rank
