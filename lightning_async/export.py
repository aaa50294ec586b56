"""``lightning-async export CKPT OUT_DIR``: a training checkpoint as a Hugging Face model directory.

``CKPT`` is a pipeline checkpoint directory (``meta.json`` + ``stage-NN.ckpt``, merged with
:func:`~lightning_async.pipeline.checkpoint.consolidate`) or a single-device Lightning ``.ckpt`` file of an
:class:`~lightning_async.models.hf.HFCausalLM`. The config is rebuilt from the checkpoint's hyperparameters
(``model`` holds the full config), the weights from its state dict; ``save_pretrained`` writes
``config.json`` and ``model.safetensors`` (tied weights once), which
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads. Copy the tokenizer files next to them yourself.

Checkpoints of our own :class:`~lightning_async.lm.CausalLM` (the SmolLM2-style decoder) are written as a
``LlamaForCausalLM``: the architecture is Llama's (RMSNorm, RoPE in the half-split layout, grouped-query
attention, SiLU-gated MLP), so only the names change (:data:`SMOLLM2_TO_LLAMA`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from lightning_async.pipeline.checkpoint import consolidate, stage_files

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


def read_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(state_dict, hyper_parameters)`` of a pipeline checkpoint directory or a Lightning ``.ckpt`` file."""
    if os.path.isdir(path):
        files = stage_files(path)
        first = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)
        return consolidate(path), dict(first.get("hyper_parameters") or {})
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: give a pipeline checkpoint directory or a Lightning .ckpt file.")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return checkpoint["state_dict"], dict(checkpoint.get("hyper_parameters") or {})


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


def hf_model_from_checkpoint(path: str):
    """The Hugging Face ``*ForCausalLM`` holding the checkpoint's (newest) weights."""
    from transformers import AutoModelForCausalLM

    from lightning_async.models.hf import config_from_dict

    state, hparams = read_checkpoint(path)
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


def export(path: str, out_dir: str, dtype: str = "float32") -> str:
    """Write the checkpoint at ``path`` as a Hugging Face model directory ``out_dir``; return ``out_dir``."""
    model = hf_model_from_checkpoint(path).to(DTYPES[dtype])
    model.save_pretrained(out_dir)
    return out_dir


def export_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-async export",
        description="Write a training checkpoint of an HFCausalLM (or a CausalLM, as a Llama) as a Hugging Face model directory "
        "(AutoModelForCausalLM.from_pretrained(OUT_DIR) loads it).",
    )
    parser.add_argument("checkpoint", help="pipeline checkpoint directory (meta.json + stage-NN.ckpt) or a Lightning .ckpt file")
    parser.add_argument("out_dir", help="output directory (config.json, model.safetensors)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype to save (default float32)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        export(args.checkpoint, args.out_dir, args.dtype)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(export_main())
