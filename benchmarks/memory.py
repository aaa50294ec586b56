"""Memory per pipeline rank for every schedule (and 2BW with Error Feedback or activation checkpointing),
measured and modelled.

Two parts, one table each:

* **measured** (default: the ``tiny`` SmolLM2 with 4 blocks, p=2 gloo processes on the CPU, AdamW): one fresh group
  of processes per configuration (every schedule, ``2bw+ef``, ``2bw+ckpt``), built with ``pipeline.rank.plan_rank`` and ``build``
  like the strategy. Each rank reads ``PipelineRuntime.memory_report()`` (weight versions, optimizer state, EF
  buffer), measures the bytes one micro-batch of each of its chunks saves for the backward (``saved_tensors_hooks``),
  and tracks at every action the peak of the activations held: every micro-batch forwarded and not yet
  backwarded on a chunk (``B``, or ``I`` when the backward is split), counted with that chunk's bytes, plus the
  storages the split backwards' deferred weight gradients hold until their ``W`` (the linear layers' inputs and
  output gradients, read off the runtime's ``DeferredWeightGrads``); the peak bytes of live gradient buffers, and the process's peak RSS growth (``VmHWM`` after resetting it; on CUDA
  ``torch.cuda.max_memory_allocated`` growth instead). Next to it the model, ``memory.schedule_memory``: weight
  versions, optimizer state, a gradient accumulator, EF's buffer, and the activations of the schedule's replay
  (each micro-batch's saved bytes from ``F`` to ``B``/``I``, its measured weight-gradient bytes from ``I`` to ``W``).
* **analytic** (``smollm2-135m`` and ``smollm2-360m`` at p in {4, 8}, m = 2p): ``measure.measure_model`` sizes one
  embedding, block and head (fp32, activations saved for backward per micro-batch, the head measured on 256
  tokens and scaled), ``stage_costs_from_measurement`` splits the layers evenly, and ``schedule_memory`` gives the
  per-rank totals of every schedule with AdamW (2 fp32 states per parameter).

On the CPU, RSS is a rough witness only: the allocator keeps freed blocks, reuses them, and returns large ones to
the OS at once, so the RSS growth does not resolve activation peaks of a few MiB; read the per-term columns.

* **replicas** (``--data-parallel 1 2 4``): the same measurement on p x dp processes, with the optimizer state
  sharded over the replicas (ZeRO-1, ``shard_optimizer``) and not: every rank's terms, and the model's. The optimizer
  state and the EF buffer fall as 1/dp when sharded; weights, versions, gradients and activations do not. With
  ``--fsdp`` a third variant per replica count: FSDP2 inside each stage (``fsdp=True``, the synchronous schedules
  only), whose weights, gradients and optimizer state all fall as 1/dp; the model has no FSDP term (its columns "-").

    python benchmarks/memory.py --json runs/memory.json
    python benchmarks/memory.py --configs 2bw+ef 1f1b --data-parallel 1 2 4 --analytic-models
    python benchmarks/memory.py --configs 1f1b gpipe --data-parallel 1 2 4 --fsdp --analytic-models --skip-measured
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench  # noqa: E402
from _bench import reset_peak_rss, rss_kib  # noqa: E402

from lightning_async.models import SmolLM2, model_config  # noqa: E402
from lightning_async.models.objective import next_token_loss, split_next_token  # noqa: E402
from lightning_async.optim import build_optimizer  # noqa: E402
from lightning_async.optim import ErrorFeedbackCorrection  # noqa: E402
from lightning_async.pipeline import schedules  # noqa: E402
from lightning_async.pipeline import stage as stage_module  # noqa: E402
from lightning_async.pipeline.partition import partition_units  # noqa: E402
from lightning_async.pipeline.boundary import flatten  # noqa: E402
from lightning_async.pipeline.fsdp import check_fsdp_applicable, local  # noqa: E402
from lightning_async.pipeline.rank import build, plan_rank  # noqa: E402
from lightning_async.pipeline.stage import PieceModule  # noqa: E402
from lightning_async.pipeline.measure import SavedTensorBytes, measure_model, weight_grad_bytes  # noqa: E402
from lightning_async.pipeline.memory import schedule_memory  # noqa: E402
from lightning_async.pipeline.weight_grad import storage_bytes  # noqa: E402
from lightning_async.tools.stage_costs import stage_costs_from_measurement  # noqa: E402

# config -> (schedule, EF strength, activation checkpointing)
CONFIGS = {
    "1f1b": ("1f1b", None, False), "gpipe": ("gpipe", None, False), "zbh1": ("zbh1", None, False),
    "interleaved": ("interleaved", None, False), "zbv": ("zbv", None, False), "2bw": ("2bw", None, False),
    "2bw+ef": ("2bw", 1.0, False), "2bw+ckpt": ("2bw", None, True),
    "pipedream": ("pipedream", None, False), "paci": ("paci", None, False), "wpipe": ("wpipe", None, False),
}
MIB = 2**20


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = None if t is None else local(t)  # (this rank's shard of an FSDP weight or gradient)
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


# ------------------------------------------------------------------------------------------------ the stage
def model_units(model_name: str, tie_embeddings: bool = True):
    """The model and its pipeline units (untied for the schedules whose stages update at different times)."""
    torch.manual_seed(0)
    model = SmolLM2(model_config(model_name, **({} if tie_embeddings else {"tie_embeddings": False})))
    return model, [(f"model.{n}", u) for n, u in model.pipeline_units()]


def chunk_inputs(units, stage_units, pieces: list[int], inputs, device) -> list:
    """Each piece's input for one micro-batch: the earlier pieces' output (no gradients)."""
    by_name = dict(units)
    out, x = {}, inputs
    with torch.no_grad():
        for k, names in enumerate(stage_units):
            out[k] = x
            for n in names:
                x = by_name[n].to(device)(x)
    return [out[k] for k in pieces]


def activation_bytes(
    module: PieceModule, x: torch.Tensor, targets: torch.Tensor, last: bool, context, recompute: bool = False
) -> int:
    """Bytes one micro-batch's forward of ``module`` keeps for its backward (parameters excluded).

    Without ``recompute``: what autograd saves. With it (activation checkpointing): what autograd saves outside
    the checkpointed units (the loss) plus each unit's input, which its checkpoint keeps for the recompute.
    """
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    real_checkpoint = stage_module.checkpoint

    def counting_checkpoint(fn, unit, weights, value, *args, **kwargs):
        for leaf in flatten(value)[0]:
            counter._pack(leaf)  # the checkpoint holds the unit's input until the recompute
        return real_checkpoint(fn, unit, weights, value, *args, **kwargs)

    stage_module.checkpoint = counting_checkpoint
    try:
        with SavedTensorBytes(module.parameters()) as counter:
            y = module(x, context=context, recompute=recompute)
            if last:
                y = next_token_loss(y, targets)
    finally:
        stage_module.checkpoint = real_checkpoint
    del y
    return counter.total


def deferred_bytes(module: PieceModule, x: torch.Tensor, targets: torch.Tensor, last: bool, context) -> int:
    """Bytes one micro-batch of ``module`` keeps from a split backward's ``I`` to its ``W`` (the linear layers'
    inputs and output gradients, :func:`~lightning_async.pipeline.measure.weight_grad_bytes`)."""
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)

    def step():
        y = module(x, context=context)
        if last:
            return next_token_loss(y, targets).backward
        grad = torch.ones_like(y)  # (a full tensor, as a received gradient is)
        return lambda: y.backward(grad)

    return weight_grad_bytes(module, step)


def fsdp_accumulated_grads(chunks) -> list:
    """The whole gradients FSDP accumulates over a batch's micro-batches before its one reduce-scatter (FSDP2's
    private ``FSDPParam`` state: no public API reports them)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for chunk in chunks:
        for module in chunk.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            for fsdp_param in group.fsdp_params if group is not None else ():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                out += [g for g in (getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad) if g is not None]
    return out


def measured_worker(cfg: dict) -> dict:
    rank, p = dist.get_rank(), cfg["p"]
    device = torch.device(cfg["device"], rank) if cfg["device"] == "cuda" else torch.device("cpu")
    schedule, ef, recompute = CONFIGS[cfg["config"]]
    spec = schedules.spec(schedule)
    model, units = model_units(cfg["model"], tie_embeddings=spec.uniform_delay)  # (pipedream, wpipe: untied)
    shape, context_fn = model.config, model.pipeline_context
    stage_units = partition_units(units, spec.virtual_stages(p), "uniform")
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, shape.vocab_size, (cfg["m"] * cfg["micro_batch"], cfg["seq_len"] + 1), generator=g).to(device)
        for _ in range(cfg["steps"])
    ]
    inputs, targets = split_next_token(batches[0][: cfg["micro_batch"]])
    pieces = [spec.piece(rank % p, c, p) for c in range(spec.chunks)]
    firsts = chunk_inputs(units, stage_units, pieces, inputs, device)
    measure = {}

    plan = plan_rank(units, spec, cfg["m"], rank=rank, world_size=dist.get_world_size(), pipeline_parallel_size=p,
                     stage_units=stage_units)
    stage = plan.rank_stage
    stage.module.to(device)
    last = spec.virtual_stages(p) - 1
    act = [activation_bytes(chunk, x, targets, k == last, context_fn(inputs), recompute)
           for chunk, x, k in zip(stage.chunks, firsts, pieces)]
    residue = [deferred_bytes(chunk, x, targets, k == last, context_fn(inputs)) if spec.split_backward else 0
               for chunk, x, k in zip(stage.chunks, firsts, pieces)]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        measure["base_alloc"] = torch.cuda.memory_allocated(device)
    measure["rss0"] = rss_kib("VmRSS")
    measure["hwm_reset"] = reset_peak_rss()
    built = build(
        plan, build_optimizer("adamw", stage.named_parameters, lr=1e-3, weight_decay=0.1), split_next_token,
        next_token_loss, correction=None if ef is None else ErrorFeedbackCorrection(ef), autocast=contextlib.nullcontext,
        device=device, context_fn=context_fn, activation_checkpointing=recompute, shard_optimizer=cfg["sharding"] == "zero1",
        fsdp=cfg["sharding"] == "fsdp", **({"gradient_clip_val": cfg["clip"]} if cfg.get("clip") else {}),
    )
    runtime = built.runtime
    peak = {"inflight": 0, "deferred": 0, "activations": 0, "grads": 0}
    weights = [local(t) for t in [*runtime.params, *(t for slot in runtime.slots for t in slot)]]  # (FSDP: shards)

    def sample():
        # (chunk, mb) forwarded and not yet backwarded (B, or I when split): what autograd saved for it; and the
        # tensors the deferred weight gradients of split backwards hold until their W, read off the runtime
        held, deferred = list(runtime.compute.inflight), list(runtime.compute.deferred.values())
        peak["inflight"] = max(peak["inflight"], len(held))
        peak["deferred"] = max(peak["deferred"], len(deferred))
        kept = storage_bytes([t for d in deferred for t in d.held], exclude=weights)
        peak["activations"] = max(peak["activations"], sum(act[c] for c, _ in held) + kept)
        grads = [t.grad for t in runtime.params] if runtime.fsdp else [t.grad for slot in runtime.slots for t in slot]
        grads += [x for group in runtime.update_groups for pending in group.updates.pending.values() for x in pending.grads]
        grads += fsdp_accumulated_grads(runtime.chunks) if runtime.fsdp else []
        peak["grads"] = max(peak["grads"], _nbytes(grads))

    def spied(fn):
        def spy(*args, **kwargs):
            out = fn(*args, **kwargs)
            sample()
            return out
        return spy

    compute = runtime.compute
    compute.forward, compute.backward = spied(compute.forward), spied(compute.backward)
    compute.weight_grad = spied(compute.weight_grad)
    t0 = time.perf_counter()
    # Timing knobs for the tests: the last stage starts each call late (the first stage's reductions then finish
    # after it reached its next backward), or the first stage begins each update late (the others' then wait for it)
    late_call = cfg.get("late_last_stage_s", 0.0) if rank % p == p - 1 else 0.0
    late_update = cfg.get("late_first_update_s", 0.0) if rank % p == 0 else 0.0
    if late_update:
        backward = compute.backward

        def late_last_backward(chunk, mb, *args, **kwargs):
            out = backward(chunk, mb, *args, **kwargs)
            if mb % cfg["m"] == cfg["m"] - 1:
                time.sleep(late_update)
            return out
        compute.backward = late_last_backward
    for b, batch in enumerate(batches):
        time.sleep(late_call)
        runtime.train_batch(batch)
        sample()
        if runtime.reported_loss_batch() is not None:
            runtime.collect_loss(runtime.reported_loss_batch())
    hwm = rss_kib("VmHWM")
    runtime.drain()
    if runtime.clock.reported_loss(len(batches) - 1) != len(batches) - 1:  # the last batch's loss is still out
        runtime.collect_loss(len(batches) - 1)
    elapsed = time.perf_counter() - t0
    rss0 = measure["rss0"]
    counted: set[int] = set()  # (a weight two chunks share, ZB-V's tied one, counted with the first)
    per_chunk = [_nbytes([t for t in chunk.parameters() if id(t) not in counted and not counted.add(id(t))])
                 for chunk in stage.chunks]
    out = dict(runtime.memory_report(), stage=rank % p, replica=rank // p, activation_bytes_per_chunk=act,
               activation_bytes_per_microbatch=sum(act), weight_grad_bytes_per_chunk=residue,
               weight_grad_bytes_per_microbatch=sum(residue), parameters_per_chunk=per_chunk)
    out["peak_inflight_microbatches"] = peak["inflight"]
    out["peak_deferred_weight_grads"] = peak["deferred"]
    out["peak_activation_bytes"] = peak["activations"]
    out["peak_gradient_bytes"] = peak["grads"]
    out["rss_base_bytes"] = (rss0 or 0) * 1024
    out["rss_peak_delta_bytes"] = (hwm - rss0) * 1024 if (measure["hwm_reset"] and hwm and rss0) else None
    if device.type == "cuda":
        out["cuda_peak_delta_bytes"] = torch.cuda.max_memory_allocated(device) - measure["base_alloc"]
    out["seconds"] = elapsed
    return out


def measured(args, dp: int = 1, sharding: str = "none") -> list[dict]:
    """Every config on p x dp processes; ``sharding``: ``"none"``, ``"zero1"`` (shard_optimizer) or ``"fsdp"``."""
    rows = []
    shard = sharding == "zero1"
    for config in args.configs:
        cfg = dict(model=args.model, p=args.p, m=args.m, micro_batch=args.micro_batch, seq_len=args.seq_len,
                   steps=args.steps, config=config, device=args.device, sharding=sharding, clip=args.clip)
        schedule, ef, recompute = CONFIGS[config]
        if sharding == "fsdp":
            try:
                check_fsdp_applicable(schedules.spec(schedule), dp, activation_checkpointing=recompute)
            except ValueError as refused:
                print(f"skipped {config} under FSDP: {refused}")
                continue
        ranks = _bench.spawn(args.p * dp, measured_worker, cfg, backend="nccl" if cfg["device"] == "cuda" else "gloo")
        spec = schedules.spec(schedule)
        pieces = spec.virtual_stages(args.p)
        piece_bytes, piece_residue, piece_params = [0] * pieces, [0] * pieces, [0] * pieces
        for r in ranks:
            for c, (nbytes, kept, weights) in enumerate(zip(r["activation_bytes_per_chunk"], r["weight_grad_bytes_per_chunk"],
                                                            r["parameters_per_chunk"])):
                k = spec.piece(r["stage"], c, args.p)
                piece_bytes[k], piece_residue[k], piece_params[k] = nbytes, kept, weights
        first = ranks[: args.p]  # replica 0's stages (the model's inputs); under sharding, the whole stage's state
        whole = [sum(r["optimizer_state"] for r in ranks if r["stage"] == s) if shard else first[s]["optimizer_state"]
                 for s in range(args.p)]
        model = schedule_memory(
            schedule, args.p, args.m, piece_params if spec.chunks > 1 else [r["parameters"] for r in first], whole,
            piece_bytes if spec.chunks > 1 else [r["activation_bytes_per_microbatch"] for r in first],
            correction_buffers=1 if ef else 0, data_parallel_size=dp, shard_optimizer=shard,
            weight_grad_bytes=piece_residue if spec.chunks > 1 else [r["weight_grad_bytes_per_microbatch"] for r in first],
            tied_weights=spec.uniform_delay, clipping=bool(args.clip),  # (model_units ties where the schedule allows)
        )
        for r in ranks:
            theory = model[r["stage"]] if sharding != "fsdp" else dict.fromkeys(model[r["stage"]])
            accounted = (r["weight_versions"] + r["optimizer_state"] + r["correction"] + r["peak_gradient_bytes"]
                         + r["peak_activation_bytes"])
            rows.append(dict(
                r, config=config, sim_peak_inflight=(theory["inflight_microbatches"] or 0) * schedules.spec(schedule).chunks,
                theory_weight_versions=theory["weights"], theory_error_feedback=theory["correction"],
                theory_gradient_bytes=theory["gradients"], theory_activations=theory["activations"],
                theory_total=theory["total"], accounted_total=accounted, dp=dp, sharded=sharding != "none", sharding=sharding,
                theory_optimizer=theory["optimizer"], seconds_per_batch=r["seconds"] / cfg["steps"],
            ))
    return rows


def replicas_table(rows: list[dict]) -> str:
    """Per rank and replica count, sharded or not: the terms that ZeRO-1 splits (optimizer state, EF) and those it
    does not, each measured / modelled, and the optimizer term as a share of the one-replica run's."""
    single = {(r["config"], r["stage"]): r["optimizer_state"] + r["correction"] for r in rows if r["dp"] == 1}
    head = ("config", "dp", "sharding", "stage", "replica", "versions MiB", "grads peak MiB", "AdamW MiB meas / model",
            "EF MiB meas / model", "(AdamW + EF) / dp=1", "activations peak MiB", "accounted MiB", "s / batch")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        base = single.get((r["config"], r["stage"]))
        ratio = f"{(r['optimizer_state'] + r['correction']) / base:.3f}" if base else "-"
        lines.append("| " + " | ".join([
            r["config"], str(r["dp"]), r["sharding"], str(r["stage"]), str(r["replica"]),
            _mib(r["weight_versions"]), _mib(r["peak_gradient_bytes"]),
            f"{_mib(r['optimizer_state'])} / {_model_mib(r['theory_optimizer'])}",
            f"{_mib(r['correction'])} / {_model_mib(r['theory_error_feedback'])}", ratio,
            _mib(r["peak_activation_bytes"]), _mib(r["accounted_total"]), f"{r['seconds_per_batch']:.3f}",
        ]) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ analytic
ANALYTIC_SCHEDULES = ("1f1b", "zbh1", "interleaved", "zbv", "2bw")


def analytic(args) -> list[dict]:
    rows = []
    for name in args.analytic_models:
        meas = measure_model(name, seq_len=args.analytic_seq_len, micro_batch_size=args.analytic_micro_batch, reps=1)
        gc.collect()
        for p in args.analytic_stages:
            m = 2 * p
            costs = stage_costs_from_measurement(meas, p, optimizer_states=2)
            reductions = dict(tied_weights=bool(meas.get("tied_params")), clipping=bool(args.clip))
            per = {s: schedule_memory(s, p, m, costs["param_bytes"], costs["optimizer_bytes"], costs["activation_bytes"],
                                      weight_grad_bytes=costs["weight_grad_bytes"], **reductions)
                   for s in ANALYTIC_SCHEDULES}
            ef = schedule_memory("2bw", p, m, costs["param_bytes"], costs["optimizer_bytes"], costs["activation_bytes"],
                                 correction_buffers=1, **reductions)
            for r in range(p):
                rows.append(dict(
                    model=name, p=p, m=m, stage=r, layers=costs["layers"][r], params=costs["params"][r],
                    param_bytes=costs["param_bytes"][r], optimizer_bytes=costs["optimizer_bytes"][r],
                    activation_bytes_per_microbatch=costs["activation_bytes"][r],
                    **{f"inflight_{s}": per[s][r]["inflight_microbatches"] for s in ANALYTIC_SCHEDULES},
                    **{f"total_{s}": per[s][r]["total"] for s in ANALYTIC_SCHEDULES},
                    total_2bw_ef=ef[r]["total"],
                ))
    return rows


# ------------------------------------------------------------------------------------------------ tables
def _mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _model_mib(n) -> str:
    return "-" if n is None else _mib(n)


def _gib(n) -> str:
    return f"{n / 2**30:.2f}"


def measured_table(rows: list[dict], cuda: bool) -> str:
    peak_col = "CUDA peak Δ MiB" if cuda else "RSS peak Δ MiB"
    head = ("config", "rank", "params MiB", "versions MiB meas / model", "EF MiB meas / model", "AdamW MiB",
            "grads peak MiB meas / model", "in-flight µb meas / sim", "activations peak MiB meas / model",
            "total MiB accounted / model", peak_col)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        peak = r.get("cuda_peak_delta_bytes") if cuda else r["rss_peak_delta_bytes"]
        lines.append("| " + " | ".join([
            r["config"], str(r["stage"]), _mib(r["parameters"]),
            f"{_mib(r['weight_versions'])} / {_mib(r['theory_weight_versions'])}",
            f"{_mib(r['correction'])} / {_mib(r['theory_error_feedback'])}",
            _mib(r["optimizer_state"]),
            f"{_mib(r['peak_gradient_bytes'])} / {_mib(r['theory_gradient_bytes'])}",
            f"{r['peak_inflight_microbatches']} / {r['sim_peak_inflight']:g}",
            f"{_mib(r['peak_activation_bytes'])} / {_mib(r['theory_activations'])}",
            f"{_mib(r['accounted_total'])} / {_mib(r['theory_total'])}",
            _mib(peak),
        ]) + " |")
    return "\n".join(lines)


def checkpointing_table(rows: list[dict], tokens: int) -> str:
    """In-flight activation bytes and throughput per stage, with (``2bw+ckpt``) and without (``2bw``) recompute."""
    base = {r["stage"]: r for r in rows if r["config"] == "2bw"}
    head = ("config", "stage", "in-flight µb", "act / µb MiB", "in-flight activations MiB", "vs 2bw", "tokens/s", "vs 2bw")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["config"] not in ("2bw", "2bw+ckpt") or r["stage"] not in base:
            continue
        b = base[r["stage"]]
        inflight = r["peak_inflight_microbatches"] * r["activation_bytes_per_microbatch"]
        base_inflight = b["peak_inflight_microbatches"] * b["activation_bytes_per_microbatch"]
        lines.append("| " + " | ".join([
            r["config"], str(r["stage"]), str(r["peak_inflight_microbatches"]), _mib(r["activation_bytes_per_microbatch"]),
            _mib(inflight), f"{inflight / base_inflight:.3f}", f"{tokens / r['seconds']:.0f}",
            f"{b['seconds'] / r['seconds']:.3f}",
        ]) + " |")
    return "\n".join(lines)


def analytic_table(rows: list[dict]) -> str:
    head = ("model", "p (m=2p)", "rank", "layers", "params M", "weights GiB", "AdamW GiB", "act / µb GiB",
            *(f"{s} GiB (in-flight)" for s in ANALYTIC_SCHEDULES), "2bw+EF GiB", "2bw / 1f1b", "zbv / 1f1b")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], str(r["p"]), str(r["stage"]), str(r["layers"]), f"{r['params'] / 1e6:.1f}",
            _gib(r["param_bytes"]), _gib(r["optimizer_bytes"]), f"{r['activation_bytes_per_microbatch'] / 2**30:.3f}",
            *(f"{_gib(r[f'total_{s}'])} ({r[f'inflight_{s}']:g})" for s in ANALYTIC_SCHEDULES),
            _gib(r["total_2bw_ef"]), f"{r['total_2bw'] / r['total_1f1b']:.3f}", f"{r['total_zbv'] / r['total_1f1b']:.3f}",
        ]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = _bench.parser(__doc__, whole=True)
    parser.add_argument("--model", default="tiny", help="model of the measured part")
    parser.add_argument("--p", type=int, default=2, help="stages (processes) of the measured part")
    parser.add_argument("--m", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--clip", type=float, default=None,
                        help="clip gradients to this global norm (a reduction across the stages): the measured runs "
                             "clip, the model and the analytic part count its second gradient buffers")
    _bench.add_device(parser, "cpu", choices=["cpu", "cuda"],
                      help="cuda: nccl, one GPU per stage (not run in this repository's CPU sessions)")
    parser.add_argument("--analytic-models", nargs="*", default=["smollm2-135m", "smollm2-360m"])
    parser.add_argument("--analytic-stages", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--analytic-seq-len", type=int, default=2048)
    parser.add_argument("--analytic-micro-batch", type=int, default=1)
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--data-parallel", nargs="+", type=int, default=None,
                        help="replica counts of the replicas table (each > 1 measured sharded and not)")
    parser.add_argument("--fsdp", action="store_true",
                        help="replicas table: FSDP2 inside each stage too, for every dp > 1 (synchronous configs)")
    _bench.add_json(parser, "write the rows here")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.p:
        parser.error(f"--device cuda needs {args.p} GPUs (one per stage); found {torch.cuda.device_count()}")

    t0 = time.perf_counter()
    result = {"settings": vars(args), "torch": torch.__version__, "cpu_count": os.cpu_count()}
    if not args.skip_measured:
        rows = measured(args)
        result["measured"] = rows
        print(f"\nMeasured: {args.model}, p={args.p}, m={args.m}, micro-batch {args.micro_batch} x {args.seq_len}, "
              f"AdamW, {args.steps} batches, device {args.device}\n")
        print(measured_table(rows, args.device == "cuda"))
        if {"2bw", "2bw+ckpt"} <= set(args.configs):
            tokens = args.steps * args.m * args.micro_batch * args.seq_len
            print("\nActivation checkpointing (2BW, same run): activations kept for the micro-batches in flight, and "
                  "throughput (tokens/s of the whole run per stage process)\n")
            print(checkpointing_table(rows, tokens))
        if args.device == "cpu":
            print("\nCPU: the RSS column is a rough witness only (allocator caching); peak activation memory is "
                  "not measured reliably by RSS. Read the per-term columns.")
    if args.data_parallel:
        variants = ("none", "zero1") + (("fsdp",) if args.fsdp else ())
        rows = [row for dp in args.data_parallel for sharding in (variants if dp > 1 else ("none",))
                for row in measured(args, dp, sharding)]
        result["replicas"] = rows
        print(f"\nReplicas: {args.model}, p={args.p}, m={args.m} per replica, AdamW, {' / '.join(variants)}\n")
        print(replicas_table(rows))
    if args.analytic_models:
        rows = analytic(args)
        result["analytic"] = rows
        print(f"\nAnalytic (schedule_memory; fp32 weights and activations, AdamW, micro-batch "
              f"{args.analytic_micro_batch} x {args.analytic_seq_len}, m = 2p)\n")
        print(analytic_table(rows))
    result["seconds"] = time.perf_counter() - t0
    print(f"\n{result['seconds']:.0f} s in total")
    if args.json:
        _bench.write_json(args.json, result)


if __name__ == "__main__":
    main()
