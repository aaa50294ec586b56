"""Delay profiles: how stale each pipeline unit's weights are, for the single-device simulation.

PipeDream-2BW gives every stage the same one-step delay. The original PipeDream (no 2BW, 1F1B without a flush)
gives stage ``s`` of ``p`` a delay of ``p - 1 - s`` steps: the first stage's weights are the stalest, the last
stage's are current. A profile says which delay each unit gets; :func:`parameter_delays` turns it into the
per-parameter delays of :class:`~lightning_async.optim.DelayedOptimizer`, using the same partition of units
into stages as the real pipeline (:func:`~lightning_async.pipeline.partition.partition_units`).

WPipe (Yang et al. 2022) cuts the model into ``2p`` pieces in two groups: rank ``s`` holds piece ``s`` of the first
half (G0) and piece ``p + s`` of the second (G1). G0 is one step stale as under 2BW, G1 is not stale on its own
weights but reads G0's older output: ``g(t) = grad f_t(A(t - 1), B(t))``. On one device that is exactly the first
half of the units one step stale and the second half current, which the ``"wpipe"`` profile gives.

PACI (Elam et al. 2026, 1F1B without a flush and without weight stashing) is not a per-unit delay: which version a
stage's forward reads depends on the micro-batch (the first ``p - 1 - s`` of a batch read the previous version on stage
``s``, the rest the current one) and every backward reads the current version. ``"paci"`` is named here (its per-stage
delays are the most steps a stage's forwards are stale: 1 for stages ``0 .. p - 2``, 0 for the last), but
:func:`unit_delays` refuses it: :class:`~lightning_async.callbacks.DelaySimulation` runs
:class:`~lightning_async.pipeline.paci.PaciRule` for it instead of a delayed optimizer.

Profiles: ``"uniform"`` (every unit ``delay``), ``"2bw"`` (every unit 1), ``"pipedream"`` (``p - 1 - s``,
needs ``stages``), ``"wpipe"`` (the ``2 * stages`` pieces' first half 1, second half 0), ``"paci"`` (needs
``stages``; a micro-batch rule, above), a list of per-stage delays (its length is the number of stages), or a mapping
from unit names to delays (units not named get ``delay``). A weight shared by several units (tied embeddings) takes the
delay of the first unit that holds it (the embedding: the stalest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from lightning_async.pipeline.partition import partition_units

NAMED_PROFILES = ("uniform", "2bw", "pipedream", "wpipe", "paci")
#: profiles whose rule depends on the micro-batch, not a delay per unit (run by ``DelaySimulation`` itself)
MICROBATCH_PROFILES = ("paci",)
#: the profiles that need the number of stages, and what each gives per piece
_STAGED = {
    "pipedream": lambda stages: [stages - 1 - s for s in range(stages)],
    "wpipe": lambda stages: [1] * stages + [0] * stages,  # G0's pieces, then G1's
    "paci": lambda stages: [1] * (stages - 1) + [0],  # the most steps a stage's forwards are stale
}

Profile = str | Sequence[int] | Mapping[str, int] | None


def stage_delays(profile: Profile, stages: int | None, delay: int) -> list[int] | None:
    """Per-stage delays of a named or listed profile (``None`` for a mapping or no profile)."""
    if profile is None or isinstance(profile, Mapping):
        return None
    if isinstance(profile, str):
        if profile not in NAMED_PROFILES:
            raise ValueError(f"Unknown delay profile {profile!r}. Choose one of {', '.join(NAMED_PROFILES)}, a list of "
                             "per-stage delays, or a mapping from unit names to delays.")
        if profile in _STAGED:
            if not isinstance(stages, int) or stages < 1:
                raise ValueError(f"The {profile!r} delay profile needs the number of stages: set stages (e.g. 4).")
            return _STAGED[profile](stages)
        return [delay if profile == "uniform" else 1] * (stages or 1)
    delays = list(profile)
    if stages is not None and len(delays) != stages:
        raise ValueError(f"The delay profile lists {len(delays)} per-stage delays for {stages} stages; give one per stage.")
    return delays


def unit_delays(units: Sequence[tuple[str, nn.Module]], profile: Profile, stages: int | None, delay: int,
                partition: str | Sequence[str] = "uniform") -> dict[str, int]:
    """Each unit's delay under ``profile`` (units split into stages like the pipeline's ``partition``)."""
    names = [name for name, _ in units]
    if isinstance(profile, str) and profile in MICROBATCH_PROFILES:
        raise ValueError(f"The {profile!r} profile is a rule per micro-batch, not a delay per unit: run it with "
                         f"DelaySimulation(profile={profile!r}, stages=...) (lightning_async.pipeline.paci).")
    if isinstance(profile, Mapping):
        unknown = sorted(set(profile) - set(names))
        if unknown:
            raise ValueError(f"The delay profile names unknown unit(s) {unknown}; the units are: {', '.join(names)}.")
        return {name: int(profile.get(name, delay)) for name in names}
    per_stage = stage_delays(profile, stages, delay)
    if per_stage is None:
        return {name: delay for name in names}
    split = partition_units(units, len(per_stage), partition)
    return {name: per_stage[s] for s, stage in enumerate(split) for name in stage}


def parameter_delays(units: Sequence[tuple[str, nn.Module]], by_unit: Mapping[str, int]) -> dict[torch.Tensor, int]:
    """Per-parameter delays from per-unit delays (a shared weight keeps its first unit's delay)."""
    delays: dict[torch.Tensor, int] = {}
    for name, module in units:
        for p in module.parameters():
            delays.setdefault(p, by_unit[name])
    return delays


def describe(profile: Profile, stages: int | None, delay: int, replicas: int = 1) -> str:
    """A short label for a run's record: ``uniform``, ``pipedream-4``, ``[3, 2, 1, 0]`` or ``units``; PACI over
    ``replicas`` pipeline replicas (its rule depends on them) ``paci-4x2``."""
    if profile is None or profile == "uniform":
        return "uniform"
    if profile in _STAGED:
        return f"{profile}-{stages}" + (f"x{replicas}" if profile == "paci" and replicas > 1 else "")
    if isinstance(profile, str):
        return profile
    if isinstance(profile, Mapping):
        return "units"
    return str(list(profile))
