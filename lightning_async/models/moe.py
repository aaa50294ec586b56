"""Router load balancing for mixture-of-experts decoder layers, computed per layer so it works through a pipeline.

Hugging Face adds an MoE's load-balancing loss in the ``*ForCausalLM`` forward, from every layer's router
logits at once; a pipeline never runs that forward (and no stage holds every layer). Here each MoE decoder
layer computes its own loss from its router's logits and attaches it to its output with :class:`AttachLoss`,
an autograd function that passes the output through unchanged and, in the backward, adds the loss's gradient
(Megatron-LM's ``MoEAuxLossAutoScaler``). Nothing extra crosses a stage boundary.

The objective (``docs/models.md``, "Example 4: a mixture of experts"), for ``L`` MoE layers and ``m`` micro-batches::

    loss = CE + (1 / L) * sum_l  mean_over_microbatches( aux_coef * balance_l + z_coef * z_l )

with ``balance_l = E * sum_e f_e * P_e`` (Switch Transformer; ``f_e`` the share of top-k assignments to expert
``e``, ``P_e`` its mean router probability, over the micro-batch's tokens) and ``z_l`` the mean squared
log-sum-exp of the router logits (ST-MoE's z-loss). For one MoE layer and one micro-batch it is exactly Hugging
Face's ``loss`` with ``output_router_logits=True``.

The runtime backpropagates each micro-batch's loss divided by ``m``, so the loss a layer attaches in a forward of
one micro-batch gets the gradient ``1 / m`` (:meth:`RouterLoss.one_forward_per_microbatch`). On one device a
forward sees the whole batch: the layer then cuts its tokens into the same ``m`` micro-batches and averages
(:meth:`RouterLoss.whole_batch_per_forward`), which is the same objective to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class AttachLoss(torch.autograd.Function):
    """``output`` unchanged in the forward; in the backward, ``loss`` gets the gradient ``scale`` (as if
    ``scale * loss`` had been added to the objective) while ``output``'s gradient passes through."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


def balance_and_z_losses(logits: torch.Tensor, top_k: int, chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-layer router losses of ``logits`` ``[tokens, experts]``, averaged over ``chunks`` equal runs of tokens.

    Returns ``(balance, z, tokens_per_expert)``: the Switch load-balancing loss (Hugging Face's formula for one
    layer: ``E * sum_e f_e P_e``, 1.0 * ``top_k`` when balanced), the z-loss, and the top-k assignment counts per
    expert over all tokens (no gradient).
    """
    tokens, experts = logits.shape
    if tokens % chunks:
        raise ValueError(
            f"The router saw {tokens} tokens, which do not cut into {chunks} equal micro-batches: the batch size must be "
            f"a multiple of the MoE's aux_loss_microbatches ({chunks}), as under a pipeline."
        )
    logits = logits.float().reshape(chunks, tokens // chunks, experts)
    probs = torch.softmax(logits, dim=-1)
    with torch.no_grad():
        chosen = probs.topk(top_k, dim=-1).indices
        counts = F.one_hot(chosen, experts).sum(dim=2).float().sum(dim=1)  # [chunks, experts]
    share = counts / (tokens // chunks)
    balance = experts * (share * probs.mean(dim=1)).sum(dim=-1)
    z = torch.logsumexp(logits, dim=-1).pow(2).mean(dim=-1)
    return balance.mean(), z.mean(), counts.sum(dim=0)


@dataclass
class RouterLoss:
    """The per-layer router losses of a model and how their gradient is scaled (one object, shared by its layers).

    ``aux_coef``/``z_coef`` weigh the balance and z losses; each layer's share is divided by ``moe_layers`` (the
    model's number of MoE layers), so the coefficient means what it means in Hugging Face's global loss.
    ``chunks`` is the number of micro-batches one forward holds and ``backward_scale`` the gradient of the
    attached loss: (1, 1) by default (a forward is a batch: the plain per-layer objective).
    """

    aux_coef: float
    z_coef: float
    moe_layers: int
    chunks: int = 1
    backward_scale: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.aux_coef or self.z_coef)

    def one_forward_per_microbatch(self, n_microbatches: int) -> None:
        """Each forward is one of ``n_microbatches`` micro-batches whose losses are averaged (the pipeline runtime,
        which backpropagates each micro-batch's loss divided by ``n_microbatches``; a reference loop doing the same)."""
        self.chunks, self.backward_scale = 1, 1.0 / n_microbatches

    def whole_batch_per_forward(self, n_microbatches: int) -> None:
        """Each forward is a whole batch that stands for ``n_microbatches`` micro-batches (one device)."""
        self.chunks, self.backward_scale = n_microbatches, 1.0

    def layer_loss(self, balance: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (self.aux_coef * balance + self.z_coef * z) / self.moe_layers


@dataclass
class RouterStatistics:
    """Per MoE layer, sums over the training forwards since the last :meth:`read`: the balance loss, the z-loss
    and the expert load (the busiest expert's tokens over the mean, 1.0 when balanced; ``E / top_k`` when every
    token goes to the same experts). Kept as tensors on the layer's device: reading syncs once."""

    sums: dict[int, torch.Tensor] = field(default_factory=dict)

    def record(self, layer: int, balance: torch.Tensor, z: torch.Tensor, tokens_per_expert: torch.Tensor) -> None:
        load = tokens_per_expert.max() / tokens_per_expert.mean().clamp_min(1e-9)
        values = torch.stack([balance.detach().float(), z.detach().float(), load.float(), torch.ones_like(load.float())])
        self.sums[layer] = self.sums[layer] + values if layer in self.sums else values

    def read(self) -> dict[int, dict[str, float]]:
        """``{layer: {"aux_loss", "z_loss", "load"}}`` averaged over the forwards recorded; then starts afresh."""
        means = {}
        for layer, sums in sorted(self.sums.items()):
            aux, z, load, count = sums.tolist()
            means[layer] = {"aux_loss": aux / count, "z_loss": z / count, "load": load / count}
        self.sums = {}
        return means


class RouterCapture:
    """Holds the router output a forward hook saw (registered only around one layer call, so nothing stays
    installed on the model: it pickles for the spawn launcher)."""

    def __init__(self, router: nn.Module, index: int) -> None:
        self.router, self.index, self.logits = router, index, None

    def __call__(self, module, args, output) -> None:
        self.logits = output[self.index] if isinstance(output, (tuple, list)) else output

    def __enter__(self) -> RouterCapture:
        self.logits = None
        self._handle = self.router.register_forward_hook(self)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
