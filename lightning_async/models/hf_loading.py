"""The Hugging Face model ``HFCausalLM`` trains, loaded from its source: a local model directory
(``from_pretrained``: config and weights, the tokenizer's vocabulary checked to fit) or a config (a dict, a JSON file
or a config object: random initialisation), with the attention implementation asked for (eager where a family has no
SDPA attention)."""

from __future__ import annotations

import os

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

try:
    from transformers import AutoModelForCausalLM
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lightning_async.models.hf needs the transformers package: pip install 'lightning-async[hf]' "
        "(or pip install 'transformers>=4.50')."
    ) from err

from lightning_async.models.hf_config import check_local_source, resolve_config

__all__ = ["load_causal_lm", "load_model"]

_NO_SDPA = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"


def load_model(load, source, attn_implementation: str, **kwargs) -> nn.Module:
    """``load(source, attn_implementation=..., **kwargs)``; where the family has no SDPA attention (Gemma 2, BLOOM,
    GPT-OSS) and SDPA was asked for, the eager implementation, with a warning."""
    try:
        return load(source, attn_implementation=attn_implementation, **kwargs)
    except ValueError as err:
        if attn_implementation != "sdpa" or _NO_SDPA not in str(err):
            raise
        family = str(err).split(" does not support")[0]
    rank_zero_warn(f"{family} has no SDPA attention: using attn_implementation='eager'.")
    return load(source, attn_implementation="eager", **kwargs)


def load_causal_lm(
    model, vocab_size: int | None, model_overrides: dict | None, attn_implementation: str
) -> tuple[nn.Module, bool]:
    """``(the *ForCausalLM of model, whether it came from a pretrained directory)``. ``model``: a local model
    directory (``model_overrides`` go to ``from_pretrained``, ``vocab_size`` must fit in its embedding), a config
    JSON file, a dict of config fields with ``model_type`` or a ``PretrainedConfig`` (``model_overrides`` change its
    fields, ``vocab_size`` sets its vocabulary)."""
    pretrained = isinstance(model, (str, os.PathLike)) and os.path.isdir(model)
    if isinstance(model, (str, os.PathLike)):
        check_local_source(os.fspath(model))
    if pretrained:
        hf = load_model(
            AutoModelForCausalLM.from_pretrained, model, attn_implementation, dtype=torch.float32, local_files_only=True,
            **(model_overrides or {}),
        )
        _check_vocab_fits(hf, vocab_size, str(model))
        return hf, True
    config = resolve_config(model, model_overrides)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    return load_model(AutoModelForCausalLM.from_config, config, attn_implementation, dtype=torch.float32), False


def _check_vocab_fits(hf: nn.Module, vocab_size: int | None, source: str) -> None:
    model_vocab = hf.config.vocab_size
    if vocab_size is not None and vocab_size > model_vocab:
        raise ValueError(
            f"The tokenizer has {vocab_size} tokens but the pretrained model at {source} embeds only {model_vocab}: "
            "train with the model's own tokenizer (data.tokenizer), or start from a config (random weights) "
            "whose vocab_size the tokenizer sets."
        )
