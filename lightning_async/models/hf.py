"""``HFCausalLM``: a Hugging Face ``*ForCausalLM`` as a LightningModule that the pipeline strategy can split.

The pipeline units are derived from the model's pipeline plan (``config.base_model_pp_plan`` and the
class's ``_pp_plan``, present on Llama, Qwen2/3, Mistral and others) or, without a plan, from the
common layout ``model.embed_tokens / model.layers.N / model.norm / lm_head``: the embedding, each decoder
layer, the final norm and the head, under their own module paths (so state-dict keys stay Hugging
Face's). Decoder layers get what they need besides the hidden states (position ids, RoPE cos/sin from the
model's rotary embedding, the attention mask, ``None`` under SDPA where ``is_causal`` suffices) from
:meth:`HFCausalLM.pipeline_context`, which every stage computes for itself.

``transformers`` is an optional dependency (``pip install -e ".[hf]"``); this module imports it.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

try:
    from transformers import AutoModelForCausalLM, PretrainedConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lightning_async.models.hf needs the transformers package: pip install 'lightning-async[hf]' "
        "(or pip install 'transformers>=4.50')."
    ) from err

from lightning_async.models.moe import AttachLoss, RouterCapture, RouterLoss, RouterStatistics, balance_and_z_losses
from lightning_async.models.moe_logging import ExpertStatisticsLogger
from lightning_async.models.training import CausalLMTraining
from lightning_async.pipeline.boundary import NO_CONTEXT, call_unit, takes_context

# attention kind of a layer (config.layer_types) -> the Hugging Face function building its mask
MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
# the mask functions' cache argument: ``cache`` since transformers 5.2x, ``past_key_values`` before
_NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}
_CAPTURING_MODULE = "transformers.utils.output_capturing"  # where Hugging Face's local capture hooks are defined
HOW_TO_OVERRIDE = (
    "Subclass HFCausalLM and override pipeline_units() (ordered (name, module) pairs under `model.`, each name "
    "a module path) and, if the layers need side inputs, pipeline_context(input_ids); see docs/models.md."
)


# ---- configs and loading ------------------------------------------------------------------------
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


# ---- units and how they are called -------------------------------------------------------------
class UnitView(nn.Module):
    """A view of ``module`` as a pipeline unit with a forward of its own.

    Not a container: it shares the module's parameters, buffers and submodules under the same names, so a stage's
    parameter names are the model's (``self_attn.q_proj.weight``, no extra level) while the module stays
    registered under its own path in the model (the unit's name, where the other stages put a placeholder).
    Other modules the forward needs (a dropout, a router) go in ``__dict__``, unregistered: the model owns them.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._parameters, self._buffers, self._modules = module._parameters, module._buffers, module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self.__dict__["viewed"] = module  # not registered again: its contents already are


class DecoderLayerUnit(UnitView):
    """A Hugging Face decoder layer as a pipeline unit: hidden states in and out; position ids, RoPE
    tables and the attention mask come from the context."""

    def __init__(self, layer: nn.Module, attention_type: str = "full_attention") -> None:
        super().__init__(layer)
        self.attention_type = attention_type

    @property
    def layer(self) -> nn.Module:
        return self.viewed

    def forward(self, hidden_states: torch.Tensor, context: dict) -> torch.Tensor:
        out = self.layer(
            hidden_states,
            attention_mask=context["attention_masks"][self.attention_type],
            position_ids=context["position_ids"],
            position_embeddings=context["position_embeddings"],
        )
        return out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returned a tuple


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


def run_units(units: Sequence[tuple[str, nn.Module]], inputs, context):
    """Compose ``units`` on ``inputs`` on one device, calling each as the pipeline does."""
    value = inputs
    for _, unit in units:
        value = call_unit(unit, value, context if takes_context(unit) else NO_CONTEXT)
    return value


def plan_units(hf: nn.Module, prefix: str = "model", moe: MoELayers | None = None) -> list[tuple[str, nn.Module]]:
    """The pipeline units of a ``*ForCausalLM``: from its pipeline plan, else from the common layout. With ``moe``,
    a decoder layer holding a router becomes a :class:`MoEDecoderLayerUnit`.

    Raises ``ValueError`` (saying how to provide the units by hand) when the model has neither.
    """
    config = hf.config
    base_name = getattr(hf, "base_model_prefix", "model")
    base = getattr(hf, base_name, None)
    base_plan = getattr(config, "base_model_pp_plan", None)
    head_plan = getattr(type(hf), "_pp_plan", None) or {}  # the instance's merged plan is not in forward order
    if base is not None and base_plan:
        base_keys, head_keys = list(base_plan), list(head_plan) or ["lm_head"]
    elif base is not None and all(hasattr(base, k) for k in ("embed_tokens", "layers", "norm")) and hasattr(hf, "lm_head"):
        base_keys, head_keys = ["embed_tokens", "layers", "norm"], ["lm_head"]
    else:
        raise ValueError(
            f"{type(hf).__name__} has no pipeline plan (config.base_model_pp_plan) and not the common layout "
            f"model.embed_tokens / model.layers.N / model.norm / lm_head, so its pipeline units cannot be derived. "
            + HOW_TO_OVERRIDE
        )
    layer_types = getattr(config, "layer_types", None)
    units: list[tuple[str, nn.Module]] = []
    for key in base_keys:
        module = getattr(base, key)
        if isinstance(module, nn.ModuleList):
            for i, layer in enumerate(module):
                kind = layer_types[i] if layer_types else "full_attention"
                router = moe.router_of(layer) if moe is not None else None
                unit = DecoderLayerUnit(layer, kind) if router is None else MoEDecoderLayerUnit(layer, kind, i, router, moe)
                units.append((f"{prefix}.{base_name}.{key}.{i}", unit))
        else:
            units.append((f"{prefix}.{base_name}.{key}", module))
    units += [(f"{prefix}.{key}", getattr(hf, key)) for key in head_keys]
    return units


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
        attn_implementation: ``"sdpa"`` (causal attention without a mask tensor) or another transformers
            attention implementation (``"eager"`` builds a mask per micro-batch).
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
            self.model = AutoModelForCausalLM.from_pretrained(
                model, dtype=torch.float32, attn_implementation=attn_implementation, local_files_only=True,
                **(model_overrides or {}),
            )
            self._check_vocab_fits(vocab_size, str(model))
            self.hparams["pretrained_from"] = os.fspath(model)  # for the record; not an argument
        else:
            config = resolve_config(model, model_overrides)
            if vocab_size is not None:
                config.vocab_size = vocab_size
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
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
        """What every decoder layer needs besides the hidden states, for a micro-batch of ``input_ids``."""
        base = self.model.base_model
        batch, length = input_ids.shape[:2]
        # the masks and RoPE tables read only the shape, dtype and device of the embeddings
        like = torch.empty(batch, length, 0, dtype=self.model.dtype, device=input_ids.device)
        position_ids = torch.arange(length, device=input_ids.device).unsqueeze(0)
        kinds = set(getattr(self.config, "layer_types", None) or ["full_attention"])
        unknown = kinds - set(MASK_BUILDERS)
        if unknown:
            raise ValueError(f"Layers with attention {sorted(unknown)} are not supported by HFCausalLM. " + HOW_TO_OVERRIDE)
        masks = {
            kind: MASK_BUILDERS[kind](config=self.config, inputs_embeds=like, attention_mask=None, position_ids=position_ids, **_NO_CACHE)
            for kind in kinds
        }
        rotary = getattr(base, "rotary_emb", None)
        embeddings = rotary(like, position_ids) if rotary is not None else None
        return {"position_ids": position_ids, "position_embeddings": embeddings, "attention_masks": masks}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits: the pipeline units composed on one device."""
        return run_units(self.pipeline_units(), input_ids, self.pipeline_context(input_ids))

    def check_units(self, length: int = 8) -> None:
        """Raise if the units do not reproduce the Hugging Face model's own forward (e.g. a model that scales
        its embeddings in the base model's forward). Runs one short sequence at construction."""
        if any(p.is_meta for p in self.model.parameters()):
            return
        ids = torch.arange(length, device=self.model.device).remainder(self.config.vocab_size).unsqueeze(0)
        training = self.model.training
        self.model.eval()  # no dropout
        try:
            with torch.no_grad():
                expected = self.model(input_ids=ids, use_cache=False).logits
                got = self(ids)
        finally:
            self.model.train(training)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            diff = (got - expected).abs().max().item() if isinstance(got, torch.Tensor) and got.shape == expected.shape else "shape"
            raise ValueError(
                f"The pipeline units of {type(self.model).__name__} do not reproduce its forward pass (max |diff| {diff}): "
                "its base model does more than embed -> layers -> norm (e.g. scales the embeddings). " + HOW_TO_OVERRIDE
            )

    @property
    def max_seq_len(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def _depth_and_width(self) -> tuple[int, int]:
        return self.config.num_hidden_layers, self.config.hidden_size
