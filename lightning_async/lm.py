"""The LightningModule for causal-LM pretraining on our SmolLM2-style decoder: :class:`CausalLM`. The training
features every causal LM here shares are :class:`~lightning_async.models.training.CausalLMTraining` (re-exported
here; ``models.hf.HFCausalLM`` builds on it too).

Pipeline contract (what :class:`~lightning_async.strategies.AsyncPipelineStrategy` needs from any
LightningModule; see ``docs/pipeline.md`` and ``docs/models.md``):

* ``pipeline_units()`` -> ordered ``(name, module)`` pairs whose composition is the forward pass;
* ``pipeline_split_batch(batch)`` -> ``(inputs, targets)``, both split along dim 0 into micro-batches;
* ``pipeline_loss(outputs, targets)`` -> scalar mean loss of one micro-batch (on the last stage);
* optionally ``pipeline_context(inputs)`` -> side inputs every stage computes itself (RoPE tables, masks);
* optionally ``log_loss(split, loss, batch)`` to log the loss the pipeline computed.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_async.models import SmolLM2, model_config
from lightning_async.models.training import CausalLMTraining

__all__ = ["CausalLM", "CausalLMTraining"]


class CausalLM(CausalLMTraining):
    """Next-token prediction on a SmolLM2-style decoder.

    Args:
        model: named shape (``nano``, ``tiny``, ``small``, ``smollm2-135m``, ``smollm2-360m``).
        vocab_size: set from the tokenizer (the CLI links it from the data module).
        model_overrides: shape fields to change (e.g. ``{"num_layers": 2}``).
        compile: ``torch.compile`` each block (and per stage under the pipeline).
        training: ``optimizer``, ``lr``, ``weight_decay``, ``optimizer_kwargs``, ``warmup_fraction``,
            ``min_lr_fraction`` (:class:`CausalLMTraining`).
    """

    def __init__(
        self,
        model: str = "tiny",
        vocab_size: int | None = None,
        model_overrides: dict | None = None,
        compile: bool = False,
        **training,
    ) -> None:
        super().__init__(**training)
        self.config = model_config(model, vocab_size=vocab_size, **(model_overrides or {}))
        self.model = SmolLM2(self.config)
        if compile:
            for i, block in enumerate(self.model.blocks):
                self.model.blocks[i] = torch.compile(block)

    # ---- pipeline contract -------------------------------------------------------------------
    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        return [(f"model.{name}", module) for name, module in self.model.pipeline_units()]

    def pipeline_context(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables every block reads: computed once per stage and micro-batch, not once per block."""
        return self.model.pipeline_context(input_ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def _depth_and_width(self) -> tuple[int, int]:
        return self.config.num_layers, self.config.hidden_size

