"""A SmolLM2-style decoder: RMSNorm, RoPE, grouped-query attention, SiLU-gated MLP, tied embeddings.

The model is a sequence of pipeline units: ``embed`` -> ``blocks[0..N-1]`` -> ``norm`` + ``head``.
A pipeline cuts only between these units (see :mod:`lightning_async.pipeline.partition`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SmolLM2Config:
    """Shape of the decoder. ``vocab_size`` is usually set from the tokenizer."""

    vocab_size: int = 49152
    hidden_size: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    ffn_size: int = 1536
    max_seq_len: int = 2048
    rms_eps: float = 1e-5
    rope_theta: float = 100000.0
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


MODEL_CONFIGS: dict[str, SmolLM2Config] = {
    # CPU-sized: 0.82M parameters with the 257-token byte vocabulary.
    "tiny": SmolLM2Config(
        vocab_size=257, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_size=384, max_seq_len=512
    ),
    # 0.12M parameters: the CPU study at the paper's ~20 tokens per parameter (recipes/study/paper-regime*.yaml)
    # costs about 2 minutes per run on one core. Width 64 is the narrowest where one step stays
    # matmul-bound on a CPU; 2 layers keep the cost per token at ~50 us (measured, docs/results.md).
    "nano": SmolLM2Config(
        vocab_size=257, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=192, max_seq_len=256
    ),
    # 0.12M parameters like `nano`, but deep and thin: 30 blocks of width 16, so the 32 units (embed, 30 blocks,
    # head) give one unit per stage at p = 32 for the depth study (recipes/study/evidence/depth-*.yaml); the same
    # ~20 tokens per parameter in 2400 steps of 16 x 64 tokens.
    "deep": SmolLM2Config(
        vocab_size=257, hidden_size=16, num_layers=30, num_heads=2, num_kv_heads=1, ffn_size=24, max_seq_len=256
    ),
    # 19.0M parameters with the byte vocabulary (22.0M with its 8192): the smallest "real" size for GPU reproduction runs.
    "small": SmolLM2Config(
        vocab_size=8192, hidden_size=384, num_layers=12, num_heads=6, num_kv_heads=2, ffn_size=1024, max_seq_len=1024
    ),
    # Public shapes of HuggingFaceTB/SmolLM2-135M and -360M.
    "smollm2-135m": SmolLM2Config(),
    "smollm2-360m": SmolLM2Config(hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5, ffn_size=2560),
}


def model_config(name: str, **overrides) -> SmolLM2Config:
    """Look up a named config and apply ``overrides`` (e.g. ``vocab_size``)."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"Unknown model config {name!r}. Choose one of: {', '.join(MODEL_CONFIGS)}.")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(MODEL_CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape ``[seq_len, head_dim]`` (half-split layout, as in Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: SmolLM2Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    def __init__(self, cfg: SmolLM2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """One pre-norm transformer block; the unit of pipeline partitioning."""

    def __init__(self, cfg: SmolLM2Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = GatedMLP(cfg)
        self.rope_theta = cfg.rope_theta
        self.head_dim = cfg.head_dim

    def forward(self, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``context``: the RoPE ``(cos, sin)`` tables of :meth:`SmolLM2.pipeline_context` (computed here if None)."""
        cos, sin = context if context is not None else rotary_tables(x.shape[1], self.head_dim, self.rope_theta, device=x.device)
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LMHead(nn.Module):
    """Final RMSNorm and the output projection (weight tied to the embedding when configured)."""

    def __init__(self, cfg: SmolLM2Config) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.proj = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class SmolLM2(nn.Module):
    """Decoder-only LM. ``pipeline_units()`` lists the modules a pipeline may place on stages."""

    def __init__(self, cfg: SmolLM2Config) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.num_layers))
        self.head = LMHead(cfg)
        if cfg.tie_embeddings:
            self.head.proj.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.ndim == 2:
                # GPT-2 style: scale the residual output projections down with depth.
                scale = 1 / math.sqrt(2 * self.config.num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)
            else:
                nn.init.ones_(p)

    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        """Ordered (name, module) pairs: the sequence a pipeline splits."""
        units = [("embed", self.embed)]
        units += [(f"blocks.{i}", block) for i, block in enumerate(self.blocks)]
        units.append(("head", self.head))
        return units

    def pipeline_context(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every block needs besides its input: the RoPE ``(cos, sin)`` tables, once per forward (or per
        pipeline stage and micro-batch) instead of once per block."""
        return rotary_tables(input_ids.shape[1], self.config.head_dim, self.config.rope_theta, device=input_ids.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        context = self.pipeline_context(input_ids)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, context=context)
        return self.head(x)


def count_parameters(cfg: SmolLM2Config) -> int:
    """Unique parameters of ``cfg``, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = SmolLM2(cfg)
    return sum(p.numel() for p in model.parameters())
