"""The construction-time check that a model's pipeline units compose to its own forward, and, when they do not,
the diagnosis that names where they part: the unit whose input differs from what the Hugging Face forward fed
that module, a layer that computes differently from the same input (its side inputs), or the logits after the
head; with the config fields that may account for it."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_async.models.hf_units import DecoderLayerUnit, UnitView, run_units
from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, takes_context

ATOL, RTOL = 1e-5, 1e-4
# config fields that change values outside the modules in some families (the hint of a failed check)
_SUSPECT_FIELD = re.compile(r"multiplier|logit_scale|logits_scaling|softcap|normalizer|embed_scale|bidirectional")
_INSIDE_THE_LAYERS = re.compile(r"^(attn_|attention_|residual_|router_)")  # applied by the layers the units run as they are


def _close(a, b) -> bool:
    same_shape = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
    return same_shape and torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def _max_diff(a, b) -> float | str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
        return (a - b).abs().max().item()
    return "a different shape"


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def record_module_io(model: nn.Module, modules: dict[str, nn.Module], run: Callable[[], torch.Tensor]):
    """Run ``run()`` with hooks that record each named module's first input and (first) output."""
    seen: dict[str, tuple] = {}
    handles = []
    for name, module in modules.items():
        def hook(mod, args, kwargs, output, name=name):
            if name not in seen:
                first = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
                seen[name] = (first, _first(output))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    return result, seen


def suspect_fields(config) -> str:
    """The config's set fields that scale or cap values outside the modules in some families (for the message)."""
    found = [f"{k}={v!r}" for k, v in config.to_dict().items()
             if _SUSPECT_FIELD.search(k) and not _INSIDE_THE_LAYERS.match(k)
             and not isinstance(v, (dict, list)) and v not in (None, False, 1, 1.0)]
    return f" Config fields that may account for it: {', '.join(found)}." if found else ""


def where_units_part(model: nn.Module, units: Sequence[tuple[str, nn.Module]], context, ids: torch.Tensor) -> str:
    """A sentence naming where the units first differ from ``model``'s forward on ``ids``."""
    inner = {name: (unit.viewed if isinstance(unit, UnitView) else unit) for name, unit in units}
    expected, seen = record_module_io(model, inner, lambda: model(input_ids=ids, use_cache=False).logits)
    value, previous = ids, None
    for name, unit in units:
        plain = type(unit) is DecoderLayerUnit or not isinstance(unit, UnitView)
        if name not in seen:
            return f"the Hugging Face forward never calls {name}, which the units call"
        hf_input, hf_output = seen[name]
        if plain and previous is not None and not _close(value, hf_input):
            return (f"the input of {name} differs from what the Hugging Face forward gives it (max |diff| "
                    f"{_max_diff(value, hf_input)}): the base model's forward changes the hidden states between "
                    f"{previous} and {name}")
        out = call_unit(unit, value, context if takes_context(unit) else NO_CONTEXT)
        if plain and _close(value, hf_input) and not _close(out, hf_output):
            return (f"{name} computes a different output from the same input (max |diff| {_max_diff(out, hf_output)}): "
                    "its side inputs (attention mask, position tables, ALiBi) differ from the base model's")
        value, previous = out, name
    return (f"every unit reproduces its module, but the logits differ after {previous} (max |diff| "
            f"{_max_diff(value, expected)}): the *ForCausalLM forward changes them after the head")


def check_units(
    model: nn.Module, units: Sequence[tuple[str, nn.Module]], context_of: Callable, how_to: str, length: int = 8
) -> float:
    """Raise ``ValueError`` (naming where they part) if ``units`` do not reproduce ``model``'s logits on one short
    sequence, in eval mode; returns the max |diff|."""
    ids = torch.arange(length, device=model.device).remainder(model.config.vocab_size).unsqueeze(0)
    training = model.training
    model.eval()  # no dropout
    try:
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
            context = context_of(ids)
            got = run_units(units, ids, context)
            if _close(got, expected):
                return _max_diff(got, expected)
            where = where_units_part(model, units, context, ids)
    finally:
        for _, unit in units:
            unit.train(training)
        model.train(training)
    raise ValueError(
        f"The pipeline units of {type(model).__name__} do not reproduce its forward pass (max |diff| "
        f"{_max_diff(got, expected)}): {where}.{suspect_fields(model.config)} " + how_to
    )
