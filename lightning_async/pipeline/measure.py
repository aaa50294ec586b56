"""Measuring pipeline units with torch: forward and backward seconds, and the bytes autograd saves.

Two users: :func:`~lightning_async.pipeline.partition.partition_units` balances stages on
:func:`measure_unit_times` (``partition="time"``), and ``lightning-async plan`` (and the memory benchmark)
sizes a model with :func:`measure_model`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, flatten, takes_context, unflatten


def device_sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU), so that a clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SavedTensorBytes:
    """Context manager counting the bytes autograd saves for backward (storages of ``params`` excluded)."""

    def __init__(self, params=()) -> None:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._saved: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._param_ptrs:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self._saved.values())

    def __enter__(self) -> SavedTensorBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def time_unit(fn, device, reps: int, count_activations: bool = False, params=()) -> tuple[float, float, int]:
    """Fastest forward and backward seconds of ``fn() -> backward_closure`` over ``reps`` timed runs (after one
    warm-up run, which also counts the activation bytes saved for backward). The minimum, not the median: on a
    shared machine, contention only ever adds time."""
    counter = SavedTensorBytes(params)
    fwd, bwd = [], []
    for i in range(reps + 1):
        device_sync(device)
        t0 = time.perf_counter()
        if i == 0 and count_activations:
            with counter:
                backward = fn()
        else:
            backward = fn()
        device_sync(device)
        t1 = time.perf_counter()
        backward()
        device_sync(device)
        t2 = time.perf_counter()
        if i > 0:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        for p in params:
            p.grad = None
    return min(fwd), min(bwd), counter.total


def weight_grad_bytes(module: nn.Module, fn) -> int:
    """Bytes one micro-batch of ``module`` keeps from its input-gradient action ``I`` to its weight-gradient action
    ``W`` when the backward is split (zero-bubble schedules): the linear layers' inputs and output gradients that
    :class:`~lightning_async.pipeline.weight_grad.DeferredWeightGrads` holds, measured by running ``fn() ->
    backward_closure`` once with the split (``module``'s linear layers become split-backward ones, as the runtime
    makes them; the deferred products are dropped, not computed)."""
    from lightning_async.pipeline.weight_grad import DeferredWeightGrads, split_linear_backward

    split_linear_backward(module)
    deferred = DeferredWeightGrads()
    backward = fn()
    with deferred.collecting():
        backward()
    held = deferred.held_bytes(exclude=module.parameters())
    for p in module.parameters():
        p.grad = None
    return held


def measure_unit_times(
    units: Sequence[nn.Module], example, repeats: int = 2, context_fn: Callable | None = None
) -> list[float]:
    """Forward+backward seconds of each unit, feeding each unit the previous unit's output.

    ``example`` (the first unit's input) and the outputs may be tensors or small pytrees of tensors
    (:mod:`~lightning_async.pipeline.boundary`); ``context_fn`` is the module's ``pipeline_context``, handed to
    the units whose forward takes ``context``.
    """
    context = NO_CONTEXT if context_fn is None else context_fn(example)
    times, value = [], example
    for unit in units:
        unit_context = context if takes_context(unit) else NO_CONTEXT
        leaves, structure = flatten(value)
        best = float("inf")
        for _ in range(repeats):
            inp = unflatten([x.detach().requires_grad_(x.is_floating_point()) for x in leaves], structure)
            start = time.perf_counter()
            out = call_unit(unit, inp, unit_context)
            grad_leaves = [x for x in flatten(out, "Pipeline unit")[0] if x.requires_grad]
            if grad_leaves:
                torch.autograd.backward([x.float().sum() for x in grad_leaves])
            best = min(best, time.perf_counter() - start)
        unit.zero_grad(set_to_none=True)
        times.append(best)
        out_leaves, out_structure = flatten(out)
        value = unflatten([x.detach() for x in out_leaves], out_structure)
    return times


def measure_model(
    name: str,
    seq_len: int,
    micro_batch_size: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    reps: int = 3,
    head_tokens: int | None = None,
    vocab_size: int | None = None,
) -> dict:
    """Time and size one embedding, one decoder block and the LM head (with the loss) of ``name``.

    Returns per-unit ``forward_s``, ``backward_s``, ``params`` (elements), ``param_bytes`` and ``activation_bytes``
    (saved for backward, per micro-batch) and ``weight_grad_bytes`` (what a split backward keeps from ``I`` to ``W``,
    :func:`weight_grad_bytes`) for ``embed``, ``block`` and ``head``, plus ``boundary_bytes`` (the activation sent
    between stages) and the measurement settings.
    """
    import torch.nn.functional as F

    from lightning_async.models import SmolLM2, model_config

    cfg = model_config(name, vocab_size=vocab_size)
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    t_build = time.perf_counter()
    with dev:
        model = SmolLM2(cfg).to(dt)
    t_build = time.perf_counter() - t_build
    b, t, h, v = micro_batch_size, seq_len, cfg.hidden_size, cfg.vocab_size
    if head_tokens is None:
        head_tokens = t if dev.type == "cuda" else min(t, 256)
    head_tokens = max(1, min(head_tokens, t))
    head_scale = t / head_tokens
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, v, (b, t), device=dev, generator=g)
    x = torch.randn(b, t, h, device=dev, dtype=dt, generator=g)
    xh = torch.randn(b, head_tokens, h, device=dev, dtype=dt, generator=g)
    targets = torch.randint(0, v, (b, head_tokens), device=dev, generator=g)

    def embed_step():
        out = model.embed(ids)
        grad = torch.ones_like(out)
        return lambda: out.backward(grad)

    block = model.blocks[0]

    def block_step():
        inp = x.detach().requires_grad_()
        out = block(inp)
        grad = torch.ones_like(out)
        return lambda: out.backward(grad)

    def head_step():
        inp = xh.detach().requires_grad_()
        loss = F.cross_entropy(model.head(inp).float().reshape(-1, v), targets.reshape(-1))
        return loss.backward

    units = {}
    for unit, module, fn in (("embed", model.embed, embed_step), ("block", block, block_step), ("head", model.head, head_step)):
        params = list(module.parameters())
        tf, tb, act = time_unit(fn, dev, reps, count_activations=True, params=params)
        held = weight_grad_bytes(module, fn)
        scale = head_scale if unit == "head" else 1.0
        numel = sum(p.numel() for p in params)  # the head counts the tied weight: each stage keeps its own copy
        units[unit] = {
            "forward_s": tf * scale,
            "backward_s": tb * scale,
            "params": numel,
            "param_bytes": numel * torch.empty((), dtype=dt).element_size(),
            "activation_bytes": int(act * scale),
            "weight_grad_bytes": int(held * scale),
        }
    elem = torch.empty((), dtype=dt).element_size()
    return {
        "model": name,
        "num_layers": cfg.num_layers,
        "hidden_size": h,
        "vocab_size": v,
        "seq_len": t,
        "micro_batch_size": b,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "reps": reps,
        "head_tokens": head_tokens,
        "build_s": t_build,
        "units": units,
        "boundary_bytes": b * t * h * elem,
        "element_bytes": elem,
        # the embedding's weight, which the head also counts when tied: one tensor on a rank holding both
        "tied_params": sum(p.numel() for p in model.embed.parameters()) if cfg.tie_embeddings else 0,
    }
