"""The pipeline units ``HFCausalLM`` makes of a Hugging Face model's modules: views that keep Hugging Face's
parameter names, decoder layers fed from the context, and the small adapters for what a family's forward does
outside its modules (scaled embeddings, learned positions, scaled or soft-capped logits)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, takes_context


class UnitView(nn.Module):
    """A view of ``module`` as a pipeline unit with a forward of its own.

    Not a container: it shares the module's parameters, buffers and submodules under the same names, so a stage's
    parameter names are the model's (``self_attn.q_proj.weight``, no extra level) while the module stays
    registered under its own path in the model (the unit's name, where the other stages put a placeholder).
    Other modules the forward needs (a dropout, a router) go in ``__dict__``, unregistered: the model owns them.
    ``train()``/``eval()`` on the view reach the viewed module itself, whose own flag some forwards read.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._parameters, self._buffers, self._modules = module._parameters, module._buffers, module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self.__dict__["viewed"] = module  # not registered again: its contents already are
        self.training = module.training

    def train(self, mode: bool = True) -> UnitView:
        super().train(mode)
        self.viewed.training = mode
        for extra in self.__dict__.values():  # the unregistered helpers (a dropout) follow too
            if isinstance(extra, nn.Module) and extra is not self.viewed:
                extra.train(mode)
        return self


class DecoderLayerUnit(UnitView):
    """A Hugging Face decoder layer as a pipeline unit: hidden states in and out; position ids, the RoPE tables
    and the attention mask of its attention kind (and the ALiBi biases, for a layer that takes them) come from
    the context."""

    def __init__(self, layer: nn.Module, attention_type: str = "full_attention") -> None:
        super().__init__(layer)
        self.attention_type = attention_type
        self.takes_alibi = "alibi" in inspect.signature(layer.forward).parameters

    @property
    def layer(self) -> nn.Module:
        return self.viewed

    def forward(self, hidden_states: torch.Tensor, context: dict) -> torch.Tensor:
        extra = {"alibi": context.get("alibi")} if self.takes_alibi else {}
        out = self.layer(
            hidden_states,
            attention_mask=context["attention_masks"][self.attention_type],
            position_ids=context["position_ids"],
            position_embeddings=context["position_embeddings"][self.attention_type],
            **extra,
        )
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returned a tuple


class ScaledEmbedding(UnitView):
    """The token embedding times a constant (Granite's ``embedding_multiplier``), as the base model's forward applies it."""

    def __init__(self, embedding: nn.Module, multiplier: float) -> None:
        super().__init__(embedding)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.viewed(input_ids) * self.multiplier


class PositionsAdded(UnitView):
    """``hidden + positions(context position ids)``, then the embedding dropout when there is one: learned absolute
    positions (GPT-2's ``wpe``, OPT's ``embed_positions``) as a unit of their own, under the table's own path."""

    def __init__(self, table: nn.Module, dropout: nn.Module | None = None, opt_style: bool = False) -> None:
        super().__init__(table)
        self.__dict__["dropout"] = dropout if dropout is not None else nn.Identity()
        self.opt_style = opt_style  # OPT's table takes (attention mask, cache length, position_ids=...)

    def forward(self, hidden_states: torch.Tensor, context: dict) -> torch.Tensor:
        position_ids = context["position_ids"]
        if self.opt_style:
            positions = self.viewed(context["ones_mask"], 0, position_ids=position_ids)
        else:
            positions = self.viewed(position_ids)
        return self.dropout(hidden_states + positions)


class LogitsHead(UnitView):
    """The LM head and what the ``*ForCausalLM`` forward does to its output, from the config: times
    ``logit_scale`` (Cohere), divided by ``logits_scaling`` (Granite), soft-capped at ``final_logit_softcapping``
    (Gemma 2/3: ``cap * tanh(logits / cap)``)."""

    def __init__(
        self, head: nn.Module, scale: float | None = None, divisor: float | None = None, softcap: float | None = None
    ) -> None:
        super().__init__(head)
        self.scale, self.divisor, self.softcap = scale, divisor, softcap

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.viewed(hidden_states)
        if self.scale is not None:
            logits = logits * self.scale
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def run_units(units: Sequence[tuple[str, nn.Module]], inputs, context):
    """Compose ``units`` on ``inputs`` on one device, calling each as the pipeline does."""
    value = inputs
    for _, unit in units:
        value = call_unit(unit, value, context if takes_context(unit) else NO_CONTEXT)
    return value
