"""Every code path of the pipeline runtime that one device reaches, run on that device against its reference rule.

One GPU cannot host two NCCL ranks, but a pipeline of one stage (world size 1, ``pipeline_parallel_size`` 1) runs
the whole runtime on it: the rank's plan and build (``pipeline.rank.plan_rank`` / ``build``, inside a one-process
gloo or NCCL group), the weight versions and their swaps under the forward, the update pipeline (clipping, the
delayed step), the evaluation, the memory report. Each path trains a small SmolLM2 (``--model``: ``small`` on CUDA,
``tiny`` on the CPU) for ``--steps`` batches of ``--microbatches`` micro-batches (a batch of half the size in the
middle: the runtime drains and restarts, except on the compiled path, which would recompile), drains, evaluates,
and compares the newest weights and the evaluation loss with the single-device run of the rule it must follow:

* ``swap``: ``WeightSwap`` (what every training forward goes through): forward and backward of the whole model on
  two perturbed weight lists, against ``torch.func.functional_call`` on copies of the same lists;
* ``2bw-adamw``: 2BW (two weight versions, swapped under the forward), AdamW (foreach), fp32, clipping, against
  ``DelayedOptimizer(delay=1, pairing="2bw")``;
* ``2bw-fused``: the same with ``build_optimizer("adamw", ..., fused=True)`` on both sides; the fused kernel's calls
  are counted (a silent fall-back to foreach fails);
* ``2bw-bf16``: the same under ``torch.autocast(device, bfloat16)``, without clipping, against the same rule under
  the same autocast;
* ``1f1b-muon``: 1F1B (one version, no delay) with ``build_optimizer("muon", ...)`` (BatchedMuon, fp32
  Newton-Schulz), clipping, against plain training;
* ``pipedream``: PipeDream with one stage (no delay, one version), AdamW, no clipping (refused with its per-stage
  delays), against plain training;
* ``2bw-compiled``: 2BW with every decoder block ``nn.Module.compile()``d in place (the weights swapped under the
  compiled code), against the 2BW rule with its blocks compiled alike; Dynamo's compiled frames are counted.

Tolerances: 2e-5 in fp32 (the CPU oracle's, ``tests/pipeline/test_pipeline_oracle.py``; one stage on one device
runs the same operations on the same micro-batches as the reference, in the same order, except the clipping norm,
which the runtime sums in its own order: 1.2e-7 after 8 steps on the CPU). Under bf16 that one-ulp difference of the
clipping coefficient grows: a weight one ulp off can round to another bf16 value in the next forward, and Adam
turns the changed gradients into weight differences near lr; measured on the CPU, 4.1e-4 after 8 steps (fp32:
1.2e-7). So the bf16 path runs without clipping (the fp32 paths run it), and then both sides run the same bf16
kernels on the same tensors: 0 on the CPU. Its tolerance ``steps x lr x 2^-8`` (9.4e-5 for 8 steps at lr 3e-3,
the budget ``tests/pipeline/test_fused_bf16_compiled.py`` argues for a bf16 rounding flipped once per step) leaves
room for a kernel that is not deterministic; the bf16 reference is also run twice, and the tolerance is at least
twice the distance between those two runs (a pipeline cannot be asked to be closer to the reference than the
reference is to itself). On CUDA the script turns ``torch.use_deterministic_algorithms(True, warn_only=True)`` on
(``--nondeterministic``: off), so that flash attention's backward, say, accumulates in a fixed order. The compiled
path is compared with a reference whose blocks are compiled with the same backend (the same kernels; Inductor rounds
fp32 otherwise than eager), at 2e-5; its distance to the eager reference is printed too. ``swap``: 1e-6 (the same
kernels on the same tensors: bitwise on the CPU).

Every check has a negative control that must be at least 10 x the tolerance away, so a comparison that cannot tell
right from wrong fails: the delayed paths against plain training, the synchronous ones against the delayed rule,
bf16 against the fp32 run of its rule (autocast must have changed something), ``swap`` between the two weight lists.

Memory: ``runtime.memory_report()`` (weight versions + optimizer state + correction buffers, the static bytes it
accounts) against ``torch.cuda.max_memory_allocated()`` over the path's pipeline run (from a reset, less what was
allocated before): the accounted bytes must fit inside the measured peak (the peak adds gradients, activations and
temporaries). The report itself must add up: the versions hold ``versions x parameters`` bytes, the optimizer state
at least 2 x (AdamW's moments) or 1 x (Muon's momentum) the parameters, nothing is in flight after the drain; off
CUDA only these run. The table's ``report`` column is the accounted bytes, ``peak`` the measured one. ``steps/s``:
training calls after the first two (the compiled path's first calls compile), the device synchronised around each;
``ref steps/s`` likewise for the reference.

    python benchmarks/one_gpu_paths.py --device cuda --json runs/one_gpu_paths.json
    python benchmarks/one_gpu_paths.py --device cpu --paths swap 2bw-adamw

Exit status 1 when any path fails (its row says why), 0 otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import _bench
from lightning_async.models import SmolLM2, model_config
from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import DelayedOptimizer, build_optimizer
from lightning_async.pipeline.boundary import split_rows
from lightning_async.pipeline.groups import release_process_groups
from lightning_async.pipeline.rank import build, plan_rank
from lightning_async.pipeline.weight_swap import WeightSwap

FP32_TOLERANCE = 2e-5
SWAP_TOLERANCE = 1e-6
CONTROL_FACTOR = 10  # a negative control must be at least this many tolerances away
LRS = {"adamw": 3e-3, "muon": 2e-2}
WEIGHT_DECAY = 0.1
STATE_PER_PARAMETER_BYTE = {"adamw": 2, "muon": 1}  # at least: AdamW's two moments; Muon's momentum (AdamW's elsewhere)
CLIP = 1.0


@dataclasses.dataclass(frozen=True)
class Path:
    """A pipeline path: its schedule, optimizer and settings, and the rule of its reference."""

    schedule: str
    optimizer: str = "adamw"
    optimizer_kwargs: tuple = ()  # (key, value) pairs
    bf16: bool = False
    compiled: bool = False
    clip: float | None = CLIP

    @property
    def delay(self) -> int:
        return 1 if self.schedule == "2bw" else 0


MUON_KWARGS = (("ns_dtype", torch.float32),)  # fp32 Newton-Schulz: bf16 would turn 1e-7 differences into 1e-3
PATHS: dict[str, Path | None] = {
    "swap": None,  # (not a pipeline run: see check_swap)
    "2bw-adamw": Path("2bw"),
    "2bw-fused": Path("2bw", optimizer_kwargs=(("fused", True),)),
    "2bw-bf16": Path("2bw", bf16=True, clip=None),  # (why without clipping: the module's docstring)
    "1f1b-muon": Path("1f1b", optimizer="muon", optimizer_kwargs=MUON_KWARGS),
    "pipedream": Path("pipedream", clip=None),
    "2bw-compiled": Path("2bw", compiled=True),  # last: the slowest to start
}


@dataclasses.dataclass(frozen=True)
class Setup:
    device: torch.device
    model: str
    steps: int
    batch: int
    seq_len: int
    microbatches: int
    compile_backend: str

    def autocast(self, bf16: bool) -> Callable:
        if not bf16:
            return contextlib.nullcontext
        return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------- workload
def make_model(setup: Setup, compiled: bool = False) -> SmolLM2:
    torch.manual_seed(0)
    model = SmolLM2(model_config(setup.model)).to(setup.device)
    if compiled:  # the decoder blocks, in place (names unchanged), as CausalLM(compile=True) compiles them
        for block in model.blocks:
            block.compile(backend=setup.compile_backend)
    return model


def make_batches(setup: Setup, vocab: int, shrink: bool) -> list[torch.Tensor]:
    """``steps`` token batches; with ``shrink`` the middle one has half the rows (a new shape: the runtime drains)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (setup.batch, setup.seq_len + 1), generator=g) for _ in range(setup.steps)]
    if shrink and setup.steps > 2:
        batches[setup.steps // 2] = batches[setup.steps // 2][: setup.batch // 2]
    return [b.to(setup.device) for b in batches]


def eval_batch(setup: Setup, vocab: int, odd: bool) -> torch.Tensor:
    """The evaluation batch: 7 rows (not divisible by the micro-batch count) unless ``odd`` is False."""
    rows = 7 if odd else setup.batch
    g = torch.Generator().manual_seed(9)
    return torch.randint(0, vocab, (rows, setup.seq_len + 1), generator=g).to(setup.device)


def make_optimizer(path: Path, named_parameters) -> torch.optim.Optimizer:
    return build_optimizer(path.optimizer, list(named_parameters), lr=LRS[path.optimizer], weight_decay=WEIGHT_DECAY,
                           **dict(path.optimizer_kwargs))


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)  # a changing lr: each delayed update must use the lr of its own batch


@contextlib.contextmanager
def counting_fused_adamw():
    """Count the fused AdamW kernel's calls (``torch.optim.adam`` looks ``torch._fused_adamw_`` up at every step)."""
    calls = {"n": 0}
    kernel = torch._fused_adamw_

    def counted(*args, **kwargs):
        calls["n"] += 1
        return kernel(*args, **kwargs)

    torch._fused_adamw_ = counted
    try:
        yield calls
    finally:
        torch._fused_adamw_ = kernel


def steps_per_second(times: list[float]) -> float | None:
    warm = times[2:] if len(times) > 2 else times
    return len(warm) / sum(warm) if warm and sum(warm) > 0 else None


def max_diff(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    missing = set(weights) - set(reference)
    if missing:
        raise KeyError(f"weights without a reference: {sorted(missing)[:5]}")
    return max((weights[n].float() - reference[n].float()).abs().max().item() for n in weights)


# ---------------------------------------------------------------------------------------------- reference
def reference_run(setup: Setup, path: Path, delay: int, bf16: bool, compiled: bool) -> dict:
    """The single-device run of the rule: ``DelayedOptimizer(delay, pairing="2bw")`` (``delay`` 0: the optimizer
    itself), the gradient summed over the same micro-batches, the same clipping and lr schedule. Returns the newest
    weights by name, the evaluation loss and the training calls' times."""
    device = setup.device
    autocast = setup.autocast(bf16)
    model = make_model(setup, compiled)
    vocab = model.config.vocab_size
    opt = make_optimizer(path, model.named_parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    stepper = DelayedOptimizer(opt, delay=delay, pairing="2bw") if delay else opt
    m = setup.microbatches

    def step(batch):
        for chunk in split_rows(batch, m):
            inputs, targets = split_next_token(chunk)
            with autocast():
                loss = next_token_loss(model(inputs), targets)
            (loss / m).backward()
        if path.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), path.clip)
        stepper.step()
        stepper.zero_grad()
        sched.step()

    times = [_bench.timed(lambda: step(b), device) for b in make_batches(setup, vocab, shrink=not path.compiled)]
    if delay:
        newest = {id(p): w for p, w in zip(stepper.params, stepper.newest_weights())}
        for p in model.parameters():
            p.data = newest[id(p)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    inputs, targets = split_next_token(eval_batch(setup, vocab, odd=not path.compiled))
    total = 0.0
    with torch.no_grad(), autocast():  # the pipeline's evaluation: micro-batches cut alike, weighted by rows
        for x, y in zip(split_rows(inputs, m, even=False), split_rows(targets, m, even=False)):
            total = total + next_token_loss(model(x), y).float() * len(x)
    weights["eval_loss"] = total / len(inputs)
    return {"weights": weights, "times": times}


# ---------------------------------------------------------------------------------------------- pipeline
def pipeline_run(setup: Setup, path: Path) -> dict:
    """A one-stage pipeline of ``path`` built as the strategy builds one (``plan_rank`` then ``build``) on the
    device; its newest weights and evaluation loss, the training calls' times, the memory report and peak."""
    device = setup.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    if path.compiled:
        torch._dynamo.reset()
    from torch._dynamo.utils import counters

    frames_before = counters["frames"]["ok"]
    model = make_model(setup, path.compiled)
    vocab = model.config.vocab_size
    units = list(model.pipeline_units())
    plan = plan_rank(units, path.schedule, setup.microbatches, rank=0, world_size=1, pipeline_parallel_size=1)
    opt = make_optimizer(path, plan.named_parameters)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    built = build(plan, opt, split_next_token, next_token_loss, gradient_clip_val=path.clip, device=device,
                  autocast=setup.autocast(path.bf16), context_fn=model.pipeline_context)
    runtime = built.runtime
    allocated_after_build = torch.cuda.memory_allocated(device) - base if cuda else None
    times = []
    with counting_fused_adamw() as fused:
        for batch in make_batches(setup, vocab, shrink=not path.compiled):
            times.append(_bench.timed(lambda: runtime.train_batch(batch), device))
            sched.step()
        runtime.drain()
    by_param = {id(p): n for n, p in plan.named_parameters}
    weights = {by_param[id(p)]: p.detach().clone() for p in runtime.params}
    weights["eval_loss"] = runtime.eval_batch(eval_batch(setup, vocab, odd=not path.compiled)).float()
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    report = runtime.memory_report()
    on_device = all(p.device.type == device.type for p in runtime.params) and all(
        t.device.type == device.type for state in opt.state.values() for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"weights": weights, "times": times, "report": report, "peak": peak, "after_build": allocated_after_build,
            "versions": runtime.versions.clock.versions, "fused_calls": fused["n"],
            "frames": counters["frames"]["ok"] - frames_before, "on_device": on_device}


def check_pipeline(setup: Setup, name: str, path: Path, references: dict) -> dict:
    def reference(delay: int, bf16: bool, compiled: bool) -> dict:
        key = (path.optimizer, path.optimizer_kwargs, path.clip, path.compiled, delay, bf16, compiled)
        if key not in references:
            references[key] = reference_run(setup, path, delay, bf16, compiled)
        return references[key]

    run = pipeline_run(setup, path)
    ref = reference(path.delay, path.bf16, path.compiled)
    diff = max_diff(run["weights"], ref["weights"])
    notes = []
    if path.bf16:
        tolerance = setup.steps * LRS[path.optimizer] * 2.0**-8
        control_name, control = "fp32 reference", max_diff(run["weights"], reference(path.delay, False, False)["weights"])
        rerun = max_diff(reference_run(setup, path, path.delay, True, False)["weights"], ref["weights"])
        notes.append(f"reference rerun {rerun:.2e}")
        if control < CONTROL_FACTOR * tolerance:
            notes.append(f"FAIL: control ({control_name}) only {control:.2e} away")
        tolerance = max(tolerance, 2 * rerun)  # no closer than the reference to itself (a nondeterministic kernel)
    else:
        tolerance = FP32_TOLERANCE
        other = 0 if path.delay else 1
        control_name = "plain training" if path.delay else "2bw rule"
        control = max_diff(run["weights"], reference(other, False, path.compiled)["weights"])
        if control < CONTROL_FACTOR * tolerance:
            notes.append(f"FAIL: control ({control_name}) only {control:.2e} away")
    if path.compiled:
        notes.append(f"vs eager reference {max_diff(run['weights'], reference(path.delay, False, False)['weights']):.2e}")
        if run["frames"] < 1:
            notes.append("FAIL: nothing was compiled")
    if dict(path.optimizer_kwargs).get("fused"):
        notes.append(f"fused kernel calls {run['fused_calls']}")
        if run["fused_calls"] < 1:
            notes.append("FAIL: the fused kernel never ran")
    if not run["on_device"]:
        notes.append(f"FAIL: weights or optimizer state off {setup.device.type}")
    report = run["report"]
    accounted = report["weight_versions"] + report["optimizer_state"] + report["correction"]
    if report["weight_versions"] != run["versions"] * report["parameters"]:
        notes.append(f"FAIL: weight_versions {report['weight_versions']} != {run['versions']} x {report['parameters']}")
    if report["optimizer_state"] < STATE_PER_PARAMETER_BYTE[path.optimizer] * report["parameters"]:
        notes.append(f"FAIL: optimizer_state {report['optimizer_state']} B < {STATE_PER_PARAMETER_BYTE[path.optimizer]} x "
                     f"parameters")
    if report["in_flight_microbatches"]:
        notes.append(f"FAIL: {report['in_flight_microbatches']} micro-batches in flight after the drain")
    if run["peak"] is not None and accounted > run["peak"]:
        notes.append(f"FAIL: accounted {accounted} B > measured peak {run['peak']} B")
    ok = diff <= tolerance and not any(n.startswith("FAIL") for n in notes)
    return {
        "path": name, "schedule": path.schedule, "optimizer": path.optimizer, "max_diff": diff, "tolerance": tolerance,
        "control": control_name, "control_diff": control, "steps_per_s": steps_per_second(run["times"]),
        "ref_steps_per_s": steps_per_second(ref["times"]), "first_call_s": run["times"][0],
        "memory_report": report, "accounted_bytes": accounted, "peak_allocated_bytes": run["peak"],
        "allocated_after_build_bytes": run["after_build"], "versions": run["versions"], "notes": notes,
        "status": "PASS" if ok else "FAIL",
    }


# ---------------------------------------------------------------------------------------------- weight swap
def check_swap(setup: Setup) -> dict:
    """``WeightSwap`` over the whole model (tied embedding and head included): forward and backward on two weight
    lists equal ``torch.func.functional_call`` on copies of them, and the module gets its own parameters back."""
    device = setup.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    model = make_model(setup)
    named = dict(model.named_parameters())
    position = {id(p): i for i, p in enumerate(named.values())}
    index = {n: position[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    own = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    swap = WeightSwap(model, index)
    g = torch.Generator(device="cpu").manual_seed(3)
    slots = [[(p.detach() + 0.01 * k * torch.randn(p.shape, generator=g).to(device)).requires_grad_(True)
              for p in named.values()] for k in range(2)]
    inputs, targets = split_next_token(make_batches(setup, model.config.vocab_size, shrink=False)[0])
    diff, losses, times = 0.0, [], []
    for rep in range(4):
        for slot in slots:
            for t in slot:
                t.grad = None

            def swapped():
                with swap.using(slot):
                    loss = next_token_loss(model(inputs), targets)
                loss.backward()
                return loss

            times.append(_bench.timed(swapped, device))
        if rep:
            continue
        for slot in slots:  # the last call's gradients, against functional_call's
            for t in slot:
                t.grad = None
            with swap.using(slot):
                loss = next_token_loss(model(inputs), targets)
            loss.backward()
            copies = [t.detach().clone().requires_grad_(True) for t in slot]
            expected = next_token_loss(
                torch.func.functional_call(model, {n: copies[i] for n, i in index.items()}, (inputs,)), targets)
            expected.backward()
            diff = max(diff, (loss - expected).abs().item(),  # (a list that got no gradient: infinitely far)
                       *(float("inf") if a.grad is None else (a.grad - b.grad).abs().max().item()
                         for a, b in zip(slot, copies)))
            losses.append(loss.item())
    notes = []
    if {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)} != own:
        notes.append("FAIL: the module's parameters did not come back")
    if any(p.grad is not None for p in model.parameters()):
        notes.append("FAIL: the module's own parameters got a gradient")
    control = abs(losses[0] - losses[1])
    if control < CONTROL_FACTOR * SWAP_TOLERANCE:
        notes.append(f"FAIL: the two weight lists give the same loss ({control:.2e})")
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    ok = diff <= SWAP_TOLERANCE and not notes
    return {"path": "swap", "schedule": "-", "optimizer": "-", "max_diff": diff, "tolerance": SWAP_TOLERANCE,
            "control": "other weight list", "control_diff": control, "steps_per_s": steps_per_second(times),
            "ref_steps_per_s": None, "first_call_s": times[0], "memory_report": None, "accounted_bytes": None,
            "peak_allocated_bytes": peak, "allocated_after_build_bytes": None, "versions": 2, "notes": notes,
            "status": "PASS" if ok else "FAIL"}


# ---------------------------------------------------------------------------------------------- process group
@contextlib.contextmanager
def one_process_group(backend: str, device: torch.device):
    """A default group of one process (as Lightning makes one), unless there is one or ``backend`` is ``none``.
    With one rank the pipeline makes no groups of its own; NCCL is checked with one all-reduce."""
    made = False
    info = {"backend": backend, "all_reduce_ok": None, "error": None}
    if backend != "none" and not (dist.is_available() and dist.is_initialized()):
        try:  # (a group that cannot start is reported; the paths run without it, as one rank needs none)
            kwargs = {"device_id": device} if backend == "nccl" else {}
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
            made = True
            x = torch.full((4,), 2.0, device=device if backend == "nccl" else "cpu")
            dist.all_reduce(x)
            info["all_reduce_ok"] = bool((x == 2.0).all().item())
        except Exception:
            traceback.print_exc()
            info["error"] = traceback.format_exc(limit=1).splitlines()[-1]
    try:
        yield info
    finally:
        if made:  # (gloo's threads joined now, not at the interpreter's exit)
            release_process_groups()


# ---------------------------------------------------------------------------------------------- table
def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}M"


def fmt(x, spec: str = ".2e") -> str:
    return "-" if x is None else format(x, spec)


def print_row(row: dict, header: bool = False) -> None:
    cols = f"{'path':13} {'max|dw|':>9} {'tol':>8} {'control':>9} {'steps/s':>8} {'ref st/s':>8} {'1st s':>6} " \
           f"{'report':>8} {'peak':>8} {'status':6} notes"
    if header:
        print(cols)
        print("-" * len(cols))
        return
    print(f"{row['path']:13} {fmt(row['max_diff']):>9} {fmt(row['tolerance']):>8} {fmt(row['control_diff']):>9} "
          f"{fmt(row['steps_per_s'], '.1f'):>8} {fmt(row['ref_steps_per_s'], '.1f'):>8} {fmt(row['first_call_s'], '.2f'):>6} "
          f"{fmt_bytes(row['accounted_bytes']):>8} {fmt_bytes(row['peak_allocated_bytes']):>8} {row['status']:6} "
          f"{'; '.join(row['notes'])}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = _bench.parser(__doc__, whole=True)
    _bench.add_device(parser)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--model", default=None, help="model config (default: small on CUDA, tiny elsewhere)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=None, help="rows per batch (default: 8 on CUDA, 4 elsewhere)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 128 on CUDA, 16 elsewhere")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl", "none"],
                        help="the one-process default group (default: nccl on CUDA, gloo elsewhere)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend of the compiled path (default: inductor on CUDA, aot_eager "
                             "elsewhere: Inductor compiles for minutes on a small CPU)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="leave torch.use_deterministic_algorithms off on CUDA (on by default: see the docstring)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: 1 on the CPU, where a loaded machine makes two threads "
                             "wait on each other; torch's default on CUDA)")
    _bench.add_json(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    deterministic = cuda and not args.nondeterministic
    if deterministic:  # (before cuBLAS starts: its deterministic workspaces)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    threads, old_threads = args.threads or (None if cuda else 1), torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    setup = Setup(device, args.model or ("small" if cuda else "tiny"), args.steps, args.batch or (8 if cuda else 4),
                  args.seq_len or (128 if cuda else 16), args.microbatches,
                  args.compile_backend or ("inductor" if cuda else "aot_eager"))
    backend = args.backend or ("nccl" if cuda else "gloo")
    meta = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "model": setup.model, "steps": setup.steps, "batch": setup.batch,
            "seq_len": setup.seq_len, "microbatches": setup.microbatches, "compile_backend": setup.compile_backend,
            "process_group": backend, "deterministic": deterministic, "threads": torch.get_num_threads()}
    print(" ".join(f"{k}={v}" for k, v in meta.items()), flush=True)
    t0 = time.perf_counter()
    rows: list[dict] = []

    def save() -> None:  # after every row: a run stopped by its time limit keeps what it finished
        if args.json:
            _bench.write_json(args.json, {**meta, "seconds": time.perf_counter() - t0, "rows": rows})

    print_row({}, header=True)
    was_deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with one_process_group(backend, device) as group, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before")  # (2BW's first call)
            meta["all_reduce_ok"] = group["all_reduce_ok"]
            if group["error"]:
                rows.append({"path": "process-group", "status": "FAIL", "notes": [group["error"]]})
            references: dict = {}
            for name in args.paths:
                t = time.perf_counter()
                try:
                    row = check_swap(setup) if PATHS[name] is None else check_pipeline(setup, name, PATHS[name], references)
                except Exception:
                    traceback.print_exc()
                    row = {"path": name, "max_diff": None, "tolerance": None, "control_diff": None, "steps_per_s": None,
                           "ref_steps_per_s": None, "first_call_s": None, "accounted_bytes": None,
                           "peak_allocated_bytes": None, "notes": [f"error: {traceback.format_exc(limit=1).splitlines()[-1]}"],
                           "status": "FAIL"}
                row["seconds"] = time.perf_counter() - t
                rows.append(row)
                print_row(row)
                save()
    except Exception:
        traceback.print_exc()
        rows.append({"path": "process-group", "status": "FAIL", "notes": [traceback.format_exc(limit=1).splitlines()[-1]]})
    finally:
        torch.use_deterministic_algorithms(was_deterministic[0], warn_only=was_deterministic[1])
        torch.set_num_threads(old_threads)
    if meta.get("all_reduce_ok") is False:
        rows.append({"path": "process-group", "status": "FAIL", "notes": ["one-rank all_reduce changed its input"]})
    failed = [r["path"] for r in rows if r["status"] != "PASS"]
    total = time.perf_counter() - t0
    print(f"{len(rows) - len(failed)}/{len(rows)} PASS in {total:.1f} s" + (f"; FAIL: {' '.join(failed)}" if failed else ""))
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
