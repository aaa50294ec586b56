"""Overhead of the delayed update and of each staleness correction, for every optimizer in the zoo.

For each optimizer: bare, ``DelayedOptimizer(opt, delay=1)`` and with Error Feedback, each with
``pairing="fifo"`` and ``"2bw"``, and (2bw) each other correction of ``lightning_async.optim.corrections``
(adaptive EF, the Nesterov-style look-ahead, DC-ASGD, weight prediction), compared with bare and with EF
in the same run. Times a full training step
(forward + backward + optimizer step + zero_grad) and the optimizer step alone, as ratios to bare
within one run; repetitions are interleaved (every variant once per round, in a shuffled order)
so drifts in machine load hit all variants alike. Memory: on CUDA the peak allocated during a few
steps of each variant alone; everywhere, the bytes of persistent buffers the wrapper holds between
steps (gradient queue, stashed weight versions, the correction's buffers) relative to the parameter bytes.

    python benchmarks/optim_overhead.py --model tiny --device cpu --json overhead.json
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

import _bench
from _bench import sync
from lightning_async.models import SmolLM2, model_config
from lightning_async.optim import CORRECTIONS, DelayedOptimizer, build_correction
from lightning_async.optim.zoo import OPTIMIZER_NAMES, build_optimizer

VARIANTS = {
    "bare": None,
    "delay-fifo": dict(delay=1, pairing="fifo"),
    "delay-2bw": dict(delay=1, pairing="2bw"),
    "delay+EF-fifo": dict(delay=1, error_feedback=1.0, pairing="fifo"),
    "delay+EF-2bw": dict(delay=1, error_feedback=1.0, pairing="2bw"),
    **{f"+{method}-2bw": dict(delay=1, pairing="2bw", correction=method) for method in CORRECTIONS if method != "ef"},
}
EF = "delay+EF-2bw"  # the reference of the "x EF" columns
LR = {"muon": 0.02, "normuon": 0.02, "lion": 3e-4}


def make(name: str, base: SmolLM2, variant: dict | None):
    model = copy.deepcopy(base)
    opt = build_optimizer(name, model.named_parameters(), lr=LR.get(name, 1e-3), weight_decay=0.1)
    if variant is not None:
        variant = dict(variant)
        method = variant.pop("correction", None)
        opt = DelayedOptimizer(opt, **variant, correction=build_correction(method) if method else None)
    return model, opt


def train_step(model, opt, batch, device) -> tuple[float, float]:
    """Seconds of the whole step and of ``opt.step()`` alone."""
    sync(device)
    t0 = time.perf_counter()
    logits = model(batch[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
    sync(device)
    t1 = time.perf_counter()
    opt.step()
    sync(device)
    t2 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - t0, t2 - t1


def wrapper_bytes(model, opt) -> int:
    """Persistent bytes the delay wrapper holds beyond the parameters themselves."""
    if not isinstance(opt, DelayedOptimizer):
        return 0
    params = {p.data.data_ptr() for p in model.parameters()}
    tensors = [t for grads in opt._grad_queue for t in grads if t is not None]
    tensors += opt.weight_versions()
    tensors += opt.correction.buffers()
    seen, total = set(), 0
    for t in tensors:
        ptr = t.data_ptr()
        if ptr in params or ptr in seen:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total


def state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def main() -> None:
    parser = _bench.parser(__doc__, whole=True)
    parser.add_argument("--model", default="tiny", choices=["nano", "tiny", "small", "smollm2-135m"])
    _bench.add_device(parser)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZER_NAMES), choices=OPTIMIZER_NAMES)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=12)
    _bench.add_json(parser, "write the results here")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = model_config(args.model)
    with torch.device(device):
        base = SmolLM2(cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen).to(device) for _ in range(4)]
    rows = []
    print(f"model={args.model} device={device} batch={args.batch}x{args.seq} params={param_bytes / 2**20:.1f} MiB "
          f"torch={torch.__version__} threads={torch.get_num_threads()}")
    header = (f"{'optimizer':9} {'variant':24} {'step ms':>8} {'x bare':>7} {'x EF':>6} {'opt ms':>8} {'x bare':>7} {'x EF':>6} "
              f"{'buffers/params':>14} {'peak MiB':>9}")
    print(header)
    print("-" * len(header))
    for name in args.optimizers:
        runs = {v: make(name, base, spec) for v, spec in VARIANTS.items()}
        fulls, steps = {v: [] for v in VARIANTS}, {v: [] for v in VARIANTS}
        for i in range(args.warmup):
            for v, (model, opt) in runs.items():
                train_step(model, opt, batches[i % len(batches)], device)
        for i, v in _bench.interleaved(VARIANTS, args.reps, "shuffle"):
            model, opt = runs[v]
            full, step = train_step(model, opt, batches[i % len(batches)], device)
            fulls[v].append(full)
            steps[v].append(step)
        extra = {v: wrapper_bytes(*runs[v]) / param_bytes for v in VARIANTS}
        opt_state = state_bytes(runs["bare"][1]) / param_bytes
        del runs
        peaks = {}
        if device.type == "cuda":
            for v, spec in VARIANTS.items():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                model, opt = make(name, base, spec)
                for i in range(3):
                    train_step(model, opt, batches[i], device)
                peaks[v] = torch.cuda.max_memory_allocated(device) / 2**20
                del model, opt
        fulls, steps = _bench.medians(fulls), _bench.medians(steps)
        bare_full, bare_step = fulls["bare"], steps["bare"]
        ef_full, ef_step = fulls[EF], steps[EF]
        for v in VARIANTS:
            full, step = fulls[v], steps[v]
            row = dict(optimizer=name, variant=v, step_ms=1e3 * full, step_ratio=full / bare_full, step_vs_ef=full / ef_full,
                       opt_ms=1e3 * step, opt_ratio=step / bare_step, opt_vs_ef=step / ef_step, buffer_ratio=extra[v],
                       optimizer_state_ratio=opt_state, peak_mib=peaks.get(v))
            rows.append(row)
            peak = f"{peaks[v]:9.1f}" if v in peaks else f"{'-':>9}"
            print(f"{name:9} {v:24} {row['step_ms']:8.1f} {row['step_ratio']:7.3f} {row['step_vs_ef']:6.3f} "
                  f"{row['opt_ms']:8.2f} {row['opt_ratio']:7.3f} {row['opt_vs_ef']:6.3f} {extra[v]:14.2f} {peak}")
        print(f"{'':9} (optimizer state: {opt_state:.2f} x parameter bytes)")
    if args.json:
        _bench.write_json(args.json, dict(model=args.model, device=str(device), batch=args.batch, seq=args.seq,
                                          reps=args.reps, rows=rows))


if __name__ == "__main__":
    main()
