"""Workload models."""

from lightning_async.models.smollm2 import MODEL_CONFIGS, SmolLM2, SmolLM2Config, count_parameters, model_config

__all__ = ["MODEL_CONFIGS", "SmolLM2", "SmolLM2Config", "count_parameters", "model_config"]
