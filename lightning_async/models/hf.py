"""``HFCausalLM``: a Hugging Face ``*ForCausalLM`` as a LightningModule that the pipeline strategy can split.

The pipeline units come from the model's module layout (:mod:`~lightning_async.models.hf_layouts`: its pipeline
plan, or the built-in layouts of the common Llama-like, GPT-2, OPT, BLOOM and Falcon families), with the
adapters its config asks for (embedding multipliers, logit scaling and soft-capping), each under its own module
path (so state-dict keys stay Hugging Face's). Decoder layers get what they need besides the hidden states
(position ids, the RoPE tables and attention mask of their attention kind, ALiBi biases) from
:meth:`HFCausalLM.pipeline_context`, which every stage computes for itself
(:mod:`~lightning_async.models.hf_context`). At construction the units are checked against the model's own
forward (:mod:`~lightning_async.models.hf_check`), and a mismatch names where they part.

``transformers`` is an optional dependency (``pip install -e ".[hf]"``); this module imports it.
"""

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

from lightning_async.models.hf_check import check_units
from lightning_async.models.hf_config import check_local_source, config_from_dict, resolve_config
from lightning_async.models.hf_context import layer_context
from lightning_async.models.hf_layouts import HOW_TO_OVERRIDE, context_layout, plan_units
from lightning_async.models.hf_moe import MoEDecoderLayerUnit, MoELayers, moe_layers_of
from lightning_async.models.hf_units import DecoderLayerUnit, LogitsHead, PositionsAdded, ScaledEmbedding, UnitView, run_units
from lightning_async.models.moe_logging import ExpertStatisticsLogger
from lightning_async.models.training import CausalLMTraining

__all__ = [
    "HFCausalLM", "DecoderLayerUnit", "MoEDecoderLayerUnit", "MoELayers", "UnitView", "PositionsAdded", "ScaledEmbedding",
    "LogitsHead", "run_units", "plan_units", "moe_layers_of", "config_from_dict", "resolve_config", "HOW_TO_OVERRIDE",
]

_CAPTURING_MODULE = "transformers.utils.output_capturing"  # where Hugging Face's local capture hooks are defined
_NO_SDPA = "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention"


# ---- pickling ---------------------------------------------------------------------------------
def _hook_dicts(module: nn.Module):
    return [module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks]


def strip_output_capturing_hooks(model: nn.Module) -> int:
    """Remove Hugging Face's output-capturing forward hooks from ``model`` and mark it unhooked, so transformers
    installs them again when a forward next records outputs. Returns how many were removed."""
    removed = 0
    for module in model.modules():
        hooks = module._forward_hooks
        for key in [k for k, fn in hooks.items() if getattr(fn, "__module__", None) == _CAPTURING_MODULE]:
            del hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)
            removed += 1
        if getattr(module, "_output_capturing_hooks_installed", False):
            module._output_capturing_hooks_installed = False
    return removed


def refuse_local_hooks(model: nn.Module) -> None:
    """Raise, naming the module and the hook, if a hook on ``model`` is a local function (pickle cannot send it
    to the processes the spawn launcher starts)."""
    for name, module in model.named_modules():
        for hooks in _hook_dicts(module):
            for fn in hooks.values():
                if "<locals>" in getattr(fn, "__qualname__", ""):
                    raise TypeError(
                        f"The module at {name or 'model'!r} has a hook {fn.__qualname__!r} (a local function), which cannot "
                        "be pickled for the processes of the spawn launcher. Remove the hook before trainer.fit, or launch "
                        "with start_method='popen' (the default of AsyncPipelineStrategy; the lightning-async CLI uses it)."
                    )


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
        pretrained = isinstance(model, (str, os.PathLike)) and os.path.isdir(model)
        if isinstance(model, (str, os.PathLike)):
            check_local_source(os.fspath(model))
        if pretrained:
            self.model = load_model(
                AutoModelForCausalLM.from_pretrained, model, attn_implementation, dtype=torch.float32, local_files_only=True,
                **(model_overrides or {}),
            )
            self._check_vocab_fits(vocab_size, str(model))
            self.hparams["pretrained_from"] = os.fspath(model)  # for the record; not an argument
        else:
            config = resolve_config(model, model_overrides)
            if vocab_size is not None:
                config.vocab_size = vocab_size
            self.model = load_model(AutoModelForCausalLM.from_config, config, attn_implementation, dtype=torch.float32)
        self.model.train()  # from_pretrained leaves the model in eval mode; training runs in train mode (dropout on)
        self.config = self.model.config
        # the checkpoint's hyperparameters rebuild this model from the config alone (weights come from the state dict)
        self.hparams.update(model=self.config.to_diff_dict(), vocab_size=self.config.vocab_size, model_overrides=None)
        self.moe = moe_layers_of(self.model)
        self._warn_if_unbalanced()
        if self.moe is not None:
            self.moe.loss.whole_batch_per_forward(self._aux_loss_microbatches(None))
        self.check_units()
        if compile:
            for _, unit in self.pipeline_units():
                if isinstance(unit, DecoderLayerUnit):
                    unit.layer.compile()

    def _check_vocab_fits(self, vocab_size: int | None, source: str) -> None:
        model_vocab = self.model.config.vocab_size
        if vocab_size is not None and vocab_size > model_vocab:
            raise ValueError(
                f"The tokenizer has {vocab_size} tokens but the pretrained model at {source} embeds only {model_vocab}: "
                "train with the model's own tokenizer (data.tokenizer), or start from a config (random weights) "
                "whose vocab_size the tokenizer sets."
            )

    # ---- mixture of experts ------------------------------------------------------------------
    def _warn_if_unbalanced(self) -> None:
        config = self.config
        if self.moe is not None and not self.moe.loss.active and getattr(config, "router_aux_loss_coef", 0):
            rank_zero_warn(
                f"{type(self.model).__name__} is a mixture of experts trained without router load balancing: its config "
                "has output_router_logits=False, so (as in Hugging Face) router_aux_loss_coef is not applied and the "
                "routers may collapse onto a few experts. Set model_overrides: {output_router_logits: true} to train "
                "with the per-layer load-balancing loss."
            )

    def _aux_loss_microbatches(self, pipeline_microbatches: int | None) -> int:
        """Micro-batches the router losses average over: the pipeline's (checked against the argument) or the argument."""
        given = self.hparams.get("aux_loss_microbatches")
        if given is not None and (not isinstance(given, int) or given < 1):
            raise ValueError(f"aux_loss_microbatches must be a positive integer (micro-batches per batch), got {given!r}.")
        if pipeline_microbatches is not None and given not in (None, pipeline_microbatches):
            raise ValueError(
                f"aux_loss_microbatches={given}, but this pipeline computes the router losses on each of its "
                f"{pipeline_microbatches} micro-batches (n_microbatches x data_parallel_size): set aux_loss_microbatches "
                f"to {pipeline_microbatches} (or leave it unset) so one device and the pipeline train the same objective."
            )
        return pipeline_microbatches or given or 1

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
