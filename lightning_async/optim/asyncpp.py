"""AsyncPP (Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel Optimization", ICML 2025), as its
official code runs it: ``torch.optim.NAdam`` with decoupled weight decay and ``beta1 = 0.99``, fed the stale
gradient that weight stashing produces (PluralisResearch/AsyncPP; file and line references in ``docs/delay.md``).

The method is an optimizer, not a correction on top of one: the Nesterov look-ahead of NAdam's update,
``u = lr [(1 - mu_t) g / (1 - prod mu) + mu_(t+1) m / (1 - prod mu * mu_(t+1))] / (sqrt(v / (1 - beta2^t)) + eps)``,
with a first-moment decay near 1 is what the paper proposes against the staleness of ``g``. So it runs wherever an
optimizer runs: under the one-device delay simulation and in the 2BW pipeline runtime alike.

NAdam's momentum is scheduled (Dozat 2016): ``mu_t = beta1 (1 - 0.5 * 0.96 ** (t * momentum_decay))``. With the
official ``momentum_decay = 0.004`` and ``beta1 = 0.99`` the effective momentum starts at 0.495 and reaches 0.66
after 2,400 steps and 0.89 after 10,000 (:func:`scheduled_momentum`): "momentum 0.99" is the schedule's limit.
"""

from __future__ import annotations

import torch

#: the published settings: ``--momentum 0.99 --optimizer nadamw`` (run.bash) with main_with_runtime.py's defaults
ASYNCPP_DEFAULTS = {"betas": (0.99, 0.999), "momentum_decay": 0.004, "eps": 1e-8}
#: keyword arguments ``asyncpp`` accepts (torch.optim.NAdam's own, except the decoupling, which the method fixes)
ASYNCPP_KWARGS = frozenset({"betas", "eps", "momentum_decay", "foreach", "maximize", "capturable", "differentiable"})


def build_asyncpp(param_groups: list[dict], lr: float, weight_decay: float, kwargs: dict) -> torch.optim.NAdam:
    """NAdamW with AsyncPP's settings over the zoo's ``param_groups`` (decay on >= 2-D parameters only)."""
    return torch.optim.NAdam(param_groups, lr=lr, weight_decay=weight_decay, decoupled_weight_decay=True,
                             **{**ASYNCPP_DEFAULTS, **kwargs})


def scheduled_momentum(step: int, beta1: float = ASYNCPP_DEFAULTS["betas"][0],
                       momentum_decay: float = ASYNCPP_DEFAULTS["momentum_decay"]) -> float:
    """NAdam's momentum coefficient ``mu_t`` at optimizer step ``step`` (1-based), as ``torch.optim.NAdam`` uses it."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (step * momentum_decay))
