"""The machinery the scripts under ``benchmarks/`` share.

* :func:`sync`, :func:`timed`: a device synchronisation around what is timed (CUDA only; the CPU needs none).
* :func:`interleaved`: every variant once per round, round after round, so that a drift in machine load hits every
  variant alike; :func:`medians`, :func:`fastest` and :func:`paired_median` read the rounds.
* :func:`write_json`: the results file (its folder made first).
* :func:`parser`, :func:`add_device`, :func:`add_json`, :func:`add_rounds`: the common command line.
* :func:`spawn`: ``pipeline.local.run_local`` on fresh processes; :func:`proc_status`, :func:`rss_kib` and
  :func:`reset_peak_rss`: a process's resident memory.
* :func:`build_rank`: a pipeline rank built the one way the strategy builds it (``plan_rank``, then ``build``).

Only the standard library is imported here at first: the scripts that read finished runs do not load torch for it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")
ORDERS = ("fixed", "alternate", "shuffle")


# ---------------------------------------------------------------------------------------------- timing
def sync(device) -> None:
    """Wait for the work queued on ``device`` (a ``torch.device``; a no-op off CUDA)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device) -> float:
    """Seconds of ``fn()``, synchronising ``device`` before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- rounds
def interleaved(variants: Iterable[T], rounds: int, order: str = "fixed") -> Iterator[tuple[int, T]]:
    """``(round, variant)``: every variant once per round, for ``rounds`` rounds.

    ``order``: ``fixed`` (as given, every round), ``alternate`` (reversed in every odd round) or ``shuffle`` (round
    ``r`` shuffles the previous round's order with ``random.Random(r)``: the same sequence on every run).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    names = list(variants)
    for r in range(rounds):
        if order == "shuffle":
            random.Random(r).shuffle(names)
        for name in (reversed(names) if order == "alternate" and r % 2 else list(names)):
            yield r, name


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of every variant's rounds."""
    return {k: statistics.median(v) for k, v in samples.items()}


def fastest(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The minimum of every variant's rounds (the round least disturbed by the machine's load)."""
    return {k: min(v) for k, v in samples.items()}


def paired_median(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of ``a[r] / b[r]``: steadier than a ratio of medians when the load drifts."""
    if len(a) != len(b):
        raise ValueError(f"paired rounds differ in length: {len(a)} and {len(b)}")
    return statistics.median(x / y for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- output
def write_json(path: str, obj) -> None:
    """Write ``obj`` to ``path`` (indent 1), making its folder first."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


# ---------------------------------------------------------------------------------------------- command line
def parser(doc: str, whole: bool = False) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, or (``whole``) all of it, as written."""
    if whole:
        return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(description=doc.split("\n\n")[0])


def add_device(p: argparse.ArgumentParser, default: str | None = None, **kwargs) -> None:
    """``--device``; by default CUDA where there is a GPU, else the CPU."""
    if default is None:
        import torch

        default = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", default=default, **kwargs)


def add_json(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--json PATH``: where the results go (none by default)."""
    p.add_argument("--json", default=None, help=help)


def add_rounds(p: argparse.ArgumentParser, default: int, help: str) -> None:
    """``--rounds N``: the interleaved rounds."""
    p.add_argument("--rounds", type=int, default=default, help=help)


# ---------------------------------------------------------------------------------------------- processes
def spawn(world: int, fn: Callable, *args, backend: str = "gloo", timeout: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``world`` fresh processes (one thread each) in a ``backend`` group; results by rank."""
    from lightning_async.pipeline.local import run_local

    return run_local(world, fn, *args, backend=backend, timeout=timeout)


def proc_status(fields: Sequence[str]) -> dict[str, int]:
    """The ``fields`` of ``/proc/self/status`` that are there, in KiB (``VmRSS``, ``VmHWM``, ``RssAnon``...);
    raises ``OSError`` off Linux."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in fields:
                out[key] = int(line.split()[1])
    return out


def rss_kib(field: str = "VmRSS") -> int | None:
    """A field of ``/proc/self/status`` in KiB (``VmRSS`` now, ``VmHWM`` the peak); None off Linux."""
    try:
        return proc_status([field]).get(field)
    except OSError:
        return None


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0, ``/proc/self/clear_refs``); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- ranks
def build_rank(units, schedule, n_microbatches: int, split_batch: Callable, loss_fn: Callable,
               make_optimizer: Callable, rank: int = 0, world_size: int = 1, pipeline_parallel_size: int | None = None,
               stage_units=None, **options):
    """``pipeline.rank.plan_rank`` then ``build``; ``make_optimizer(plan)`` makes the rank's optimizer (from
    ``plan.named_parameters``, say) between the two. ``options`` go to ``build``. Returns the ``Rank``."""
    from lightning_async.pipeline.rank import build, plan_rank

    plan = plan_rank(list(units), schedule, n_microbatches, rank=rank, world_size=world_size,
                     pipeline_parallel_size=pipeline_parallel_size, stage_units=stage_units)
    return build(plan, make_optimizer(plan), split_batch, loss_fn, **options)
