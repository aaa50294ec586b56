"""Hugging Face configs for ``HFCausalLM``: from a dict of fields, a config JSON file or a config object, and the
early check of a local source path."""

from __future__ import annotations

import json
import os

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


def config_from_dict(fields: dict) -> PretrainedConfig:
    """A transformers config from a dict of its fields, which must name the ``model_type``."""
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError(
            "A Hugging Face config given as a dict needs its model_type (e.g. {'model_type': 'llama', 'hidden_size': 128, ...})."
        )
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model_type {model_type!r} is not a transformers model type (e.g. llama, qwen2, mistral, qwen3).")
    return CONFIG_MAPPING[model_type].from_dict(fields)


def resolve_config(source: str | dict | PretrainedConfig, overrides: dict | None = None) -> PretrainedConfig:
    """The config of ``source``: a config object, a dict of fields, or a config JSON file."""
    if isinstance(source, PretrainedConfig):
        config = source.__class__.from_dict(source.to_dict())  # a copy: overrides must not change the caller's
    elif isinstance(source, dict):
        config = config_from_dict(source)
    else:
        with open(source) as f:
            config = config_from_dict(json.load(f))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def check_local_source(source: str) -> None:
    """Fail early, naming the path, when ``source`` is neither a model directory nor a config JSON file."""
    if os.path.isdir(source):
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise FileNotFoundError(
                f"HFCausalLM(model={source!r}): the directory has no config.json, so it is not a Hugging Face model "
                "directory (write one with model.save_pretrained(DIR), or download one with "
                "`huggingface-cli download ID --local-dir DIR`)."
            )
        return
    if not os.path.isfile(source):
        raise FileNotFoundError(
            f"HFCausalLM(model={source!r}): no such model directory or config JSON file. Give a local directory "
            "(model.save_pretrained(DIR), or `huggingface-cli download ID --local-dir DIR` first: nothing is downloaded "
            "during training, so every rank reads the same files), a config JSON file, or a dict of config fields."
        )
