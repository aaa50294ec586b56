"""Memory per pipeline stage: synchronous 1F1B, PipeDream-2BW and 2BW + Error Feedback, measured and modelled.

Two parts, one table each:

* **measured** (default: the ``tiny`` SmolLM2, p=2 gloo processes on the CPU, AdamW): one fresh group of
  processes per configuration (``1f1b``, ``2bw``, ``2bw+ef``). Each rank reads ``PipelineRuntime.memory_report()``
  (weight versions, optimizer state, EF buffer), tracks the peak number of micro-batches in flight and the peak
  bytes of live gradient buffers (slot ``.grad`` plus gradients waiting in a pending 2BW update) at every forward
  and backward, and the process's peak RSS growth over the run (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``; on CUDA ``torch.cuda.max_memory_allocated`` growth instead). Next to it, the theory
  of ``timing.memory_model``: 2BW keeps one more weight version per stage, EF one parameter-sized buffer,
  activations for the peak in-flight micro-batches of ``simulate`` (``p - s`` on stage ``s``), each the bytes
  saved for backward by one micro-batch of that stage (counted with ``saved_tensors_hooks``).
* **analytic** (``smollm2-135m`` and ``smollm2-360m`` at p in {4, 8}, m = 2p): ``measure.measure_model`` sizes one
  embedding, block and head (fp32, activations saved for backward per micro-batch, the head measured on 256
  tokens and scaled), ``stage_costs_from_measurement`` splits the layers evenly, and ``memory_model`` gives the
  per-stage totals with AdamW (2 fp32 states per parameter).

On the CPU, RSS is a rough witness only: the allocator keeps freed blocks, reuses them, and returns large ones to
the OS at once, so the RSS growth does not resolve activation peaks of a few MiB; read the per-term columns.

    python benchmarks/memory.py --json runs/memory.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from lightning_async.models import SmolLM2, model_config  # noqa: E402
from lightning_async.models.objective import next_token_loss, split_next_token  # noqa: E402
from lightning_async.optim import build_optimizer  # noqa: E402
from lightning_async.optim import ErrorFeedback  # noqa: E402
from lightning_async.pipeline.groups import make_pipeline_groups  # noqa: E402
from lightning_async.pipeline.local import run_local  # noqa: E402
from lightning_async.pipeline.partition import partition_units  # noqa: E402
from lightning_async.pipeline import runtime as runtime_module  # noqa: E402
from lightning_async.pipeline.boundary import flatten  # noqa: E402
from lightning_async.pipeline.runtime import PipelineRuntime  # noqa: E402
from lightning_async.pipeline.stage import StageModule, build_rank_stage  # noqa: E402
from lightning_async.pipeline.measure import SavedTensorBytes, measure_model  # noqa: E402
from lightning_async.pipeline.timing import memory_model, simulate  # noqa: E402
from lightning_async.tools.stage_costs import stage_costs_from_measurement  # noqa: E402

# config -> (schedule, EF strength, activation checkpointing)
CONFIGS = {"1f1b": ("1f1b", None, False), "2bw": ("2bw", None, False), "2bw+ef": ("2bw", 1.0, False), "2bw+ckpt": ("2bw", None, True)}
MIB = 2**20


# ------------------------------------------------------------------------------------------------ process memory
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def spawn(world: int, cfg: dict, timeout: float = 600.0) -> list[dict]:
    """Run :func:`measured_worker` on ``world`` fresh processes (gloo on the CPU, nccl on CUDA)."""
    return run_local(world, measured_worker, cfg, backend="nccl" if cfg["device"] == "cuda" else "gloo", timeout=timeout)


# ------------------------------------------------------------------------------------------------ the stage
def build_model_stage(model_name: str, p: int, stage: int):
    torch.manual_seed(0)
    model = SmolLM2(model_config(model_name))
    units = [(f"model.{n}", u) for n, u in model.pipeline_units()]
    names = partition_units(units, p, "uniform")
    built = build_rank_stage(units, stage, names)
    module, named, tied = built.module, built.named_parameters, built.tied
    # A representative input of this stage: the previous stages' output on the first micro-batch.
    return module, named, tied, [u for n, u in units if n in {x for s in range(stage) for x in names[s]}], model


def activation_bytes(
    module: StageModule, x: torch.Tensor, targets: torch.Tensor, last: bool, context, recompute: bool = False
) -> int:
    """Bytes one micro-batch's forward of ``module`` keeps for its backward (parameters excluded).

    Without ``recompute``: what autograd saves. With it (activation checkpointing): what autograd saves outside
    the checkpointed units (the loss) plus each unit's input, which its checkpoint keeps for the recompute.
    """
    if x.is_floating_point():
        x = x.detach().requires_grad_(True)
    real_checkpoint = runtime_module.checkpoint

    def counting_checkpoint(fn, unit, weights, value, *args, **kwargs):
        for leaf in flatten(value)[0]:
            counter._pack(leaf)  # the checkpoint holds the unit's input until the recompute
        return real_checkpoint(fn, unit, weights, value, *args, **kwargs)

    runtime_module.checkpoint = counting_checkpoint
    try:
        with SavedTensorBytes(module.parameters()) as counter:
            y = module(x, context=context, recompute=recompute)
            if last:
                y = next_token_loss(y, targets)
    finally:
        runtime_module.checkpoint = real_checkpoint
    del y
    return counter.total


def measured_worker(cfg: dict) -> dict:
    rank, p = dist.get_rank(), cfg["p"]
    device = torch.device(cfg["device"], rank) if cfg["device"] == "cuda" else torch.device("cpu")
    schedule, ef, recompute = CONFIGS[cfg["config"]]
    module, named, tied, before, model = build_model_stage(cfg["model"], p, rank)
    shape, context_fn = model.config, model.pipeline_context
    module.to(device)
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, shape.vocab_size, (cfg["m"] * cfg["micro_batch"], cfg["seq_len"] + 1), generator=g).to(device)
        for _ in range(cfg["steps"])
    ]
    inputs, targets = split_next_token(batches[0][: cfg["micro_batch"]])
    with torch.no_grad():
        x = inputs
        for unit in before:
            x = unit.to(device)(x)
    act = activation_bytes(module, x, targets, rank == p - 1, context_fn(inputs), recompute)
    del x
    opt = build_optimizer("adamw", named, lr=1e-3, weight_decay=0.1)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base_alloc = torch.cuda.memory_allocated(device)
    rss0 = _status_kib("VmRSS")
    hwm_reset = _reset_peak_rss()
    groups = make_pipeline_groups(rank, dist.get_world_size(), p)
    runtime = PipelineRuntime(
        module, opt, schedule, cfg["m"], split_next_token, next_token_loss, groups,
        correction=None if ef is None else ErrorFeedback(ef),
        tied_parameters=tied, count_tied_in_norm=rank == 0, autocast=contextlib.nullcontext, device=device,
        context_fn=context_fn, activation_checkpointing=recompute,
    )
    peak = {"inflight": 0, "grads": 0}

    def sample():
        peak["inflight"] = max(peak["inflight"], len(runtime._inflight))
        grads = [t.grad for slot in runtime.slots for t in slot]
        grads += [x for pending in runtime._pending.values() for x in pending.grads]
        peak["grads"] = max(peak["grads"], _nbytes(grads))

    forward, backward = runtime._forward, runtime._backward

    def spy_forward(*args, **kwargs):
        y = forward(*args, **kwargs)
        sample()
        return y

    def spy_backward(*args, **kwargs):
        dx = backward(*args, **kwargs)
        sample()
        return dx

    runtime._forward, runtime._backward = spy_forward, spy_backward
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        runtime.train_batch(batch)
        sample()
        if schedule != "2bw" or b > 0:
            runtime.collect_loss(b - 1 if schedule == "2bw" else b)
    hwm = _status_kib("VmHWM")
    runtime.drain()
    if schedule == "2bw":
        runtime.collect_loss(len(batches) - 1)
    elapsed = time.perf_counter() - t0
    out = dict(runtime.memory_report(), stage=rank, activation_bytes_per_microbatch=act)
    out["peak_inflight_microbatches"] = peak["inflight"]
    out["peak_gradient_bytes"] = peak["grads"]
    out["rss_base_bytes"] = (rss0 or 0) * 1024
    out["rss_peak_delta_bytes"] = (hwm - rss0) * 1024 if (hwm_reset and hwm and rss0) else None
    if device.type == "cuda":
        out["cuda_peak_delta_bytes"] = torch.cuda.max_memory_allocated(device) - base_alloc
    out["seconds"] = elapsed
    return out


def measured(args) -> list[dict]:
    rows = []
    for config in args.configs:
        cfg = dict(model=args.model, p=args.p, m=args.m, micro_batch=args.micro_batch, seq_len=args.seq_len,
                   steps=args.steps, config=config, device=args.device)
        schedule, *_ = CONFIGS[config]
        sim = simulate(schedule, args.p, args.m, num_batches=max(args.steps, 3))
        ranks = spawn(args.p, cfg)
        for r in ranks:
            s = r["stage"]
            (theory,) = memory_model(
                r["parameters"], r["optimizer_state"], r["activation_bytes_per_microbatch"],
                inflight_sync=[sim.peak_inflight[s]], inflight_2bw=[sim.peak_inflight[s]],
            )
            total_model = theory.sync if schedule == "1f1b" else theory.twobw_ef if config == "2bw+ef" else theory.twobw
            versions = 2 if schedule == "2bw" else 1
            accounted = (
                r["weight_versions"] + r["optimizer_state"] + r["correction"] + r["peak_gradient_bytes"]
                + r["peak_inflight_microbatches"] * r["activation_bytes_per_microbatch"]
            )
            rows.append(dict(
                r, config=config, sim_peak_inflight=sim.peak_inflight[s],
                theory_weight_versions=versions * r["parameters"],
                theory_error_feedback=r["parameters"] if config == "2bw+ef" else 0,
                theory_gradient_bytes=theory.grads,
                theory_activations=theory.activations_sync,
                theory_total=total_model, accounted_total=accounted,
            ))
    return rows


# ------------------------------------------------------------------------------------------------ analytic
def analytic(args) -> list[dict]:
    rows = []
    for name in args.analytic_models:
        meas = measure_model(name, seq_len=args.analytic_seq_len, micro_batch_size=args.analytic_micro_batch, reps=1)
        gc.collect()
        for p in args.analytic_stages:
            m = 2 * p
            costs = stage_costs_from_measurement(meas, p, optimizer_states=2)
            sims = {s: simulate(s, p, m, num_batches=4) for s in ("1f1b", "2bw")}
            mem = memory_model(
                costs["param_bytes"], costs["optimizer_bytes"], costs["activation_bytes"],
                inflight_sync=sims["1f1b"].peak_inflight, inflight_2bw=sims["2bw"].peak_inflight,
            )
            for s, x in enumerate(mem):
                rows.append(dict(
                    model=name, p=p, m=m, stage=s, layers=costs["layers"][s], params=costs["params"][s],
                    param_bytes=x.params, optimizer_bytes=x.optimizer, grad_bytes=x.grads,
                    activation_bytes_per_microbatch=costs["activation_bytes"][s],
                    inflight_1f1b=sims["1f1b"].peak_inflight[s], inflight_2bw=sims["2bw"].peak_inflight[s],
                    activations_1f1b=x.activations_sync, activations_2bw=x.activations_2bw,
                    total_1f1b=x.sync, total_2bw=x.twobw, total_2bw_ef=x.twobw_ef,
                    # the runtime as written holds batch b's gradients (pending until call b + 2) next to b + 1's
                    total_2bw_runtime=x.twobw + x.grads, total_2bw_ef_runtime=x.twobw_ef + x.grads,
                ))
    return rows


# ------------------------------------------------------------------------------------------------ tables
def _mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _gib(n) -> str:
    return f"{n / 2**30:.2f}"


def measured_table(rows: list[dict], cuda: bool) -> str:
    peak_col = "CUDA peak Δ MiB" if cuda else "RSS peak Δ MiB"
    head = ("config", "stage", "params MiB", "versions MiB meas / theory", "EF MiB meas / theory", "AdamW MiB",
            "grads peak MiB meas / model", "in-flight meas / sim", "act / µb MiB", "total MiB accounted / model",
            peak_col)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        peak = r.get("cuda_peak_delta_bytes") if cuda else r["rss_peak_delta_bytes"]
        lines.append("| " + " | ".join([
            r["config"], str(r["stage"]), _mib(r["parameters"]),
            f"{_mib(r['weight_versions'])} / {_mib(r['theory_weight_versions'])}",
            f"{_mib(r['error_feedback'])} / {_mib(r['theory_error_feedback'])}",
            _mib(r["optimizer_state"]),
            f"{_mib(r['peak_gradient_bytes'])} / {_mib(r['theory_gradient_bytes'])}",
            f"{r['peak_inflight_microbatches']} / {r['sim_peak_inflight']}",
            _mib(r["activation_bytes_per_microbatch"]),
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
    head = ("model", "p (m=2p)", "stage", "layers", "params M", "weights GiB", "AdamW GiB", "act / µb GiB",
            "in-flight", "1f1b GiB", "2bw GiB", "2bw+EF GiB", "2bw / 1f1b", "2bw+EF / 1f1b",
            "2bw+EF as run GiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], str(r["p"]), str(r["stage"]), str(r["layers"]), f"{r['params'] / 1e6:.1f}",
            _gib(r["param_bytes"]), _gib(r["optimizer_bytes"]), f"{r['activation_bytes_per_microbatch'] / 2**30:.3f}",
            f"{r['inflight_1f1b']}" + ("" if r["inflight_1f1b"] == r["inflight_2bw"] else f"/{r['inflight_2bw']}"),
            _gib(r["total_1f1b"]), _gib(r["total_2bw"]), _gib(r["total_2bw_ef"]),
            f"{r['total_2bw'] / r['total_1f1b']:.3f}", f"{r['total_2bw_ef'] / r['total_1f1b']:.3f}",
            _gib(r["total_2bw_ef"] + r["grad_bytes"]),
        ]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="model of the measured part")
    parser.add_argument("--p", type=int, default=2, help="stages (processes) of the measured part")
    parser.add_argument("--m", type=int, default=4, help="micro-batches per batch")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: nccl, one GPU per stage (not run in this repository's CPU sessions)")
    parser.add_argument("--analytic-models", nargs="*", default=["smollm2-135m", "smollm2-360m"])
    parser.add_argument("--analytic-stages", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--analytic-seq-len", type=int, default=2048)
    parser.add_argument("--analytic-micro-batch", type=int, default=1)
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--json", default=None, help="write the rows here")
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
    if args.analytic_models:
        rows = analytic(args)
        result["analytic"] = rows
        print(f"\nAnalytic (memory_model; fp32 weights and activations, AdamW, micro-batch "
              f"{args.analytic_micro_batch} x {args.analytic_seq_len}, m = 2p)\n")
        print(analytic_table(rows))
    result["seconds"] = time.perf_counter() - t0
    print(f"\n{result['seconds']:.0f} s in total")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
