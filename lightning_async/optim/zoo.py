"""The optimizer zoo: build any supported optimizer by name, with parameter grouping in one place.

``build_optimizer(name, named_parameters, lr, weight_decay, **kwargs)`` returns one
``torch.optim.Optimizer`` whatever the name, so Lightning's automatic optimization, the
``DelayedOptimizer`` wrapper, the Error-Feedback correction and ``LambdaLR`` all see plain
``param_groups``. Every group carries ``name`` (unique, for ``LearningRateMonitor``), ``kind``
(``matrix`` / ``embedding`` / ``decay`` / ``no_decay``), ``lr`` and ``weight_decay``.

Grouping (:func:`group_parameters`, the only place it is decided):

* ``no_decay``: parameters with fewer than 2 dimensions (norm gains, biases);
* ``embedding``: 2-D parameters named like an embedding or the LM head (``embed.weight``,
  ``head.proj.weight``, ``lm_head.weight``, ``wte``...); a tied head is the same tensor as the
  embedding and appears once;
* ``matrix``: every other parameter with 2 or more dimensions (hidden projections).

Muon and NorMuon take the ``matrix`` parameters (2-D ones only: anything else is routed to AdamW
with a log record); AdamW takes ``embedding`` (decayed) and ``no_decay``, with its own learning
rate ``adamw_lr``. ``basis_rotation`` (Jung et al. 2026; ``soap`` with ``rotate="hidden"`` and their
settings) puts SOAP on ``matrix`` and AdamW on the rest. Every other optimizer gets two groups: decay on
all >= 2-D parameters, none on the rest. See ``docs/optimizers.md`` for defaults and their sources.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_async.optim.asyncpp import ASYNCPP_KWARGS, build_asyncpp
from lightning_async.optim.closure import evaluate_closure
from lightning_async.optim.muon import BatchedMuon, NorMuon, adjusted_lr

log = logging.getLogger(__name__)

OPTIMIZER_NAMES = ("adamw", "muon", "normuon", "adan", "soap", "lion", "mars", "asyncpp", "basis_rotation")
MUON_FAMILY = ("muon", "normuon")

# Names (dot-separated components) that mark a 2-D parameter as an embedding or the LM head.
_EMBEDDING_PATTERN = re.compile(r"(^|\.)(embed\w*|tok_embeddings|wte|wpe|lm_head|head|output)(\.|$)")

# Hyperparameter defaults on top of each library's, with the source (see docs/optimizers.md).
ADAMW_DEFAULTS = {"betas": (0.9, 0.95), "eps": 1e-8}  # SmolLM2 / LLM pretraining practice
MUON_DEFAULTS = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "adjust_lr_fn": None}  # Jordan et al. 2024
NORMUON_DEFAULTS = {**MUON_DEFAULTS, "beta2": 0.95, "norm_eps": 1e-10}  # Li et al. 2025, official code
ADAN_DEFAULTS = {"betas": (0.98, 0.92, 0.99), "eps": 1e-8}  # Xie et al. 2022 (library betas = 1 - paper betas)
LION_DEFAULTS = {"betas": (0.9, 0.99)}  # Chen et al. 2023
MARS_DEFAULTS = {"betas": (0.95, 0.99), "gamma": 0.025, "mars_type": "adamw", "betas_1d": (0.9, 0.95)}  # Yuan et al. 2024
SOAP_DEFAULTS = {"betas": (0.95, 0.95), "precondition_frequency": 10, "eps": 1e-8}  # Vyas et al. 2024
# Jung, Shin and Lee 2026, their code's run settings (covariance EMA = beta2, basis refresh every 10 steps)
BASIS_ROTATION_DEFAULTS = {"betas": (0.9, 0.999), "shampoo_beta": 0.999, "precondition_frequency": 10, "eps": 1e-8}
DEFAULT_ADAMW_LR = 3e-3  # the adamw recipe's lr: AdamW part of the Muon family (embeddings, head, norms)

# Keyword arguments each name accepts (anything else is an error, never silently ignored).
_MUON_KWARGS = {"momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn", "ns_dtype", "muon_impl"}
_SOAP_KWARGS = frozenset(
    {"betas", "shampoo_beta", "precondition_frequency", "max_precondition_dim", "merge_dims", "precondition_1d",
     "correct_bias", "normalize_gradient", "eps", "rotate"}
)
_ADAMW_SIDE_KWARGS = {"adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay", "fused", "foreach"}
ALLOWED_KWARGS: dict[str, frozenset[str]] = {
    "adamw": frozenset({"betas", "eps", "amsgrad", "foreach", "fused", "capturable", "maximize"}),
    "muon": frozenset(_MUON_KWARGS | _ADAMW_SIDE_KWARGS),
    "normuon": frozenset((_MUON_KWARGS - {"muon_impl"}) | {"beta2", "norm_eps"} | _ADAMW_SIDE_KWARGS),
    "adan": frozenset({"betas", "eps", "max_grad_norm", "foreach"}),
    "lion": frozenset({"betas", "foreach"}),
    "mars": frozenset({"betas", "gamma", "mars_type", "betas_1d", "eps", "ams_bound", "cautious", "foreach"}),
    "soap": _SOAP_KWARGS,
    # SOAP's, but its scope is fixed (the hidden matrices) and its 1-D parameters go to AdamW
    "basis_rotation": _SOAP_KWARGS - {"rotate", "precondition_1d"},
    "asyncpp": ASYNCPP_KWARGS,
}
_TUPLE_KWARGS = ("betas", "betas_1d", "adamw_betas", "ns_coefficients")


class UnknownOptimizerArgument(TypeError, ValueError):
    """An optimizer keyword argument the zoo does not know (a ``TypeError`` and a ``ValueError``)."""


# ---- grouping ------------------------------------------------------------------------------------
def is_embedding_name(name: str) -> bool:
    """Whether ``name`` looks like an embedding or LM-head weight (these go to AdamW under Muon)."""
    return bool(_EMBEDDING_PATTERN.search(name))


def group_parameters(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split trainable parameters into ``matrix``, ``embedding`` and ``no_decay`` (see module doc).

    Each tensor appears once (a tied LM head is the embedding's tensor, kept under its first name);
    parameters with ``requires_grad=False`` are left out. Order within a category follows the input.
    """
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"matrix": [], "embedding": [], "no_decay": []}
    seen: set[int] = set()
    for item in named_parameters:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError("build_optimizer wants (name, parameter) pairs: pass model.named_parameters().")
        name, p = item
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2:
            groups["no_decay"].append((name, p))
        elif is_embedding_name(name):
            groups["embedding"].append((name, p))
        else:
            groups["matrix"].append((name, p))
    return groups


# ---- composite optimizer -------------------------------------------------------------------------
class CompositeOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, seen as one ``torch.optim.Optimizer``.

    ``param_groups`` is the concatenation of the children's groups (the same dicts, so schedulers and
    wrappers that edit ``lr`` reach the children) and ``state`` is one dict shared by all children.
    ``state_dict``/``load_state_dict`` are the base class's, over all groups; children are re-linked
    to the loaded groups and state. ``step`` evaluates the closure once and steps every child.
    """

    def __init__(self, optimizers: list[Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CompositeOptimizer needs at least one optimizer")
        self.optimizers = list(optimizers)
        self._group_counts = [len(o.param_groups) for o in self.optimizers]
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        self._link()

    def _link(self) -> None:
        start = 0
        for child, count in zip(self.optimizers, self._group_counts):
            child.param_groups = self.param_groups[start : start + count]
            child.state = self.state
            start += count

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "_group_counts") and len(self.param_groups) >= sum(self._group_counts):
            raise NotImplementedError("add a parameter group to a child optimizer and rebuild the CompositeOptimizer")
        super().add_param_group(param_group)

    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for child in self.optimizers:
            child.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self.optimizers)
        names = [g.get("name") for g in self.param_groups]
        return f"{type(self).__name__}([{inner}], groups={names})"


# ---- the factory ---------------------------------------------------------------------------------
def check_optimizer_settings(name: str, kwargs: dict) -> None:
    """Raise ``ValueError`` for an unknown optimizer ``name`` and :class:`UnknownOptimizerArgument` for a keyword it
    does not take (models call it in ``__init__``: a typo fails at configuration, before data or ranks start)."""
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"Unknown optimizer {name!r}. Choose one of: {', '.join(OPTIMIZER_NAMES)}.")
    unknown = sorted(set(kwargs) - ALLOWED_KWARGS[name])
    if unknown:
        raise UnknownOptimizerArgument(
            f"Optimizer {name!r} does not take {', '.join(unknown)}. Valid keyword arguments: "
            f"{', '.join(sorted(ALLOWED_KWARGS[name]))}."
        )


def build_optimizer(
    name: str, named_parameters: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float = 0.1, **kwargs
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` over ``named_parameters`` (e.g. ``model.named_parameters()``).

    Args:
        name: one of :data:`OPTIMIZER_NAMES`.
        named_parameters: ``(name, parameter)`` pairs (a whole model or one pipeline stage's share).
        lr: peak learning rate (Muon family: of the hidden matrices, before ``adjust_lr_fn``).
        weight_decay: decoupled weight decay of the decayed groups (``p *= 1 - lr * wd``).
        **kwargs: the optimizer's own hyperparameters (:data:`ALLOWED_KWARGS`). The Muon family also
            takes ``adamw_lr`` (default 3e-3), ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``
            (default ``weight_decay``) for its AdamW part; ``muon`` takes ``muon_impl="batched"|"torch"``.

    Raises:
        ValueError: unknown ``name`` (the message lists the valid names).
        UnknownOptimizerArgument: a keyword the optimizer does not take.
    """
    check_optimizer_settings(name, kwargs)
    kwargs = {k: tuple(v) if k in _TUPLE_KWARGS and isinstance(v, list) else v for k, v in kwargs.items()}
    groups = group_parameters(named_parameters)
    if not any(groups.values()):
        raise ValueError("build_optimizer got no trainable parameters.")
    if name in MUON_FAMILY:
        return _build_muon_family(name, groups, lr, weight_decay, kwargs)
    if name == "basis_rotation":
        return _build_basis_rotation(groups, lr, weight_decay, {**BASIS_ROTATION_DEFAULTS, **kwargs})
    if name == "soap" and _rotated_scope(kwargs) == "hidden":
        return _build_basis_rotation(groups, lr, weight_decay, kwargs)
    decay = [p for _, p in groups["matrix"] + groups["embedding"]]
    no_decay = [p for _, p in groups["no_decay"]]
    param_groups = [
        g
        for g in (
            {"params": decay, "weight_decay": weight_decay, "name": name, "kind": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": f"{name}_no_decay", "kind": "no_decay"},
        )
        if g["params"]
    ]
    return _BUILDERS[name](param_groups, lr, weight_decay, kwargs)


def _adamw(param_groups: list[dict], lr: float, weight_decay: float, kwargs: dict) -> Optimizer:
    options = {**ADAMW_DEFAULTS, **kwargs}
    params = [p for g in param_groups for p in g["params"]]
    if options.get("fused") is None and options.get("foreach") is None:
        # fused kernels where every parameter is a floating CUDA tensor, foreach (torch's default) elsewhere
        if all(p.is_cuda and p.is_floating_point() for p in params):
            options["fused"] = True
    return torch.optim.AdamW(param_groups, lr=lr, weight_decay=weight_decay, **options)


def _adan(param_groups, lr, weight_decay, kwargs):
    from pytorch_optimizer import Adan

    # weight_decouple=True gives p *= 1 - lr*wd (the paper's own form is p /= 1 + lr*wd)
    return Adan(param_groups, lr=lr, weight_decay=weight_decay, weight_decouple=True, **{**ADAN_DEFAULTS, **kwargs})


def _lion(param_groups, lr, weight_decay, kwargs):
    from pytorch_optimizer import Lion

    return Lion(param_groups, lr=lr, weight_decay=weight_decay, weight_decouple=True, **{**LION_DEFAULTS, **kwargs})


def _mars(param_groups, lr, weight_decay, kwargs):
    from pytorch_optimizer import MARS

    options = {**MARS_DEFAULTS, **kwargs}
    if options["mars_type"] not in ("adamw", "lion"):
        raise ValueError(f"mars_type must be 'adamw' or 'lion' (the zoo's Muon covers 'shampoo'), got {options['mars_type']!r}")
    for g in param_groups:
        # MARS runs its own AdamW on 1-D tensors with weight_decay_1d and lr * lr_1d/lr: keep both truthful
        g["weight_decay_1d"] = g["weight_decay"]
    return MARS(param_groups, lr=lr, lr_1d=lr, weight_decay=weight_decay, weight_decouple=True, optimize_1d=False, **options)


def _rotated_scope(kwargs: dict) -> str:
    """SOAP's ``rotate`` option (popped from ``kwargs``): ``"all"`` (every parameter, SOAP's own scope) or
    ``"hidden"`` (the hidden matrices only, as basis rotation, Jung et al. 2026)."""
    scope = kwargs.pop("rotate", "all")
    if scope not in ("all", "hidden"):
        raise ValueError(f"soap's rotate must be 'all' (SOAP) or 'hidden' (basis rotation: the hidden matrices), got {scope!r}.")
    return scope


def _soap(param_groups, lr, weight_decay, kwargs):
    from pytorch_optimizer import SOAP

    _rotated_scope(kwargs)  # "all": SOAP over every group
    return SOAP(param_groups, lr=lr, weight_decay=weight_decay, **{**SOAP_DEFAULTS, **kwargs})


def _build_basis_rotation(groups: dict, lr: float, weight_decay: float, kwargs: dict) -> Optimizer:
    """Basis rotation's scope (Jung et al. 2026, their code's optimizer setup): Adam in the rotated eigenbasis
    (SOAP's update) on the hidden matrices; AdamW with the same betas, eps, lr and decay on the embedding, the
    head and the 1-D parameters, which it leaves unrotated."""
    matrices = [p for _, p in groups["matrix"]]
    rest = [("embedding", weight_decay, [p for _, p in groups["embedding"]]), ("no_decay", 0.0, [p for _, p in groups["no_decay"]])]
    children: list[Optimizer] = []
    if matrices:
        group = {"params": matrices, "weight_decay": weight_decay, "name": "soap", "kind": "matrix"}
        children.append(_soap([group], lr, weight_decay, dict(kwargs)))
    adamw_groups = [{"params": ps, "weight_decay": wd, "name": f"adamw_{kind}", "kind": kind} for kind, wd, ps in rest if ps]
    if adamw_groups:
        betas, eps = kwargs.get("betas", SOAP_DEFAULTS["betas"]), kwargs.get("eps", SOAP_DEFAULTS["eps"])
        children.append(_adamw(adamw_groups, lr, weight_decay, {"betas": betas, "eps": eps}))
    return CompositeOptimizer(children)


_BUILDERS = {"adamw": _adamw, "adan": _adan, "lion": _lion, "mars": _mars, "soap": _soap, "asyncpp": build_asyncpp}


def _build_muon_family(name: str, groups: dict, lr: float, weight_decay: float, kwargs: dict) -> Optimizer:
    adamw_lr = kwargs.pop("adamw_lr", DEFAULT_ADAMW_LR)
    adamw_options = {
        "betas": kwargs.pop("adamw_betas", ADAMW_DEFAULTS["betas"]),
        "eps": kwargs.pop("adamw_eps", ADAMW_DEFAULTS["eps"]),
    }
    for key in ("fused", "foreach"):
        if key in kwargs:
            adamw_options[key] = kwargs.pop(key)
    adamw_wd = kwargs.pop("adamw_weight_decay", weight_decay)
    impl = kwargs.pop("muon_impl", "batched")
    if impl not in ("batched", "torch"):
        raise ValueError(f"muon_impl must be 'batched' or 'torch', got {impl!r}")
    if isinstance(kwargs.get("ns_dtype"), str):
        kwargs["ns_dtype"] = getattr(torch, kwargs["ns_dtype"])

    matrices, routed = [], []
    for pname, p in groups["matrix"]:
        (matrices if p.ndim == 2 else routed).append((pname, p))
    for pname, p in routed:
        log.info("%s takes 2-D matrices only: %s (shape %s) goes to AdamW instead.", name, pname, tuple(p.shape))

    children: list[Optimizer] = []
    if matrices:
        group = {"params": [p for _, p in matrices], "name": name, "kind": "matrix"}
        options = {**(NORMUON_DEFAULTS if name == "normuon" else MUON_DEFAULTS), **kwargs}
        if name == "normuon":
            children.append(NorMuon([group], lr=lr, weight_decay=weight_decay, **options))
        elif impl == "torch":
            if "ns_dtype" in options:
                raise UnknownOptimizerArgument("ns_dtype needs muon_impl='batched' (torch.optim.Muon iterates in bf16).")
            children.append(torch.optim.Muon([group], lr=lr, weight_decay=weight_decay, **options))
        else:
            children.append(BatchedMuon([group], lr=lr, weight_decay=weight_decay, **options))
    decayed = [p for _, p in groups["embedding"] + routed]
    adamw_groups = [
        g
        for g in (
            {"params": decayed, "weight_decay": adamw_wd, "name": "adamw", "kind": "embedding"},
            {"params": [p for _, p in groups["no_decay"]], "weight_decay": 0.0, "name": "adamw_no_decay", "kind": "no_decay"},
        )
        if g["params"]
    ]
    if adamw_groups:
        children.append(_adamw(adamw_groups, adamw_lr, adamw_wd, adamw_options))
    return CompositeOptimizer(children)


# ---- telemetry -----------------------------------------------------------------------------------
def _is_muon_group(group: dict) -> bool:
    return "ns_steps" in group and "momentum" in group


def effective_learning_rates(optimizer: Optimizer) -> dict[str, float]:
    """Learning rate actually applied to the update, per group name.

    Muon-family groups report the ``adjust_lr_fn``-scaled rate of their most common matrix shape
    under the group name, and every shape under ``"<name>/<rows>x<cols>"``. MARS's 1-D groups report
    ``lr * lr_1d_factor``. Works on wrappers too (they share ``param_groups``).
    """
    out: dict[str, float] = {}
    for i, group in enumerate(optimizer.param_groups):
        name = group.get("name", f"group{i}")
        lr = float(group["lr"])
        if _is_muon_group(group) and group["params"]:
            shapes = Counter(tuple(p.shape) for p in group["params"])
            for shape, _ in shapes.most_common():
                out[f"{name}/{shape[0]}x{shape[1]}"] = adjusted_lr(lr, group.get("adjust_lr_fn"), shape)
            out[name] = adjusted_lr(lr, group.get("adjust_lr_fn"), shapes.most_common(1)[0][0])
        elif "lr_1d_factor" in group and not group.get("optimize_1d") and all(p.ndim < 2 for p in group["params"]):
            out[name] = lr * group["lr_1d_factor"]
        else:
            out[name] = lr
    return out


__all__ = [
    "ALLOWED_KWARGS",
    "CompositeOptimizer",
    "OPTIMIZER_NAMES",
    "UnknownOptimizerArgument",
    "build_optimizer",
    "effective_learning_rates",
    "group_parameters",
    "is_embedding_name",
]
