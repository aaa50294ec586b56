"""``BatchedMuon`` and ``NorMuon``: Muon with same-shape matrices orthogonalised together.

``torch.optim.Muon`` runs the Newton-Schulz (NS) iteration once per matrix. A SmolLM2-135M stage
has 210 hidden matrices but only five shapes, so the step is dominated by kernel launches and
small matmuls. Here each step

1. updates the momentum buffers of a group with ``torch._foreach_*`` calls (same formulas as
   ``torch.optim.Muon``: ``buf.lerp_(g, 1 - mu)``, Nesterov ``g.lerp(buf, mu)``);
2. orients every update wide (``rows <= cols``, transposing tall ones), buckets them by oriented
   shape (so ``[1536, 576]`` and ``[576, 1536]`` share a bucket), stacks each bucket into
   ``[n, rows, cols]`` and runs the quintic NS iteration with ``torch.bmm``/``torch.baddbmm``;
3. applies decoupled decay ``p *= 1 - lr * wd`` (unscaled lr) and ``p -= adjusted_lr * O`` with
   ``adjust_lr_fn`` exactly as ``torch.optim.Muon`` (``None``/``"original"``:
   ``sqrt(max(1, rows/cols))``; ``"match_rms_adamw"``: ``0.2 sqrt(max(rows, cols))``).

``NorMuon`` (Li et al. 2025, arXiv 2510.05491) adds, between 2 and 3, a per-row (per output
neuron) second moment ``v = beta2 v + (1 - beta2) mean_cols(O * O)``, the normalisation
``O / (sqrt(v) + eps)``, and a Frobenius rescale that gives the normalised update the norm ``O``
had, so its RMS (and therefore the learning rate) matches Muon's.

Neither optimizer modifies ``p.grad``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_async.optim.closure import evaluate_closure

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # Jordan et al. 2024, as in torch.optim.Muon
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size | tuple[int, ...]) -> float:
    """The learning rate Muon applies to the orthogonalised update of a ``shape`` matrix."""
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def batched_newton_schulz(
    x: Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalise each matrix of a wide stack ``x`` (``[n, rows, cols]``, rows <= cols).

    Returns a new tensor of dtype ``dtype``. Each matrix is divided by its Frobenius norm (clamped
    at ``eps``) and then iterated ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``.
    """
    if x.ndim != 3:
        raise ValueError(f"expected a [n, rows, cols] stack, got shape {tuple(x.shape)}")
    if x.shape[-2] > x.shape[-1]:
        raise ValueError("orient the stack wide (rows <= cols) before the iteration")
    if steps >= 100:
        raise ValueError("ns_steps must be below 100")
    a, b, c = coefficients
    x = x.to(dtype)
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_(min=eps)
    x = x / norms
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x


class BatchedMuon(Optimizer):
    """Muon for 2-D parameters, with ``torch.optim.Muon``'s semantics and batched Newton-Schulz.

    Args:
        params: 2-D parameters (or groups of them).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as in
            ``torch.optim.Muon`` (same defaults).
        ns_dtype: dtype of the Newton-Schulz iteration (``torch.bfloat16`` like torch's Muon;
            ``torch.float32`` for exact comparisons).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = NS_EPS,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        **extra_defaults,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if momentum < 0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        if len(ns_coefficients) != 3:
            raise ValueError("ns_coefficients must hold exactly three values (a, b, c)")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            **extra_defaults,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"{type(self).__name__} only supports 2-D parameters, got one of shape {tuple(p.shape)}")

    # ---- hooks for NorMuon -------------------------------------------------------------------
    def _init_extra_state(self, p: Tensor, state: dict) -> None:
        """Create per-parameter state beyond the momentum buffer (NorMuon: the row second moment)."""

    def _postprocess(self, group: dict, ortho: Tensor, params: list[Tensor], transposed: bool) -> Tensor:
        """Transform a stack of orthogonalised updates of identical original shape (oriented wide)."""
        return ortho

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        params, grads, bufs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if torch.is_complex(p):
                raise RuntimeError(f"{type(self).__name__} does not support complex parameters")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                self._init_extra_state(p, state)
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])
        if not params:
            return
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs

        # bucket by oriented (wide) shape, then by orientation: every slice shares one original shape
        buckets: dict[tuple, list[int]] = defaultdict(list)
        for i, u in enumerate(updates):
            rows, cols = u.shape
            buckets[(min(rows, cols), max(rows, cols), u.dtype, u.device)].append(i)
        lr, wd = float(group["lr"]), group["weight_decay"]
        for index in buckets.values():
            index.sort(key=lambda i: updates[i].shape[0] > updates[i].shape[1])
            stack = torch.stack([updates[i].mT if updates[i].shape[0] > updates[i].shape[1] else updates[i] for i in index])
            ortho = batched_newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
            start = 0
            while start < len(index):
                tall = updates[index[start]].shape[0] > updates[index[start]].shape[1]
                stop = start
                while stop < len(index) and (updates[index[stop]].shape[0] > updates[index[stop]].shape[1]) == tall:
                    stop += 1
                part = [params[i] for i in index[start:stop]]
                out = self._postprocess(group, ortho[start:stop], part, tall)
                if tall:
                    out = out.mT
                out = out.to(dtype=part[0].dtype, memory_format=torch.contiguous_format)
                if wd != 0:
                    torch._foreach_mul_(part, 1 - lr * wd)
                torch._foreach_add_(part, list(out.unbind(0)), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], part[0].shape))
                start = stop

    def effective_learning_rates(self) -> dict[str, float]:
        """Learning rate applied to the orthogonalised update, per matrix shape ``"rowsxcols"``."""
        return _effective_by_shape(self)


class NorMuon(BatchedMuon):
    """Muon followed by per-row second-moment normalisation (Li et al. 2025, arXiv 2510.05491).

    Per 2-D parameter ``W`` (``[rows, cols]``, rows = output neurons of an ``nn.Linear``):
    ``O = NS(nesterov momentum)``; ``v <- beta2 v + (1 - beta2) mean_cols(O * O)`` (``v``: ``[rows, 1]``,
    fp32); ``O' = O / (sqrt(v) + norm_eps)``; ``O'' = O' * ||O||_F / (||O'||_F + norm_eps)``; then
    ``W <- W (1 - lr wd) - adjusted_lr * O''`` as in Muon. The rescale keeps Muon's update norm, so
    Muon's learning rate and ``adjust_lr_fn`` carry over (with ``"match_rms_adamw"`` this is the
    paper's ``0.2 lr sqrt(mn) / ||O'||_F`` up to the spread of NS's singular values).
    """

    def __init__(self, params, lr: float = 1e-3, beta2: float = 0.95, norm_eps: float = 1e-10, **kwargs) -> None:
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        super().__init__(params, lr=lr, beta2=beta2, norm_eps=norm_eps, **kwargs)

    def _init_extra_state(self, p: Tensor, state: dict) -> None:
        state["second_moment"] = torch.zeros(p.shape[0], 1, dtype=torch.float32, device=p.device)

    def _postprocess(self, group: dict, ortho: Tensor, params: list[Tensor], transposed: bool) -> Tensor:
        beta2, eps = group["beta2"], group["norm_eps"]
        o = ortho.float()
        row_dim = -2 if transposed else -1  # original rows are the oriented columns when transposed
        sq_mean = (o * o).mean(dim=row_dim, keepdim=True)
        moments = [self.state[p]["second_moment"] for p in params]
        if transposed:
            moments = [m.mT for m in moments]
        torch._foreach_lerp_(moments, list(sq_mean.unbind(0)), 1 - beta2)
        v = torch.stack(moments)
        normed = o / v.sqrt().add_(eps)
        before = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
        after = torch.linalg.vector_norm(normed, dim=(-2, -1), keepdim=True)
        return normed.mul_(before / after.add_(eps))


def _effective_by_shape(optimizer: Optimizer) -> dict[str, float]:
    out: dict[str, float] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            key = f"{p.shape[0]}x{p.shape[1]}"
            out.setdefault(key, adjusted_lr(float(group["lr"]), group.get("adjust_lr_fn"), p.shape))
    return out
