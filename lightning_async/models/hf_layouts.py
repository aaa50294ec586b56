"""Where a Hugging Face ``*ForCausalLM`` keeps its modules, and the pipeline units made of them.

A :class:`Layout` names the base model, the modules before the decoder layers (token embedding, learned positions,
an embedding norm or projection), the layers' list and the modules after it. It comes from the model's pipeline
plan (``config.base_model_pp_plan``), else from the first built-in layout whose modules the model has: the common
``model.embed_tokens / model.layers / model.norm``, GPT-2's (``transformer.wte + wpe``), OPT's
(``model.decoder``, learned positions with an offset), BLOOM's (an embedding norm, ALiBi) and Falcon's (rotary or
ALiBi, parallel attention inside the layer). What the ``*ForCausalLM`` forward does outside the modules comes
from the config (:func:`head_unit`, :func:`embedding_unit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from lightning_async.models.hf_moe import MoEDecoderLayerUnit, MoELayers
from lightning_async.models.hf_units import DecoderLayerUnit, LogitsHead, PositionsAdded, ScaledEmbedding

HOW_TO_OVERRIDE = (
    "Subclass HFCausalLM and override pipeline_units() (ordered (name, module) pairs under `model.`, each name "
    "a module path) and, if the layers need side inputs, pipeline_context(input_ids); see docs/models.md."
)


@dataclass(frozen=True)
class Positions:
    """A learned absolute position table added to the hidden states (then the dropout named, if any)."""

    table: str
    dropout: str | None = None
    opt_style: bool = False


@dataclass(frozen=True)
class Layout:
    """A family's module layout under ``base`` (a dotted path in the ``*ForCausalLM``); see the module docstring."""

    name: str
    base: str
    before: tuple = ()
    layers: str = "layers"
    after: tuple = ()
    mask_options: dict = field(default_factory=dict)  # extra arguments of the mask builders (Falcon: always a tensor)
    alibi: str | None = None  # "bloom" or "falcon": the layers take ALiBi biases from the context
    head: str = "lm_head"  # its path in the *ForCausalLM (GPT-NeoX: embed_out)
    optional: tuple = ()  # modules a config may leave out (None): OPT's projections and final norm

    def required(self) -> list[str]:
        names = [p.table if isinstance(p, Positions) else p for p in self.before] + [self.layers, *self.after]
        return [name for name in names if name not in self.optional]


BUILT_IN = [
    Layout("common", "model", ("embed_tokens",), "layers", ("norm",)),
    Layout("gpt2", "transformer", ("wte", Positions("wpe", "drop")), "h", ("ln_f",)),
    Layout("opt", "model.decoder", ("embed_tokens", "project_in", Positions("embed_positions", opt_style=True)), "layers",
           ("final_layer_norm", "project_out"), optional=("project_in", "final_layer_norm", "project_out")),
    Layout("bloom", "transformer", ("word_embeddings", "word_embeddings_layernorm"), "h", ("ln_f",), alibi="bloom"),
    Layout("falcon", "transformer", ("word_embeddings",), "h", ("ln_f",), mask_options={"allow_is_causal_skip": False}),
]


def _has(hf: nn.Module, path: str) -> bool:
    try:
        hf.get_submodule(path)
    except AttributeError:
        return False
    return True


def layout_of(hf: nn.Module) -> Layout:
    """The layout of ``hf``: from its pipeline plan, else the first built-in one it matches. Raises ``ValueError``
    naming the modules looked for when none matches."""
    config = hf.config
    plan = getattr(config, "base_model_pp_plan", None)
    base = getattr(hf, "base_model_prefix", "model")
    if plan and _has(hf, base):
        keys = list(plan)
        lists = [k for k in keys if isinstance(getattr(hf.get_submodule(base), k, None), nn.ModuleList)]
        if len(lists) == 1:
            i = keys.index(lists[0])
            head = next(iter(getattr(type(hf), "_pp_plan", None) or {"lm_head": None}))  # (the instance's is merged)
            return Layout("plan", base, tuple(keys[:i]), lists[0], tuple(keys[i + 1:]), head=head)
    for layout in BUILT_IN:
        if all(_has(hf, f"{layout.base}.{name}") for name in layout.required()) and _has(hf, "lm_head"):
            if layout.name == "falcon" and getattr(config, "alibi", False):
                return replace(layout, alibi="falcon")
            return layout
    looked_for = "; ".join(f"{lay.name}: " + ", ".join(f"{lay.base}.{n}" for n in lay.required()) for lay in BUILT_IN)
    raise ValueError(
        f"{type(hf).__name__} has no pipeline plan (config.base_model_pp_plan) and none of the built-in layouts "
        f"({looked_for}; each with lm_head), so its pipeline units cannot be derived. " + HOW_TO_OVERRIDE
    )


def context_layout(hf: nn.Module) -> Layout:
    """The layout the context is built for: :func:`layout_of`, or for a model without one (whose units a subclass
    writes) its base model with the plain causal masks and its rotary embedding, if any."""
    try:
        return layout_of(hf)
    except ValueError:
        return Layout("custom", getattr(hf, "base_model_prefix", "model"))


def refuse_unsupported_fields(config) -> None:
    """Raise, naming the config field, for a setting the derived units cannot reproduce."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"{config.model_type}: config.use_bidirectional_attention=True (attention over the whole sequence) is not "
            "causal language modelling, which HFCausalLM trains: set it to False."
        )
    if float(getattr(config, "layerdrop", 0.0) or 0.0) > 0.0:
        raise ValueError(
            f"{config.model_type}: config.layerdrop={config.layerdrop} skips random decoder layers in training, which a "
            "pipeline stage cannot follow (its neighbours would wait for it): set layerdrop to 0."
        )


def refuse_several_routers(layer: nn.Module, moe: MoELayers, name: str) -> None:
    """Raise, naming them, when a layer holds more than one router (JetMoE's attention and MLP experts) while the
    config asks for router losses (``output_router_logits``): each MoE unit attaches one router's losses."""
    routers = [n for n, m in layer.named_modules() if isinstance(m, moe.router_class)]
    if len(routers) > 1:
        raise ValueError(
            f"{name} has {len(routers)} routers ({', '.join(routers)}), and HFCausalLM attaches the load-balancing loss of "
            "one router per decoder layer: train it with output_router_logits=False (no router loss, as Hugging Face "
            "then trains it), or override pipeline_units()."
        )


def embedding_unit(embedding: nn.Module, config) -> nn.Module:
    """The token embedding, times ``config.embedding_multiplier`` where the family multiplies (Granite)."""
    multiplier = getattr(config, "embedding_multiplier", None)
    return embedding if multiplier is None else ScaledEmbedding(embedding, float(multiplier))


def head_unit(head: nn.Module, config) -> nn.Module:
    """The LM head, with the logit scaling or soft-capping the config asks for (:class:`LogitsHead`)."""
    scale = getattr(config, "logit_scale", None)
    divisor = getattr(config, "logits_scaling", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    if scale is None and divisor is None and softcap is None:
        return head
    return LogitsHead(head, scale, divisor, softcap)


def layout_units(
    hf: nn.Module, layout: Layout, prefix: str = "model", moe: MoELayers | None = None
) -> list[tuple[str, nn.Module]]:
    """The pipeline units of ``hf`` in ``layout``, each under its module path (``prefix`` + the path in ``hf``).
    With ``moe``, a decoder layer holding a router becomes a :class:`MoEDecoderLayerUnit`."""
    config = hf.config
    base = hf.get_submodule(layout.base)
    at = f"{prefix}.{layout.base}"
    units: list[tuple[str, nn.Module]] = []
    for index, entry in enumerate(layout.before):
        if isinstance(entry, Positions):
            dropout = getattr(base, entry.dropout) if entry.dropout else None
            units.append((f"{at}.{entry.table}", PositionsAdded(getattr(base, entry.table), dropout, entry.opt_style)))
        elif getattr(base, entry, None) is not None:
            module = getattr(base, entry)
            units.append((f"{at}.{entry}", embedding_unit(module, config) if index == 0 else module))
    layer_types = getattr(config, "layer_types", None)
    for i, layer in enumerate(getattr(base, layout.layers)):
        kind = layer_types[i] if layer_types else "full_attention"
        router = moe.router_of(layer) if moe is not None else None
        if moe is not None and router is None and getattr(config, "output_router_logits", False):
            refuse_several_routers(layer, moe, f"{at}.{layout.layers}.{i}")
        unit = DecoderLayerUnit(layer, kind) if router is None else MoEDecoderLayerUnit(layer, kind, i, router, moe)
        units.append((f"{at}.{layout.layers}.{i}", unit))
    units += [(f"{at}.{name}", getattr(base, name)) for name in layout.after if getattr(base, name, None) is not None]
    units.append((f"{prefix}.{layout.head}", head_unit(getattr(hf, layout.head), config)))
    return units


def plan_units(hf: nn.Module, prefix: str = "model", moe: MoELayers | None = None) -> list[tuple[str, nn.Module]]:
    """The pipeline units of a ``*ForCausalLM`` (:func:`layout_of`, :func:`layout_units`)."""
    refuse_unsupported_fields(hf.config)
    return layout_units(hf, layout_of(hf), prefix, moe)
