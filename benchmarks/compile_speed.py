"""Eager vs ``torch.compile`` of the decoder blocks: tokens/s of a full training step, and under the 2BW runtime.

Two comparisons per model (default ``tiny``; add ``small`` with ``--models tiny small``), batch 16 x 128 tokens:

* **plain**: ``CausalLM(model, compile=False).model`` vs ``CausalLM(model, compile=True).model`` (each
  ``DecoderBlock`` wrapped by ``torch.compile``), same initial weights; one step is forward + backward +
  AdamW ``step()`` + ``zero_grad()``.
* **delayed-ef**: the plain step with the optimizer wrapped in ``DelayedOptimizer(delay=1, error_feedback=1,
  pairing="2bw")``, the one-device simulation of 2BW + Error Feedback (what a delay study runs).
* **2bw runtime**: a one-process 2bw runtime (``pipeline.rank.build``) over the same model's ``pipeline_units()``
  (m micro-batches per batch), i.e. every forward goes through ``torch.func.functional_call`` with the tensors
  of weight slot ``b % 2`` substituted into the compiled blocks; one step is ``train_batch``.

The first compiled step (or the first two batches under 2BW, one per weight slot) is timed separately as
compile time (first-call wall time minus the median compiled step; Inductor's on-disk caches make a repeated
run compile much faster, ``--no-compile-cache`` measures a cold compile) and excluded, as are ``--warmup``
further steps. Timed steps of the eager and compiled variants are interleaved (one of each per round), so machine-load
drifts hit both; the ratio is the number to read. Dynamo's ``unique_graphs`` counter is read after each of the first
calls and at the end: a graph added after the first call is a recompilation (e.g. for the second weight slot).

    python benchmarks/compile_speed.py --threads 1 --json runs/compile_speed.json
    python benchmarks/compile_speed.py --device cuda --models smollm2-135m --paths plain delayed-ef \
        --autocast bf16 --seq-len 2048 --batch 16 --peak-tflops 989
"""

from __future__ import annotations

import contextlib
import time

import torch

import _bench
from _bench import timed
from lightning_async.lm import CausalLM
from lightning_async.models import MODEL_CONFIGS, model_config
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import DelayedOptimizer, OPTIMIZER_NAMES, build_optimizer


def dynamo_stats() -> dict:
    from torch._dynamo.utils import counters

    stats = counters["stats"]
    return {
        "unique_graphs": int(stats.get("unique_graphs", 0)),
        "calls_captured": int(stats.get("calls_captured", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def build(name: str, compiled: bool, device: torch.device) -> CausalLM:
    torch.manual_seed(0)
    lm = CausalLM(model=name, compile=compiled).to(device)
    return lm


def autocast_factory(device: torch.device, dtype: str | None):
    """``None``: full precision; ``"bf16"``: ``torch.autocast`` to bfloat16 (what bf16-mixed does)."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def plain_step(lm: CausalLM, opt, batch: torch.Tensor, autocast=contextlib.nullcontext) -> None:
    inputs, targets = split_next_token(batch)
    with autocast():
        logits = lm.model(inputs)
    next_token_loss(logits, targets).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_optimizer(name: str, named_parameters) -> torch.optim.Optimizer:
    lr = 0.02 if name in ("muon", "normuon") else 1e-3
    return build_optimizer(name, list(named_parameters), lr=lr, weight_decay=0.1)


def make_step(path: str, lm: CausalLM, args, autocast):
    """One training step of ``path``: ``plain`` (sync), ``delayed-ef`` (the one-device simulation of 2BW with
    Error Feedback, as ``DelaySimulation(1)`` + ``ErrorFeedback`` run it) or ``2bw`` (the pipeline runtime)."""
    if path == "2bw":
        # the model's own names (the stage module's are "units.0.weight"...) decide the zoo's grouping
        return _bench.build_rank(lm.pipeline_units(), "2bw", args.microbatches, split_next_token, next_token_loss,
                                 lambda plan: make_optimizer(args.optimizer, lm.model.named_parameters()),
                                 autocast=autocast).runtime.train_batch
    opt = make_optimizer(args.optimizer, lm.model.named_parameters())
    if path == "delayed-ef":
        opt = DelayedOptimizer(opt, delay=1, error_feedback=1.0, pairing="2bw")
    return lambda batch: plain_step(lm, opt, batch, autocast)


def compare(name: str, path: str, args, device: torch.device, batches) -> dict:
    """Eager vs compiled for ``path`` (see :func:`make_step`); returns timings, ratio and dynamo counters."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    variants = {}
    autocast = autocast_factory(device, args.autocast)
    for label, compiled in (("eager", False), ("compiled", True)):
        lm = build(name, compiled, device)
        variants[label] = {"step": make_step(path, lm, args, autocast), "lm": lm}

    tokens = args.batch * args.seq_len
    out = {"model": name, "path": path, "tokens_per_step": tokens,
           "params": sum(p.numel() for p in variants["eager"]["lm"].parameters()),
           "flops_per_token": variants["eager"]["lm"].flops_per_token(args.seq_len)}
    # First calls: compile. Under 2BW the first two batches use the two weight slots.
    first_calls = 2 if path == "2bw" else 1
    out["first_calls_s"] = {}
    out["dynamo_after_call"] = []
    for label in ("eager", "compiled"):
        times = []
        for i in range(first_calls):
            times.append(timed(lambda: variants[label]["step"](batches[i % len(batches)]), device))
            if label == "compiled":
                out["dynamo_after_call"].append(dynamo_stats())
        out["first_calls_s"][label] = times
    k = first_calls
    for _ in range(args.warmup):
        for label in ("eager", "compiled"):
            variants[label]["step"](batches[k % len(batches)])
        k += 1
    out["dynamo_after_warmup"] = dynamo_stats()
    samples = {"eager": [], "compiled": []}
    for r, label in _bench.interleaved(samples, args.reps, "alternate"):
        samples[label].append(timed(lambda: variants[label]["step"](batches[(k + r) % len(batches)]), device))
    out["dynamo_end"] = dynamo_stats()
    med, low = _bench.medians(samples), _bench.fastest(samples)
    for label in ("eager", "compiled"):
        out[label] = {"median_step_s": med[label], "min_step_s": low[label], "tokens_per_s": tokens / med[label],
                      "steps_s": samples[label]}
        if args.peak_tflops:
            out[label]["mfu"] = out["flops_per_token"] * tokens / med[label] / (args.peak_tflops * 1e12)
    med_c = out["compiled"]["median_step_s"]
    out["compile_s"] = sum(t - med_c for t in out["first_calls_s"]["compiled"])
    out["speedup"] = out["eager"]["median_step_s"] / med_c
    # Per-round ratios (the two steps of a round ran back to back) and the ratio of the fastest steps: both are
    # steadier than the ratio of medians when the machine's load drifts during the run.
    out["speedup_paired_median"] = _bench.paired_median(samples["eager"], samples["compiled"])
    out["speedup_min"] = out["eager"]["min_step_s"] / out["compiled"]["min_step_s"]
    first_graphs = out["dynamo_after_call"][0]["unique_graphs"]
    out["graphs_after_first_call"] = out["dynamo_end"]["unique_graphs"] - first_graphs  # recompilations
    return out


def table(rows: list[dict]) -> str:
    head = ("model", "path", "eager tok/s", "compiled tok/s", "compiled / eager (medians)", "paired", "fastest",
            "compile time s", "graphs after 1st call / end", "graph breaks")
    mfu = all("mfu" in r["eager"] for r in rows)
    head += ("MFU eager", "MFU compiled") if mfu else ()
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["model"], r["path"], f"{r['eager']['tokens_per_s']:.0f}", f"{r['compiled']['tokens_per_s']:.0f}",
            f"{r['speedup']:.3f}", f"{r['speedup_paired_median']:.3f}", f"{r['speedup_min']:.3f}",
            f"{r['compile_s']:.1f}",
            f"{r['dynamo_after_call'][0]['unique_graphs']} / {r['dynamo_end']['unique_graphs']}",
            str(r["dynamo_end"]["graph_breaks"]),
        ] + ([f"{r['eager']['mfu']:.3f}", f"{r['compiled']['mfu']:.3f}"] if mfu else [])) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = _bench.parser(__doc__, whole=True)
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=list(MODEL_CONFIGS))
    parser.add_argument("--paths", nargs="+", default=["plain", "2bw"], choices=["plain", "delayed-ef", "2bw"])
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES)
    _bench.add_device(parser)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=2, help="m of the 2bw runtime path")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--autocast", default=None, choices=["bf16"], help="bf16 autocast of the forwards")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="device peak, e.g. 989 for H200 dense bf16: adds MFU (6N + 12LHT FLOPs/token)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="disable Inductor's FX-graph and AOT-autograd caches (cold compile time)")
    _bench.add_json(parser)
    args = parser.parse_args()
    if args.no_compile_cache:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    rows = []
    for name in args.models:
        vocab = model_config(name).vocab_size
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g).to(device) for _ in range(4)]
        for path in args.paths:
            r = compare(name, path, args, device, batches)
            rows.append(r)
            print(f"{name} {path}: eager {r['eager']['tokens_per_s']:.0f} tok/s, compiled "
                  f"{r['compiled']['tokens_per_s']:.0f} tok/s (x{r['speedup']:.3f}, "
                  f"paired x{r['speedup_paired_median']:.3f}), compile {r['compile_s']:.1f} s, "
                  f"dynamo graphs per call {[d['unique_graphs'] for d in r['dynamo_after_call']]} -> "
                  f"{r['dynamo_end']['unique_graphs']} at the end"
                  + (f", MFU eager {r['eager']['mfu']:.3f}, compiled {r['compiled']['mfu']:.3f}"
                     if args.peak_tflops else ""),
                  flush=True)
    print()
    print(table(rows))
    total = time.perf_counter() - t0
    print(f"\ndevice {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, {total:.0f} s in total")
    if args.json:
        _bench.write_json(args.json, {"settings": vars(args), "torch": torch.__version__,
                                      "threads": torch.get_num_threads(), "seconds": total, "rows": rows})


if __name__ == "__main__":
    main()
