"""Workload models. ``HFCausalLM`` (``lightning_async.models.hf``) is imported on first use: it needs ``transformers``."""

from lightning_async.models.smollm2 import MODEL_CONFIGS, SmolLM2, SmolLM2Config, count_parameters, model_config

__all__ = ["MODEL_CONFIGS", "HFCausalLM", "SmolLM2", "SmolLM2Config", "count_parameters", "model_config"]


def __getattr__(name: str):
    if name == "HFCausalLM":
        from lightning_async.models.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
