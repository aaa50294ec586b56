"""One run per table cell and seed: what to do when several runs claim the same place.

Two runs with the same optimizer, learning rate, class (sync / async / async+EF / async+<correction>),
delay, delay profile, correction strength and seed would fill the same slot of the gap table; before
this check the later one silently replaced the earlier. Now a single finished run (``DONE`` or
diverged) wins over unfinished attempts, with a warning naming both; anything else (two finished
runs, or only unfinished ones) is refused, since picking one would be a guess.
"""

from __future__ import annotations

from collections import defaultdict

from lightning_async.compare.events import ASYNC_EF, SYNC, CompareError, Run
from lightning_async.identity import UNIFORM_PROFILE


def lr_key(lr: float | None) -> float | None:
    """Learning rates equal to 6 significant digits share a row."""
    return None if lr is None else float(f"{lr:.6g}")


def slot(run: Run) -> tuple:
    """The gap-table slot a run fills (its seed included): runs that differ in correction never share one."""
    ident = run.identity
    delayed = run.category != SYNC
    return (
        ident.optimizer,
        lr_key(ident.lr),
        run.category,
        ident.delay if delayed else None,
        ident.delay_profile if delayed else None,
        ident.correction if ident.corrected else None,
        ident.correction_strength if ident.corrected else None,
        ident.seed,
    )


def describe_slot(run: Run) -> str:
    ident = run.identity
    lr = "default" if ident.lr is None else f"{ident.lr:g}"
    text = f"{ident.optimizer} {run.category} (lr {lr}, seed {ident.seed}"
    if run.category != SYNC:
        text += f", delay {ident.delay}"
        if ident.delay_profile != UNIFORM_PROFILE:
            text += f", profile {ident.delay_profile}"
    if ident.corrected:
        name = "EF" if run.category == ASYNC_EF else ident.correction
        text += f", {name} {ident.correction_strength:g}"
    return text + ")"


def _listing(runs: list[Run]) -> str:
    return ", ".join(f"{r.path} ({r.identity.schedule_name}, {r.category}, {r.status})" for r in runs)


def select_runs(runs: list[Run], warn=None) -> list[Run]:
    """``runs`` with at most one run per slot (see the module docstring); order kept.

    Runs without a seed are never merged (nothing says they repeat each other).
    """
    by_slot: dict[tuple, list[Run]] = defaultdict(list)
    for run in runs:
        if run.identity.seed is not None:
            by_slot[slot(run)].append(run)
    dropped: set[int] = set()
    for group in by_slot.values():
        if len(group) < 2:
            continue
        finished = [r for r in group if r.finished]
        if len(finished) != 1:
            state = "finished" if finished else "unfinished (none finished)"
            raise CompareError(
                f"{len(group)} {state} runs fill the same slot of the table, {describe_slot(group[0])}: "
                f"{_listing(finished or group)}. Using one would be a guess: pass only the one you mean "
                "(or move the others out of the directories given to compare)"
            )
        (kept,) = finished
        others = [r for r in group if r is not kept]
        dropped.update(id(r) for r in others)
        if warn is not None:
            warn(f"{describe_slot(kept)}: using the finished run {kept.path}; ignoring the unfinished "
                 f"{_listing(others)}")
    return [r for r in runs if id(r) not in dropped]
