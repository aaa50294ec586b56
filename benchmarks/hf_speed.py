"""Training speed of a Hugging Face Llama (``HFCausalLM``) against our own ``tiny`` ``CausalLM``, same shape.

Both models: hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 384, vocabulary 257, tied embeddings (the HF one
is ``recipes/models/hf-llama-tiny.yaml``; 820,480 parameters each). Measured in one run, interleaved round by
round (A, B, A, B, ...) so that a busy machine slows both alike. Reported: tokens/s of each model's fastest
round, and the ratio HF / ours as the median over rounds of the two adjacent rounds' ratio (1.0 = same speed;
robust to load that drifts during the run):

* ``single``: one process, one thread, AdamW, plain training steps (forward + backward + step);
* ``pipeline``: 2 gloo processes (one thread each), PipeDream-2BW (``PipelineRuntime``, schedule ``2bw``), both
  split before their third layer (embedding + 2 layers | 2 layers + final norm + head: the same work per stage;
  ``partition="uniform"`` would not give that, since the HF model's final norm is a unit of its own), the HF
  model with its ``pipeline_context``;
* ``units``: forward + backward time of one decoder layer/block and of the head, per micro-batch, to show
  where a gap comes from;
* ``one_vs_pipeline``: the mixture of experts of ``recipes/models/hf-moe-tiny.yaml`` (Mixtral, 8 experts, top-2,
  router load balancing on), and the dense HF Llama for comparison, on one device against a 2-stage 2BW pipeline
  (split before the third layer), in the same two processes, round by round: process 0 trains alone while
  process 1 waits, then both run the pipeline. The MoE trains the same objective both ways (the router losses
  per micro-batch). A third setting, one device running each batch as the pipeline's micro-batches (accumulated),
  separates the cost of smaller micro-batches (an MoE's experts see fewer tokens per call) from the pipeline's
  parallelism. Reported: tokens/s of each and the ratios pipeline / one device (median of adjacent rounds; 2.0
  would be two cores used perfectly). ``--only-moe`` runs just these rows.

    python benchmarks/hf_speed.py --json runs/hf_speed.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench  # noqa: E402
from lightning_async.lm import CausalLM  # noqa: E402
from lightning_async.models.objective import next_token_loss, split_next_token  # noqa: E402
from lightning_async.optim import build_optimizer  # noqa: E402
from lightning_async.pipeline.partition import partition_units  # noqa: E402
from lightning_async.pipeline.runtime import PipelineRuntime  # noqa: E402

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes", "models")
RECIPE = {"hf": os.path.join(RECIPES, "hf-llama-tiny.yaml"), "moe": os.path.join(RECIPES, "hf-moe-tiny.yaml")}
VOCAB = 257
MODELS = ("ours", "hf")
SECOND_STAGE_STARTS = {"ours": ["model.blocks.2"], "hf": ["model.model.layers.2"], "moe": ["model.model.layers.2"]}


def build(kind: str):
    """``ours`` (CausalLM tiny), ``hf`` (the HF Llama recipe) or ``moe`` (the HF Mixtral recipe)."""
    torch.manual_seed(0)
    if kind == "ours":
        return CausalLM(model="tiny", vocab_size=VOCAB)
    from lightning_async.models.hf import HFCausalLM

    with open(RECIPE[kind]) as f:
        config = yaml.safe_load(f)["model"]["init_args"]["model"]
    return HFCausalLM(config, vocab_size=VOCAB)


def batches(n: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=g) for _ in range(n)]


def optimizer(named):
    return build_optimizer("adamw", named, lr=1e-4, weight_decay=0.1)


def speeds(seconds: dict[str, list[float]], tokens: int, base: str = "ours", other: str = "hf") -> dict:
    """Tokens/s of each setting's fastest round and the median speed ratio ``other / base`` of adjacent rounds."""
    out = {k: tokens / t for k, t in _bench.fastest(seconds).items()}
    out["ratio"] = _bench.paired_median(seconds[base], seconds[other])
    out["rounds"] = seconds
    return out


# ---- one device ----------------------------------------------------------------------------------
def single_round(module, opt, data: list[torch.Tensor], microbatches: int = 1) -> float:
    """Seconds for the training steps on ``data`` (each batch as ``microbatches`` accumulated forward+backwards)."""
    start = time.perf_counter()
    for batch in data:
        for chunk in batch.chunk(microbatches):
            inputs, targets = split_next_token(chunk)
            (next_token_loss(module(inputs), targets) / microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def unit_times(module, batch: torch.Tensor, reps: int) -> dict[str, float]:
    """Median forward+backward seconds of the first decoder layer and of the head unit(s) on one batch."""
    from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, takes_context

    inputs, _ = split_next_token(batch)
    units = module.pipeline_units()
    context = module.pipeline_context(inputs) if hasattr(module, "pipeline_context") else NO_CONTEXT
    with torch.no_grad():
        hidden = units[0][1](inputs)
    heads = units[-2:] if len(units) > 6 else units[-1:]  # HF: norm + lm_head; ours: head (norm inside)
    times = {}
    for label, chosen in (("layer", [units[1]]), ("head", heads), ("context", None)):
        times[label] = []
        for _ in range(reps):
            x = hidden.detach().requires_grad_(True)
            t0 = time.perf_counter()
            if chosen is None:
                if context is not NO_CONTEXT:
                    module.pipeline_context(inputs)
            else:
                for _, unit in chosen:
                    x = call_unit(unit, x, context if takes_context(unit) else NO_CONTEXT)
                x.float().sum().backward()
            times[label].append(time.perf_counter() - t0)
        module.zero_grad(set_to_none=True)
    return _bench.medians(times)


def run_single(args) -> dict:
    torch.set_num_threads(1)
    data = batches(args.steps, args.batch_size, args.seq_len)
    modules = {k: build(k) for k in MODELS}
    opts = {k: optimizer(m.named_parameters()) for k, m in modules.items()}
    for k in MODELS:
        single_round(modules[k], opts[k], data[:2])  # warm-up
    seconds = {k: [] for k in MODELS}
    for _, k in _bench.interleaved(MODELS, args.rounds):
        seconds[k].append(single_round(modules[k], opts[k], data))
    out = speeds(seconds, args.steps * args.batch_size * args.seq_len)
    out["units"] = {k: unit_times(modules[k], data[0], reps=20) for k in MODELS}
    out["parameters"] = {k: modules[k].num_parameters() for k in MODELS}
    return out


# ---- 2-stage 2BW pipeline ------------------------------------------------------------------------
def print_ours_vs_hf(results: dict) -> None:
    rows = [("single device", results["single"])] + ([("2-stage 2BW pipeline", results["pipeline"])] if "pipeline" in results else [])
    print(f"{'setting':24s} {'ours tok/s':>12s} {'HF tok/s':>12s} {'HF / ours':>10s}")
    for label, r in rows:
        print(f"{label:24s} {r['ours']:12.0f} {r['hf']:12.0f} {r['ratio']:10.3f}")
    units = results["single"]["units"]
    print("\nper micro-batch forward+backward, ms (one thread):")
    for part in ("layer", "head", "context"):
        print(f"  {part:8s} ours {units['ours'][part] * 1e3:8.2f}   HF {units['hf'][part] * 1e3:8.2f}")


def stage_runtime(kind: str, stages: int, m: int) -> PipelineRuntime:
    rank = dist.get_rank()
    module = build(kind)
    if kind == "moe":
        module.moe.loss.one_forward_per_microbatch(m)  # as AsyncPipelineStrategy sets it up
    units = module.pipeline_units()
    return _bench.build_rank(units, "2bw", m, split_next_token, next_token_loss,
                             lambda plan: optimizer(plan.rank_stage.module.named_parameters()), rank=rank,
                             world_size=stages, stage_units=partition_units(units, stages, SECOND_STAGE_STARTS[kind]),
                             context_fn=module.pipeline_context).runtime


def pipeline_worker(args_dict: dict) -> dict:
    args = argparse.Namespace(**args_dict)
    data = batches(args.steps, args.batch_size, args.seq_len)
    runtimes = {k: stage_runtime(k, 2, args.microbatches) for k in MODELS}
    seconds = {k: [] for k in MODELS}
    for r, k in _bench.interleaved(MODELS, args.rounds + 1):
        elapsed = timed_pipeline_round(runtimes[k], data)
        if r:  # round 0 warms up
            seconds[k].append(elapsed)
    return speeds(seconds, args.steps * args.batch_size * args.seq_len)


# ---- mixture of experts: one device vs a 2-stage pipeline -----------------------------------------
def timed_pipeline_round(runtime: PipelineRuntime, data: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    for batch in data:
        runtime.train_batch(batch)
    runtime.drain()
    dist.barrier()
    return time.perf_counter() - start


ONE_VS_PIPELINE = ("moe", "hf")  # the MoE, and the dense HF Llama of the same shape for comparison


def one_vs_pipeline_worker(args_dict: dict) -> dict:
    """Per model, rounds of (process 0 alone on the whole model, the other waiting) then (both as a 2-stage 2BW
    pipeline); the models take turns round by round."""
    args = argparse.Namespace(**args_dict)
    data = batches(args.steps, args.batch_size, args.seq_len)
    first = dist.get_rank() == 0
    runtimes = {k: stage_runtime(k, 2, args.microbatches) for k in ONE_VS_PIPELINE}
    singles = {k: build(k) for k in ONE_VS_PIPELINE} if first else {}
    router_loss = singles["moe"].moe.loss if first else None  # set per setting so each trains the pipeline's objective
    opts = {k: optimizer(m.named_parameters()) for k, m in singles.items()}
    seconds = {k: {"single": [], "microbatched": [], "pipeline": []} for k in ONE_VS_PIPELINE}
    for r, k in _bench.interleaved(ONE_VS_PIPELINE, args.rounds + 1):
        dist.barrier()
        alone = chunked = 0.0
        if first:
            router_loss.whole_batch_per_forward(args.microbatches)
            alone = single_round(singles[k], opts[k], data)
            router_loss.one_forward_per_microbatch(args.microbatches)
            chunked = single_round(singles[k], opts[k], data, args.microbatches)
        dist.barrier()
        both = timed_pipeline_round(runtimes[k], data)
        if r:  # round 0 warms up
            for setting, elapsed in (("single", alone), ("microbatched", chunked), ("pipeline", both)):
                seconds[k][setting].append(elapsed)
    if not first:
        return {}  # process 1 timed nothing alone; process 0 reports
    tokens = args.steps * args.batch_size * args.seq_len
    out = {k: speeds(seconds[k], tokens, base="single", other="pipeline") for k in ONE_VS_PIPELINE}
    for k in ONE_VS_PIPELINE:
        out[k]["ratio_microbatched"] = speeds(seconds[k], tokens, base="microbatched", other="pipeline")["ratio"]
        out[k]["parameters"] = singles[k].num_parameters()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = _bench.parser(__doc__)
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    _bench.add_rounds(parser, 5, "rounds per model (median reported)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--skip-moe", action="store_true", help="leave out the MoE rows")
    parser.add_argument("--only-moe", action="store_true", help="only the MoE rows")
    _bench.add_json(parser, "write the results here")
    args = parser.parse_args(argv)
    results: dict = {"args": vars(args)}
    if not args.only_moe:
        results["single"] = run_single(args)
        if not args.skip_pipeline:
            results["pipeline"] = _bench.spawn(2, pipeline_worker, vars(args), timeout=1800)[0]
        print_ours_vs_hf(results)
    if not args.skip_moe:
        results["one_vs_pipeline"] = rows = _bench.spawn(2, one_vs_pipeline_worker, vars(args), timeout=3600)[0]
        print(f"\n{'model':38s} {'one device':>10s} {'one, m µb':>10s} {'2-stage 2BW':>12s} {'pipeline / one':>15s} "
              f"{'pipeline / one, m µb':>21s}   (tokens/s)")
        for k, label in (("moe", "MoE (hf-moe-tiny)"), ("hf", "dense (hf-llama-tiny)")):
            r = rows[k]
            name = f"{label}, {r['parameters']:,} params"
            print(f"{name:38s} {r['single']:10.0f} {r['microbatched']:10.0f} {r['pipeline']:12.0f} {r['ratio']:15.3f} "
                  f"{r['ratio_microbatched']:21.3f}")
    if args.json:
        _bench.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
