"""Which pipeline units go to which stage: contiguous, non-empty slices of the unit sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from lightning_async.pipeline.measure import measure_unit_times  # the default time_fn (importable from here too)

PARTITION_METHODS = ("uniform", "parameters", "time")


def _check(num_units: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"pipeline needs at least one stage, got {num_stages}.")
    if num_stages > num_units:
        raise ValueError(
            f"Cannot split {num_units} pipeline units into {num_stages} stages: each stage needs at least one unit. "
            f"Use at most {num_units} stages, or a model with more blocks."
        )


def balanced_boundaries(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split ``costs`` into ``num_stages`` contiguous slices minimising the largest slice sum.

    Returns the start index of each stage (``[0, ...]``). Exact dynamic programme, O(n^2 p).
    """
    n = len(costs)
    _check(n, num_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-sum splitting the first i units into k stages; cut[k][i]: start of the k-th stage.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def uniform_boundaries(unit_names: Sequence[str], num_stages: int) -> list[int]:
    """Stages with (nearly) the same number of units."""
    _check(len(unit_names), num_stages)
    return balanced_boundaries([1.0] * len(unit_names), num_stages)


def boundaries_from_names(unit_names: Sequence[str], stage_starts: Sequence[str], num_stages: int) -> list[int]:
    """Stages begin at the named units (the first stage always begins at unit 0)."""
    index = {name: i for i, name in enumerate(unit_names)}
    unknown = [s for s in stage_starts if s not in index]
    if unknown:
        raise ValueError(f"Unknown pipeline unit(s) {unknown}; the units are: {', '.join(unit_names)}.")
    starts = sorted({0, *(index[s] for s in stage_starts)})
    if len(starts) != num_stages:
        raise ValueError(
            f"The split points {list(stage_starts)} make {len(starts)} stages, but the pipeline has {num_stages}. "
            f"Give {num_stages - 1} unit names where stages 1..{num_stages - 1} begin."
        )
    return starts


def partition_units(
    units: Sequence[tuple[str, nn.Module]],
    num_stages: int,
    method: str | Sequence[str] = "uniform",
    example_input=None,
    time_fn: Callable[..., list[float]] = measure_unit_times,
    context_fn: Callable | None = None,
) -> list[list[str]]:
    """Assign ``units`` to ``num_stages`` stages; returns the unit names of each stage.

    ``method``: ``"uniform"`` (same number of units), ``"parameters"`` (balanced parameter count),
    ``"time"`` (balanced measured forward+backward time; needs ``example_input``, a tensor or small pytree,
    and the module's ``pipeline_context`` as ``context_fn`` if it has one), or a list of the unit names at
    which stages 1.. begin.
    """
    names = [name for name, _ in units]
    if not isinstance(method, str):
        starts = boundaries_from_names(names, list(method), num_stages)
    elif method == "uniform":
        starts = uniform_boundaries(names, num_stages)
    elif method == "parameters":
        seen: set[int] = set()
        costs = []
        for _, module in units:
            params = [p for p in module.parameters() if id(p) not in seen]
            seen.update(id(p) for p in params)
            costs.append(float(sum(p.numel() for p in params)))
        starts = balanced_boundaries(costs, num_stages)
    elif method == "time":
        if example_input is None:
            raise ValueError("partition='time' needs an example input batch to measure the units.")
        timed = [m for _, m in units]
        times = time_fn(timed, example_input) if context_fn is None else time_fn(timed, example_input, context_fn=context_fn)
        starts = balanced_boundaries(times, num_stages)
    else:
        raise ValueError(
            f"Unknown partition method {method!r}. Use one of {', '.join(PARTITION_METHODS)} or a list of unit names."
        )
    ends = list(starts[1:]) + [len(names)]
    return [names[a:b] for a, b in zip(starts, ends)]
