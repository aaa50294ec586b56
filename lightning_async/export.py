"""``lightning-async export CKPT OUT_DIR``: a training checkpoint as a Hugging Face model directory.

``CKPT`` is a pipeline checkpoint directory (``meta.json`` + ``stage-NN.ckpt``, merged with
:func:`~lightning_async.pipeline.checkpoint.consolidate`) or a single-device Lightning ``.ckpt`` file of an
:class:`~lightning_async.models.hf.HFCausalLM`. The config is rebuilt from the checkpoint's hyperparameters
(``model`` holds the full config), the weights from its state dict; ``save_pretrained`` writes
``config.json`` and ``model.safetensors`` (tied weights once), which
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads.

The tokenizer the run trained with (the data module's, recorded in the checkpoint) is written next to them when it
is a Hugging Face one (``tokenizer: hf``, or the ``bpe`` trained on the corpus), so
``AutoTokenizer.from_pretrained(OUT_DIR)`` works too; the byte tokenizer has no files (ids 0-255 are UTF-8 bytes,
256 ends a document), which the output says.

Checkpoints of our own :class:`~lightning_async.lm.CausalLM` (the SmolLM2-style decoder) are written as a
``LlamaForCausalLM``: the architecture is Llama's (RMSNorm, RoPE in the half-split layout, grouped-query
attention, SiLU-gated MLP), so only the names change (:data:`SMOLLM2_TO_LLAMA`).

``--to one-device`` and ``--to pipeline`` convert a training checkpoint between the pipeline and the one-device delay
simulation instead (:mod:`~lightning_async.pipeline.one_device`): a pipeline DCP checkpoint directory becomes the
Lightning ``.ckpt`` of a ``strategy="auto"`` run with ``DelaySimulation(1)``, and back. The module (its parameter names
and optimizer) is rebuilt from the checkpoint's hyperparameters: an ``HFCausalLM`` or a ``CausalLM``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from lightning_async.pipeline import distributed_checkpoint
from lightning_async.pipeline.checkpoint import consolidate, resolve, stage_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREFIX = "model."  # both LightningModules keep their model under ``self.model``
# SmolLM2 parameter names -> LlamaForCausalLM's (a compiled block adds ``_orig_mod.``)
SMOLLM2_TO_LLAMA = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^blocks\.(\d+)\.(?:_orig_mod\.)?attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blocks\.(\d+)\.(?:_orig_mod\.)?attn\.", r"model.layers.\1.self_attn."),
    (r"^blocks\.(\d+)\.(?:_orig_mod\.)?mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blocks\.(\d+)\.(?:_orig_mod\.)?mlp\.", r"model.layers.\1.mlp."),
    (r"^head\.norm\.", "model.norm."),
    (r"^head\.proj\.", "lm_head."),
]


DATA_HPARAMS = "datamodule_hyper_parameters"  # where Lightning keeps the data module's arguments in a checkpoint
TARGETS = ("huggingface", "one-device", "pipeline")  # what --to writes


def read_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``(state_dict, hyper_parameters, datamodule_hyper_parameters)`` of a pipeline checkpoint directory or a
    Lightning ``.ckpt`` file (the last one empty when the run had no data module with hyperparameters)."""
    if os.path.isdir(path) and distributed_checkpoint.is_distributed_checkpoint(resolve(path)):
        saved = distributed_checkpoint.trainer_state(resolve(path))
        return consolidate(path), dict(saved.get("hyper_parameters") or {}), dict(saved.get(DATA_HPARAMS) or {})
    if os.path.isdir(path):
        files = stage_files(path)
        first = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
        return consolidate(path), dict(first.get("hyper_parameters") or {}), dict(first.get(DATA_HPARAMS) or {})
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: give a pipeline checkpoint directory or a Lightning .ckpt file.")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return checkpoint["state_dict"], dict(checkpoint.get("hyper_parameters") or {}), dict(checkpoint.get(DATA_HPARAMS) or {})


def smollm2_as_llama(hparams: dict, weights: dict[str, torch.Tensor]):
    """A ``CausalLM`` checkpoint's config and weights as a ``LlamaConfig`` and Llama parameter names."""
    from transformers import LlamaConfig

    from lightning_async.models import model_config

    cfg = model_config(hparams.get("model", "tiny"), vocab_size=hparams.get("vocab_size"), **(hparams.get("model_overrides") or {}))
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, hidden_act="silu",
        attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    renamed = {}
    for name, value in weights.items():
        for pattern, replacement in SMOLLM2_TO_LLAMA:
            name, hits = re.subn(pattern, replacement, name)
            if hits:
                break
        renamed[name] = value
    return config, renamed


def hf_model_from_checkpoint(path: str, state: dict[str, torch.Tensor], hparams: dict):
    """The Hugging Face ``*ForCausalLM`` holding the checkpoint's (newest) weights (``state``, ``hparams``: what
    :func:`read_checkpoint` read from ``path``)."""
    from transformers import AutoModelForCausalLM

    from lightning_async.models.hf import config_from_dict

    weights = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    fields = hparams.get("model")
    if isinstance(fields, dict) and "model_type" in fields:  # HFCausalLM: the whole config
        config = config_from_dict(fields)
    elif isinstance(fields, str) and any(k.startswith("blocks.") for k in weights):  # CausalLM: a named shape
        config, weights = smollm2_as_llama(hparams, weights)
    else:
        raise ValueError(
            f"{path} holds neither an HFCausalLM nor a CausalLM (hyperparameter model={fields!r}); export writes "
            "the weights of these two only. For another module, merge the weights with "
            "`python -m lightning_async.pipeline.checkpoint CKPT_DIR model.pt`."
        )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"The weights in {path} do not fit a {type(model).__name__} built from its config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}."
        )
    return model


def export_tokenizer(data_hparams: dict, out_dir: str) -> str:
    """Write the run's tokenizer into ``out_dir`` as Hugging Face tokenizer files; return a line saying what was
    written (or why nothing was)."""
    name = data_hparams.get("tokenizer")
    if name is None:
        return "tokenizer: not recorded in the checkpoint (no data module); copy the tokenizer files into the directory yourself."
    if name == "byte":
        return ("tokenizer: byte-level, no files to write: ids 0-255 are the UTF-8 bytes of the text and 256 ends a "
                "document (encode with list(text.encode('utf-8'))).")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from lightning_async.data import TextDataModule

    directory = data_hparams.get("tokenizer_path")
    if name == "hf" and directory and os.path.isfile(os.path.join(directory, "tokenizer_config.json")):
        AutoTokenizer.from_pretrained(directory, local_files_only=True).save_pretrained(out_dir)  # its whole configuration
        return f"tokenizer: {directory} (AutoTokenizer.from_pretrained({out_dir!r}) loads it)"
    tokenizer = TextDataModule(**data_hparams).tokenizer  # hf: the tokenizer.json; bpe: the trained one, from the cache
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, eos_token=tokenizer.eod_token)
    wrapped.save_pretrained(out_dir)
    status = f", {tokenizer.status}" if getattr(tokenizer, "status", None) else ""
    return f"tokenizer: {name} ({tokenizer.source}{status}; AutoTokenizer.from_pretrained({out_dir!r}) loads it)"


def export(path: str, out_dir: str, dtype: str = "float32", tokenizer: bool = True) -> str:
    """Write the checkpoint at ``path`` as a Hugging Face model directory ``out_dir`` (with the run's tokenizer unless
    ``tokenizer`` is false); return the line about the tokenizer."""
    state, hparams, data_hparams = read_checkpoint(path)
    model = hf_model_from_checkpoint(path, state, hparams).to(DTYPES[dtype])
    model.save_pretrained(out_dir)
    if not tokenizer:
        return "tokenizer: not written (--no-tokenizer)"
    try:
        return export_tokenizer(data_hparams, out_dir)
    except (OSError, ValueError) as err:  # the data module's errors are ValueError / FileNotFoundError
        return f"tokenizer: NOT written ({err}); the model is. Copy the tokenizer files into {out_dir} yourself."


def training_module(path: str):
    """The LightningModule a training checkpoint (pipeline DCP directory or ``.ckpt``) was saved from, rebuilt from
    its hyperparameters with fresh weights: an ``HFCausalLM`` (``model`` holds the whole config) or a ``CausalLM``."""
    if os.path.isdir(path) and distributed_checkpoint.is_distributed_checkpoint(resolve(path)):
        hparams = dict(distributed_checkpoint.trainer_state(resolve(path)).get("hyper_parameters") or {})
    elif os.path.isfile(path):
        hparams = dict(torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("hyper_parameters") or {})
    else:
        raise ValueError(f"{path} is neither a pipeline checkpoint of checkpoint_format='dcp' nor a Lightning .ckpt file: "
                         "--to one-device reads the first (resume a stage-file checkpoint once with "
                         "checkpoint_format='dcp' and save), --to pipeline the second.")
    hparams.pop("pretrained_from", None)  # (HFCausalLM's record of its source; not an argument)
    fields = hparams.get("model")
    if isinstance(fields, dict) and "model_type" in fields:
        from lightning_async.models.hf import HFCausalLM

        return HFCausalLM(**hparams)
    if isinstance(fields, str):
        from lightning_async.lm import CausalLM

        return CausalLM(**hparams)
    raise ValueError(
        f"{path} holds neither an HFCausalLM nor a CausalLM (hyperparameter model={fields!r}); for another module call "
        "lightning_async.pipeline.one_device.to_one_device(CKPT, OUT, module) or to_pipeline(...) with your module."
    )


def convert(path: str, out: str, to: str) -> str:
    """``--to one-device`` / ``--to pipeline``: write ``out``; return the line saying how to resume it."""
    from lightning_async.pipeline import one_device

    module = training_module(path)
    if to == "one-device":
        one_device.to_one_device(path, out, module)
        return (f"resume it on one device: Trainer(strategy='auto', callbacks=[DelaySimulation(1), <the run's "
                f"correction, e.g. ErrorFeedback(1.0)>]).fit(model, ckpt_path={out!r})")
    one_device.to_pipeline(path, out, module)
    return (f"resume it on a pipeline: AsyncPipelineStrategy(schedule='2bw', checkpoint_format='dcp', <the run's "
            f"correction>), any stage and replica count, fit(ckpt_path={out!r})")


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-async export",
        description="Write a training checkpoint of an HFCausalLM (or a CausalLM, as a Llama) as a Hugging Face model directory "
        "(AutoModelForCausalLM.from_pretrained(OUT_DIR) loads it), with the run's tokenizer (AutoTokenizer.from_pretrained(OUT_DIR)); "
        "or, with --to one-device / --to pipeline, convert it between the pipeline and the one-device delay simulation.",
    )
    parser.add_argument("checkpoint", help="pipeline checkpoint directory (meta.json + stage-NN.ckpt) or a Lightning .ckpt file")
    parser.add_argument("out_dir", help="output directory (config.json, model.safetensors); with --to one-device a .ckpt "
                        "file, with --to pipeline a checkpoint directory")
    parser.add_argument("--to", choices=TARGETS, default="huggingface",
                        help="huggingface (default): a model directory; one-device: a pipeline DCP checkpoint as the "
                        "Lightning .ckpt of the one-device delay simulation (DelaySimulation(1)), to continue training; "
                        "pipeline: such a one-device .ckpt as a pipeline DCP checkpoint")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype to save (default float32)")
    parser.add_argument("--no-tokenizer", action="store_true", help="write the model only, not the run's tokenizer")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.to == "huggingface":
            note = export(args.checkpoint, args.out_dir, args.dtype, tokenizer=not args.no_tokenizer)
        else:
            note = convert(args.checkpoint, args.out_dir, args.to)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(export_main())
