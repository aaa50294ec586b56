"""Mixtures of experts under ``HFCausalLM``: which module is a layer's router (from the model's own
``_can_record_outputs``), the router-loss coefficients Hugging Face applies, the decoder-layer unit that
attaches each layer's load-balancing loss to its output, and the checks of how the router losses are trained
(load balancing off, the micro-batches they average over)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_async.models.hf_units import DecoderLayerUnit
from lightning_async.models.moe import AttachLoss, RouterCapture, RouterLoss, RouterStatistics, balance_and_z_losses


@dataclass
class MoELayers:
    """How to find and train the routers of a mixture-of-experts model's decoder layers.

    ``router_class``/``output_index``: the module whose output (at that index) is the router logits, from the
    model's own ``_can_record_outputs["router_logits"]`` (what Hugging Face records for its aux loss).
    """

    router_class: type
    output_index: int
    top_k: int
    loss: RouterLoss
    statistics: RouterStatistics = field(default_factory=RouterStatistics)

    def router_of(self, layer: nn.Module) -> nn.Module | None:
        found = [m for m in layer.modules() if isinstance(m, self.router_class)]
        return found[0] if len(found) == 1 else None


class MoEDecoderLayerUnit(DecoderLayerUnit):
    """A decoder layer with a router: in a forward that builds a graph, it computes the layer's router losses,
    attaches them to its output (:class:`~lightning_async.models.moe.AttachLoss`) and records its expert
    statistics; otherwise (evaluation) it is the plain layer."""

    def __init__(self, layer: nn.Module, attention_type: str, index: int, router: nn.Module, moe: MoELayers) -> None:
        super().__init__(layer, attention_type)
        self.index = index
        self.__dict__["capture"] = RouterCapture(router, moe.output_index)  # not submodules: views share the layer's
        self.__dict__["moe"] = moe

    def forward(self, hidden_states: torch.Tensor, context: dict) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(hidden_states, context)
        with self.capture:
            out = super().forward(hidden_states, context)
        logits, self.capture.logits = self.capture.logits, None
        loss = self.moe.loss
        balance, z, tokens_per_expert = balance_and_z_losses(logits, self.moe.top_k, loss.chunks)
        self.moe.statistics.record(self.index, balance, z, tokens_per_expert)
        if loss.active:
            out = AttachLoss.apply(out, loss.layer_loss(balance, z), loss.backward_scale)
        return out


def moe_layers_of(hf: nn.Module) -> MoELayers | None:
    """The MoE description of a ``*ForCausalLM`` whose model records router logits (Mixtral, Qwen2-MoE, Qwen3-MoE,
    OLMoE, ...); ``None`` for a dense model. The losses' coefficients come from the config, as Hugging Face applies
    them: ``router_aux_loss_coef`` (and ``router_z_loss_coef`` where a config has one) when
    ``output_router_logits`` is true, else 0."""
    specs = (getattr(hf, "_can_record_outputs", None) or {}).get("router_logits")
    specs = specs if isinstance(specs, list) else [specs] if specs is not None else []
    recorder = next((r for r in specs if getattr(r, "target_class", None) is not None or isinstance(r, type)), None)
    if recorder is None:
        return None
    router_class = recorder if isinstance(recorder, type) else recorder.target_class
    index = 1 if isinstance(recorder, type) else recorder.index  # Hugging Face's default for a bare class
    config = hf.config
    routers = [m for m in hf.modules() if isinstance(m, router_class)]
    if not routers:
        return None
    top_k = getattr(routers[0], "top_k", None) or config.num_experts_per_tok
    on = bool(getattr(config, "output_router_logits", False))
    loss = RouterLoss(
        aux_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if on else 0.0,
        z_coef=float(getattr(config, "router_z_loss_coef", 0.0) or 0.0) if on else 0.0,
        moe_layers=len(routers),
    )
    return MoELayers(router_class, index, int(top_k), loss)


def warn_if_unbalanced(hf: nn.Module, moe: MoELayers | None) -> None:
    """Warn (rank zero) when the mixture of experts ``hf`` trains without router load balancing: its config has a
    ``router_aux_loss_coef`` but ``output_router_logits=False``, so Hugging Face does not apply it."""
    config = hf.config
    if moe is not None and not moe.loss.active and getattr(config, "router_aux_loss_coef", 0):
        rank_zero_warn(
            f"{type(hf).__name__} is a mixture of experts trained without router load balancing: its config "
            "has output_router_logits=False, so (as in Hugging Face) router_aux_loss_coef is not applied and the "
            "routers may collapse onto a few experts. Set model_overrides: {output_router_logits: true} to train "
            "with the per-layer load-balancing loss."
        )


def aux_loss_microbatches(given, pipeline_microbatches: int | None) -> int:
    """Micro-batches the router losses average over: the pipeline's (checked against ``given``, the
    ``aux_loss_microbatches`` argument) or ``given`` (default 1)."""
    if given is not None and (not isinstance(given, int) or given < 1):
        raise ValueError(f"aux_loss_microbatches must be a positive integer (micro-batches per batch), got {given!r}.")
    if pipeline_microbatches is not None and given not in (None, pipeline_microbatches):
        raise ValueError(
            f"aux_loss_microbatches={given}, but this pipeline computes the router losses on each of its "
            f"{pipeline_microbatches} micro-batches (n_microbatches x data_parallel_size): set aux_loss_microbatches "
            f"to {pipeline_microbatches} (or leave it unset) so one device and the pipeline train the same objective."
        )
    return pipeline_microbatches or given or 1
