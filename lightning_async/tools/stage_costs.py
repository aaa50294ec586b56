"""Stage costs for ``lightning-async plan``: nominal unit costs of a model, and unit costs summed per stage.

A model's unit costs (one embedding, one decoder block, the LM head) come either from a measurement
(:func:`lightning_async.pipeline.measure.measure_model`) or from :func:`nominal_model` (FLOP counts, nothing
run), in the same format; :func:`stage_costs_from_measurement` places the layers on ``p`` stages
(:func:`split_layers` or :func:`balanced_layers`) and adds the costs up per stage; :func:`map_costs` adds the same
over the pieces of the schedules with two chunks per stage.
"""

from __future__ import annotations

from lightning_async.pipeline.schedules import DELAYED_SCHEDULES, MAP_SYNC_SCHEDULES, spec

#: the model, sustained rate and dtype of the nominal plan (``lightning-async plan`` with no cost option)
NOMINAL_MODEL, NOMINAL_TFLOPS, NOMINAL_DTYPE = "smollm2-135m", 100.0, "bfloat16"


def nominal_model(
    name: str,
    seq_len: int,
    micro_batch_size: int = 1,
    dtype: str = NOMINAL_DTYPE,
    tflops: float = NOMINAL_TFLOPS,
    vocab_size: int | None = None,
) -> dict:
    """Nominal costs of ``name`` in :func:`~lightning_async.pipeline.measure.measure_model`'s format, with nothing run.

    Parameters are counted exactly (the model is built on the meta device). Forward time is FLOPs at ``tflops``
    sustained: ``2 x parameters`` per token plus ``4 x seq_len x hidden`` of attention per token and block (the
    PaLM count ``CausalLM.flops_per_token`` uses), the embedding is free; backward is twice the forward.
    Activation bytes are an estimate of what one block saves for backward: per token, 9 hidden-sized, 4
    key/value-sized and 4 FFN-sized tensors (norm inputs and outputs, q/k/v and their rotations, attention
    output, gate/up/SiLU/product); the head saves its input, the logits and their fp32 log-probabilities.
    ``weight_grad_bytes`` is what a split backward (zero-bubble schedules) keeps of a micro-batch from its input
    gradient to its weight gradient: each linear layer's input and output gradient (the runtime defers
    ``dW = dY^T X``, :mod:`~lightning_async.pipeline.weight_grad`), per token 6 hidden-sized (the two norm
    outputs, the attention output and the gradients of q, o and down), 2 key/value-sized (k, v) and 3 FFN-sized
    (the product's input to down, the gradients of gate and up) tensors in a block (about 70% of its
    activations); the head keeps its input and the logits' gradient; the embedding nothing (not a linear layer).
    """
    import torch

    from lightning_async.models import SmolLM2, model_config

    if tflops <= 0:
        raise ValueError(f"--tflops must be > 0, got {tflops:g}")
    cfg = model_config(name, vocab_size=vocab_size)
    with torch.device("meta"):
        model = SmolLM2(cfg)
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    tokens, h, v = micro_batch_size * seq_len, cfg.hidden_size, cfg.vocab_size
    kv = cfg.num_kv_heads * cfg.head_dim
    flops = {"embed": 0.0}
    params = {unit: sum(p.numel() for p in module.parameters())
              for unit, module in (("embed", model.embed), ("block", model.blocks[0]), ("head", model.head))}
    flops["block"] = tokens * (2 * params["block"] + 4 * seq_len * h)
    flops["head"] = tokens * 2 * params["head"]
    activations = {
        "embed": tokens * 8,  # the token ids
        "block": tokens * (9 * h + 4 * kv + 4 * cfg.ffn_size) * elem,
        "head": tokens * (h * elem + (elem + 4) * v),
    }
    weight_grad = {"embed": 0, "block": tokens * (6 * h + 2 * kv + 3 * cfg.ffn_size) * elem, "head": tokens * (h + v) * elem}
    units = {
        unit: {
            "forward_s": flops[unit] / (tflops * 1e12),
            "backward_s": 2 * flops[unit] / (tflops * 1e12),
            "params": params[unit],
            "param_bytes": params[unit] * elem,
            "activation_bytes": activations[unit],
            "weight_grad_bytes": weight_grad[unit],
        }
        for unit in ("embed", "block", "head")
    }
    return {
        "model": name, "num_layers": cfg.num_layers, "hidden_size": h, "vocab_size": v, "seq_len": seq_len,
        "micro_batch_size": micro_batch_size, "device": "nominal", "device_name": f"nominal {tflops:g} TFLOP/s",
        "tflops": tflops, "dtype": dtype, "head_tokens": seq_len, "units": units,
        "boundary_bytes": tokens * h * elem, "element_bytes": elem,
        # the embedding's weight, which the head also counts when tied: one tensor on a rank holding both
        "tied_params": params["embed"] if cfg.tie_embeddings else 0,
    }


def split_layers(num_layers: int, p: int) -> list[int]:
    """Layers per stage, as even as possible. Extra layers go to the middle stages first, then the first stage,
    then the last (the first holds the embedding, the last the LM head)."""
    if num_layers < p:
        raise ValueError(f"{num_layers} layers cannot fill {p} stages (each stage needs at least one layer)")
    counts = [num_layers // p] * p
    order = list(range(1, p - 1)) + [0] + ([p - 1] if p > 1 else [])
    for s in order[: num_layers % p]:
        counts[s] += 1
    return counts


def balanced_layers(num_layers: int, p: int, block_cost: float, first_extra: float, last_extra: float) -> list[int]:
    """Layers per stage (at least one each) minimising the slowest stage when the first stage also pays
    ``first_extra`` (the embedding) and the last ``last_extra`` (the LM head)."""
    if num_layers < p:
        raise ValueError(f"{num_layers} layers cannot fill {p} stages (each stage needs at least one layer)")
    extra = [0.0] * p
    extra[0] += first_extra
    extra[-1] += last_extra
    block_cost = max(block_cost, 1e-12)
    candidates = sorted({n * block_cost + e for e in extra for n in range(1, num_layers + 1)})
    for target in candidates:
        caps = [int((target - extra[s]) / block_cost + 1e-9) for s in range(p)]
        if min(caps) >= 1 and sum(caps) >= num_layers:
            break
    surplus = sum(caps) - num_layers
    while surplus > 0:  # take layers back from the most loaded stages first
        s = max((s for s in range(p) if caps[s] > 1), key=lambda s: (caps[s] * block_cost + extra[s], -s))
        caps[s] -= 1
        surplus -= 1
    return caps


def stage_costs_from_measurement(meas: dict, p: int, optimizer_states: float, split: str = "even") -> dict:
    """Per-stage forward/backward seconds and parameter, optimizer, activation and weight-gradient (held from a split
    backward's ``I`` to its ``W``) bytes for ``p`` stages.

    ``split``: ``even`` (:func:`split_layers`) or ``balanced`` (:func:`balanced_layers` on forward + backward time).
    """
    u = meas["units"]
    if split == "balanced":
        cost = {k: u[k]["forward_s"] + u[k]["backward_s"] for k in u}
        layers = balanced_layers(meas["num_layers"], p, cost["block"], cost["embed"], cost["head"])
    else:
        layers = split_layers(meas["num_layers"], p)
    summed = ("forward_s", "backward_s", "params", "param_bytes", "activation_bytes", "weight_grad_bytes")
    out = {k: [] for k in ("layers", "optimizer_bytes", *summed)}
    for s, n in enumerate(layers):
        parts = [("block", n)] + ([("embed", 1)] if s == 0 else []) + ([("head", 1)] if s == p - 1 else [])
        out["layers"].append(n)
        for key in summed:
            out[key].append(sum(u[unit][key] * k for unit, k in parts))
        out["optimizer_bytes"].append(int(optimizer_states * 4 * out["params"][-1]))
    return out


def map_costs(meas: dict, p: int, optimizer_states: float, split: str = "even") -> dict:
    """:func:`stage_costs_from_measurement` for ``p`` stages, with ``"pieces"``: for every chunk count ``v > 1`` of the
    map's schedules (interleaved, ZB-V), the same costs over the ``v x p`` pieces (embedding on the first, LM head on
    the last), which :func:`~lightning_async.tools.plan_table.schedule_costs` places on the ranks as the schedule
    does; ``{"skipped": why}`` where the layers do not fill that many pieces. ``"tied_bytes"``: the parameter and
    optimizer bytes of the embedding weight the LM head shares (counted by both units; held once by a rank that holds
    both, ZB-V's rank 0)."""
    costs = stage_costs_from_measurement(meas, p, optimizer_states, split)
    tied = meas.get("tied_params", 0)
    costs["tied_bytes"] = {"param_bytes": tied * meas["element_bytes"], "optimizer_bytes": int(optimizer_states * 4 * tied)}
    costs["pieces"] = {}
    for v in sorted({spec(name).chunks for name in (*MAP_SYNC_SCHEDULES, *DELAYED_SCHEDULES)} - {1}):
        try:
            costs["pieces"][v] = stage_costs_from_measurement(meas, v * p, optimizer_states, split)
        except ValueError as err:
            costs["pieces"][v] = {"skipped": f"{v} chunks per stage are {v * p} pieces: {err}"}
    return costs
