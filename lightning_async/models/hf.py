"""``HFCausalLM``: a Hugging Face ``*ForCausalLM`` as a LightningModule that the pipeline strategy can split.

The pipeline units come from the model's module layout (:mod:`~lightning_async.models.hf_layouts`: its pipeline
plan, or the built-in layouts of the common Llama-like, GPT-2, OPT, BLOOM and Falcon families), with the
adapters its config asks for (embedding multipliers, logit scaling and soft-capping), each under its own module
path (so state-dict keys stay Hugging Face's). Decoder layers get what they need besides the hidden states
(position ids, the RoPE tables and attention mask of their attention kind, ALiBi biases) from
:meth:`HFCausalLM.pipeline_context`, which every stage computes for itself
(:mod:`~lightning_async.models.hf_context`). At construction the units are checked against the model's own
forward (:mod:`~lightning_async.models.hf_check`), and a mismatch names where they part. The Hugging Face model
itself is loaded by :mod:`~lightning_async.models.hf_loading`, its routers (a mixture of experts) found by
:mod:`~lightning_async.models.hf_moe`, and its hooks made picklable by :mod:`~lightning_async.models.hf_pickling`;
this module is the LightningModule that ties them together.

``transformers`` is an optional dependency (``pip install -e ".[hf]"``); this module imports it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# first: it says what to install when transformers is missing
from lightning_async.models.hf_loading import load_causal_lm
from lightning_async.models.hf_check import check_units
from lightning_async.models.hf_config import config_from_dict, resolve_config
from lightning_async.models.hf_context import layer_context
from lightning_async.models.hf_layouts import HOW_TO_OVERRIDE, context_layout, plan_units
from lightning_async.models.hf_moe import (
    MoEDecoderLayerUnit, MoELayers, aux_loss_microbatches, moe_layers_of, warn_if_unbalanced,
)
from lightning_async.models.hf_pickling import refuse_local_hooks, strip_output_capturing_hooks
from lightning_async.models.hf_units import DecoderLayerUnit, LogitsHead, PositionsAdded, ScaledEmbedding, UnitView, run_units
from lightning_async.models.moe import RouterStatistics
from lightning_async.models.moe_logging import ExpertStatisticsLogger
from lightning_async.models.training import CausalLMTraining

# the building blocks live in the hf_* modules; these names stay importable from here
__all__ = [
    "HFCausalLM", "DecoderLayerUnit", "MoEDecoderLayerUnit", "MoELayers", "UnitView", "PositionsAdded", "ScaledEmbedding",
    "LogitsHead", "run_units", "plan_units", "moe_layers_of", "config_from_dict", "resolve_config", "HOW_TO_OVERRIDE",
]


class HFCausalLM(CausalLMTraining):
    """Next-token pretraining of a Hugging Face causal LM, on one device or split by the pipeline strategy.

    Same training features as :class:`~lightning_async.lm.CausalLM` (the zoo's optimizers, warmup + cosine,
    loss/perplexity/tokens logging, ``DelaySimulation``/``ErrorFeedback``, both pipeline schedules).

    Args:
        model: a local model directory (``from_pretrained``: config and weights), a config JSON file or a dict
            of config fields with ``model_type`` (random initialisation), or a ``PretrainedConfig``.
        vocab_size: set from the tokenizer (the CLI links it from the data module). With a config it sets
            the vocabulary; with pretrained weights it must fit in the model's embedding.
        model_overrides: config fields to change (e.g. ``{"num_hidden_layers": 2}``); with a model directory
            they are passed to ``from_pretrained``.
        compile: ``torch.compile`` each decoder layer (in place: the state-dict keys do not change).
        attn_implementation: ``"sdpa"`` (causal attention without a mask tensor; a family without it, e.g. Gemma 2,
            falls back to ``"eager"`` with a warning) or another transformers attention implementation (``"eager"``
            builds a mask per micro-batch).
        aux_loss_microbatches: mixture of experts: the router losses are computed per micro-batch and averaged.
            Under a pipeline strategy that is its ``n_microbatches`` x ``data_parallel_size`` (leave ``None``, or
            give that number); on one device, give the number of the pipeline you compare with (``None``: 1, the
            whole batch). See docs/models.md, "Example 4: a mixture of experts".
        training: ``optimizer``, ``lr``, ``weight_decay``, ``optimizer_kwargs``, ``warmup_fraction``,
            ``min_lr_fraction`` (:class:`~lightning_async.models.training.CausalLMTraining`).

    The hyperparameters saved in checkpoints hold the full config (``model`` becomes its dict), so a
    checkpoint rebuilds the model without the original directory (``lightning-async export``).
    """

    def __init__(
        self,
        model: str | dict,
        vocab_size: int | None = None,
        model_overrides: dict | None = None,
        compile: bool = False,
        attn_implementation: str = "sdpa",
        aux_loss_microbatches: int | None = None,
        **training,
    ) -> None:
        super().__init__(**training)
        self.model, pretrained = load_causal_lm(model, vocab_size, model_overrides, attn_implementation)
        if pretrained:
            self.hparams["pretrained_from"] = os.fspath(model)  # for the record; not an argument
        self.model.train()  # from_pretrained leaves the model in eval mode; training runs in train mode (dropout on)
        self.config = self.model.config
        # the checkpoint's hyperparameters rebuild this model from the config alone (weights come from the state dict)
        self.hparams.update(model=self.config.to_diff_dict(), vocab_size=self.config.vocab_size, model_overrides=None)
        self.moe = moe_layers_of(self.model)
        warn_if_unbalanced(self.model, self.moe)
        if self.moe is not None:
            self.moe.loss.whole_batch_per_forward(self._aux_loss_microbatches(None))
        self.check_units()
        if compile:
            for _, unit in self.pipeline_units():
                if isinstance(unit, DecoderLayerUnit):
                    unit.layer.compile()

    # ---- mixture of experts ------------------------------------------------------------------
    def _aux_loss_microbatches(self, pipeline_microbatches: int | None) -> int:
        """Micro-batches the router losses average over (:func:`~lightning_async.models.hf_moe.aux_loss_microbatches`)."""
        return aux_loss_microbatches(self.hparams.get("aux_loss_microbatches"), pipeline_microbatches)

    def setup(self, stage: str) -> None:
        """Under a pipeline strategy (it has ``n_microbatches``) each forward is one micro-batch: the router losses'
        gradient is scaled as the runtime scales the micro-batch's loss. On one device a forward is the whole batch."""
        if self.moe is None:
            return
        strategy = self.trainer.strategy
        m = getattr(strategy, "n_microbatches", None)
        if m is None:
            self.moe.loss.whole_batch_per_forward(self._aux_loss_microbatches(None))
            return
        replicas = getattr(strategy, "data_parallel_size", 1)
        self._aux_loss_microbatches(m * replicas)
        self.moe.loss.one_forward_per_microbatch(m * replicas)

    # an MoE logs its expert statistics from these hooks (ExpertStatisticsLogger: per layer, per pipeline stage)
    def on_train_start(self) -> None:
        if self.moe is not None:
            self._expert_logger = ExpertStatisticsLogger()
            self._expert_logger.start(self.trainer, self)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.moe is not None:
            self._expert_logger.batch_start(self.trainer)

    def on_train_batch_end(self, outputs, batch: torch.Tensor, batch_idx: int) -> None:
        if self.moe is not None:
            self._expert_logger.batch_end(self.trainer, self)

    def on_train_end(self) -> None:
        if self.moe is not None:
            self._expert_logger.end()

    @property
    def router_statistics(self) -> RouterStatistics | None:
        """Per-layer router statistics recorded by this rank's MoE layers (``None`` for a dense model)."""
        return self.moe.statistics if self.moe is not None else None

    def __getstate__(self) -> dict:
        """Pickling (the spawn launcher): Hugging Face's output-capturing hooks are local functions, installed the
        first time a forward records outputs (``output_router_logits=True``); they are removed here and reinstalled
        by Hugging Face on the next forward that needs them. Any other unpicklable hook is refused by name."""
        strip_output_capturing_hooks(self.model)
        refuse_local_hooks(self.model)
        return super().__getstate__()

    # ---- pipeline contract -------------------------------------------------------------------
    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        """Embedding, each decoder layer, final norm, head (under their module paths in ``model``)."""
        return plan_units(self.model, moe=self.moe)

    def pipeline_context(self, input_ids: torch.Tensor) -> dict:
        """What every decoder layer needs besides the hidden states, for a micro-batch of ``input_ids``
        (:func:`~lightning_async.models.hf_context.layer_context`)."""
        if getattr(self, "_context_layout", None) is None:
            self._context_layout = context_layout(self.model)
        return layer_context(self.model, self._context_layout, input_ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits: the pipeline units composed on one device."""
        return run_units(self.pipeline_units(), input_ids, self.pipeline_context(input_ids))

    def check_units(self, length: int = 8) -> float | None:
        """Raise if the units do not reproduce the Hugging Face model's own forward, naming where they part (the
        unit whose input differs, a layer whose side inputs differ, or the logits after the head) and the config
        fields that may account for it. Runs one short sequence at construction; returns the max |diff|."""
        if any(p.is_meta for p in self.model.parameters()):
            return None
        return check_units(self.model, self.pipeline_units(), self.pipeline_context, HOW_TO_OVERRIDE, length)

    @property
    def max_seq_len(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def _depth_and_width(self) -> tuple[int, int]:
        return self.config.num_hidden_layers, self.config.hidden_size
