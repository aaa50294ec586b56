"""What every decoder layer of a Hugging Face model needs besides the hidden states, computed on each stage for a
micro-batch (``HFCausalLM.pipeline_context``): position ids, the attention mask of each attention kind
(``config.layer_types``: full or sliding-window), the RoPE tables of each kind (Gemma 3 and OLMo 3 keep one per
kind), and ALiBi biases for BLOOM and Falcon; as the base model's own forward builds them."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from lightning_async.models.hf_layouts import HOW_TO_OVERRIDE, Layout

# attention kind of a layer (config.layer_types) -> the Hugging Face function building its mask
MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
# the mask functions' cache argument: ``cache`` since transformers 5.2x, ``past_key_values`` before
_NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}


def attention_kinds(config) -> set[str]:
    """The attention kinds of the layers; ``ValueError`` for one without a mask builder."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    unknown = kinds - set(MASK_BUILDERS)
    if unknown:
        raise ValueError(
            f"{config.model_type}: config.layer_types has attention kinds {sorted(unknown)}, which HFCausalLM builds no "
            f"mask for (it knows {sorted(MASK_BUILDERS)}). " + HOW_TO_OVERRIDE
        )
    return kinds


def rotary_tables(rotary: nn.Module | None, like: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]) -> dict:
    """``kind -> (cos, sin)`` (``None`` without a rotary embedding); one table per kind where the rotary
    embedding's forward takes the layer type (Gemma 3, OLMo 3)."""
    if rotary is None:
        return dict.fromkeys(kinds)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        return {kind: rotary(like, position_ids, kind) for kind in kinds}
    table = rotary(like, position_ids=position_ids)
    return dict.fromkeys(kinds, table)


def falcon_alibi_mask(base: nn.Module, mask: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Falcon's ALiBi biases ``[batch, heads, 1, length]`` and its (materialised) causal mask with them folded in,
    as ``FalconModel.forward`` builds them without padding."""
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    batch, length = like.shape[:2]
    alibi = build_alibi_tensor(torch.ones(batch, length, dtype=torch.long, device=like.device), base.num_heads, like.dtype)
    lowest = torch.finfo(like.dtype).min
    if mask.dtype == torch.bool:
        mask = torch.where(mask, torch.full((), 0.0, device=mask.device, dtype=like.dtype), lowest)
    alibi = alibi.reshape(batch, -1, *alibi.shape[1:])
    return alibi, torch.masked_fill(alibi / math.sqrt(base.config.hidden_size // base.num_heads), mask < -1, lowest)


def layer_context(hf: nn.Module, layout: Layout, input_ids: torch.Tensor) -> dict:
    """The side inputs of ``hf``'s decoder layers for a micro-batch of ``input_ids`` (see the module docstring)."""
    config = hf.config
    base = hf.get_submodule(layout.base)
    batch, length = input_ids.shape[:2]
    device = input_ids.device
    like = torch.empty(batch, length, 0, dtype=hf.dtype, device=device)  # masks and tables read only its shape
    position_ids = torch.arange(length, device=device).unsqueeze(0)
    kinds = attention_kinds(config)
    masks = {
        kind: MASK_BUILDERS[kind](config=config, inputs_embeds=like, attention_mask=None, position_ids=position_ids,
                                  **_NO_CACHE, **layout.mask_options)
        for kind in kinds
    }
    context = {
        "position_ids": position_ids,
        "position_embeddings": rotary_tables(getattr(base, "rotary_emb", None), like, position_ids, kinds),
        "attention_masks": masks,
    }
    if layout.alibi == "bloom":
        context["alibi"] = base.build_alibi_tensor(torch.ones(batch, length, device=device), base.num_heads, hf.dtype)
    elif layout.alibi == "falcon":
        context["alibi"], context["attention_masks"]["full_attention"] = falcon_alibi_mask(base, masks["full_attention"], like)
    if layout.name == "opt":
        context["ones_mask"] = torch.ones(batch, length, device=device)
    return context
