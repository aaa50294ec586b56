"""The memory model of the pipeline schedules (pure Python, no torch): what each rank holds at its peak.

Replaying a rank's action list (:meth:`~lightning_async.pipeline.schedules.ScheduleSpec.run_actions`) gives the
micro-batches whose activations it holds and the weight versions that stay live (:func:`inflight_and_versions`)
and the activation bytes at the peak (:func:`peak_activation_bytes`); :func:`schedule_memory` adds the weights, a
gradient accumulator, the optimizer state and a correction's buffers, per rank. The timing of the same lists is
:mod:`~lightning_async.pipeline.timing`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_async.pipeline.schedules import (
    BACKWARD, FORWARD, INPUT_GRAD, UPDATE, WEIGHT_GRAD, Action, ScheduleSpec, spec,
)
from lightning_async.pipeline.shares import per_piece, per_rank

__all__ = ["WEIGHT_GRAD_SHARE", "inflight_and_versions", "peak_activation_bytes", "schedule_memory"]

#: what a split backward keeps of a micro-batch from ``I`` to ``W``, as a share of its activations, when the bytes
#: are not given: a decoder block's linear-layer inputs and output gradients are about 70% of what it saves for the
#: backward (``stage_costs.nominal_model``; measured 0.70 on SmolLM2 blocks, ``measure.weight_grad_bytes``)
WEIGHT_GRAD_SHARE = 0.7


def _activation_changes(a: Action, full: float, residue: float) -> tuple[float, float]:
    """``(change of the activation bytes held, change of the micro-batches held in full)`` after action ``a`` on a
    piece whose micro-batch saves ``full`` bytes for its backward and keeps ``residue`` of them from ``I`` to ``W``:

    * ``F``: ``+full`` (everything autograd saves for the backward);
    * ``B`` (a whole backward): ``-full``;
    * ``I`` (a split backward's input gradient): ``-full + residue``: autograd frees the graph, and only what the
      deferred weight gradients need stays, each linear layer's input and output gradient
      (:mod:`~lightning_async.pipeline.weight_grad`);
    * ``W``: ``-residue``.
    """
    if a.kind == FORWARD:
        return full, 1
    if a.kind == BACKWARD:
        return -full, -1
    if a.kind == INPUT_GRAD:
        return residue - full, -1
    if a.kind == WEIGHT_GRAD:
        return -residue, 0
    return 0.0, 0


def peak_activation_bytes(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]], piece_bytes: Sequence[float],
                          weight_grad_bytes: Sequence[float] | None = None) -> list[float]:
    """Per rank, replaying its list: the peak of the activation bytes held after each action.

    A micro-batch forwarded on a piece holds that piece's ``piece_bytes`` (what autograd saves for the backward)
    from its ``F`` until its backward: a whole ``B`` frees them; a split backward's ``I`` frees them but for the
    piece's ``weight_grad_bytes`` (the linear layers' inputs and output gradients the deferred weight gradients
    need; default :data:`WEIGHT_GRAD_SHARE` of ``piece_bytes``), which its ``W`` frees.
    """
    s_ = spec(schedule)
    residue = [b * WEIGHT_GRAD_SHARE for b in piece_bytes] if weight_grad_bytes is None else list(weight_grad_bytes)
    p, peaks = len(lists), []
    for r, actions in enumerate(lists):
        held = peak = 0.0
        for a in actions:
            if a.kind != UPDATE:
                k = s_.piece(r, a.chunk, p)
                held += _activation_changes(a, piece_bytes[k], residue[k])[0]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def inflight_and_versions(schedule: "str | ScheduleSpec", lists: Sequence[Sequence[Action]]) -> tuple[list[float], list[int]]:
    """Per rank, replaying its list: the peak of the micro-batches whose activations are held in full, in
    micro-batches of the rank's whole share (a chunk's micro-batch counts ``1/v``; held from ``F`` until ``B``, or
    until ``I`` when the backward is split: after it only the weight gradients' inputs stay, see
    :func:`peak_activation_bytes`), and the peak number of live weight versions (a micro-batch's version stays live
    until its last backward action, ``W`` when split: its weight gradient accumulates into that version)."""
    s_ = spec(schedule)
    last = WEIGHT_GRAD if s_.split_backward else BACKWARD
    peaks, versions = [], []
    clock = s_.clock(len(lists))
    group = (lambda chunk: chunk) if s_.update_per_chunk else (lambda chunk: 0)  # (wpipe: each chunk its versions)
    for rank, actions in enumerate(lists):
        clocks = [c for _, c in clock.update_groups(rank)]
        reading: list[dict[int, int]] = [{} for _ in clocks]  # per group: batch -> actions whose last backward is to come
        updates, peak, live_peak, count = [0] * len(clocks), 0, 1, 0
        for a in actions:
            count += _activation_changes(a, 0.0, 0.0)[1]
            g = group(a.chunk)
            if a.kind == FORWARD:
                reading[g][a.batch] = reading[g].get(a.batch, 0) + 1
            elif a.kind == last:
                reading[g][a.batch] -= 1
                if not reading[g][a.batch]:
                    del reading[g][a.batch]
            elif a.kind == UPDATE:
                updates[g] += 1
            peak = max(peak, count)
            live = {updates[g]} | {clocks[g].updates_read(b) for b in reading[g]}
            live_peak = max(live_peak, len(live))
        peaks.append(peak / s_.chunks if s_.chunks > 1 else peak)
        versions.append(live_peak)
    return peaks, versions


def holds_two_gradients(schedule: "str | ScheduleSpec", num_stages: int, rank: int, tied_weights: bool = False,
                        clipping: bool = False) -> bool:
    """Whether ``rank`` holds two gradient buffers at its peak: under a delayed schedule with a weight stash, it takes
    part in a reduction across stages (global-norm ``clipping``: every rank; ``tied_weights``: the ranks of the first
    and the last piece, when they differ) and is not the participant that begins a batch's update last (2BW's first
    stage, whose backwards of a batch end after everyone's). Such a rank's update of batch ``b - 1`` waits for that
    participant (held back to its next call, or within the call) with its gradients while its backwards of batch
    ``b`` fill the other slot. PACI applies such an update at the start of its next call, before any backward: one
    buffer. The last participant applies its update at its next backward (that step's ``settle``, by which time every
    other participant has started the reductions; :func:`~lightning_async.pipeline.program.lower`): one buffer,
    whatever the timing."""
    s_ = spec(schedule)
    if not (tied_weights or clipping) or not s_.delayed or not s_.stash or not s_.uniform_delay:
        return False
    ends = {s_.holder(0, num_stages)[0], s_.holder(s_.virtual_stages(num_stages) - 1, num_stages)[0]}
    participants = set(range(num_stages)) if clipping else (ends if len(ends) == 2 else set())
    if rank not in participants:
        return False
    return not s_.clock(num_stages).begins_last(rank)  # (the first stage: a participant of every reduction)


def schedule_memory(
    schedule: "str | ScheduleSpec",
    num_stages: int,
    n_microbatches: int,
    param_bytes: int | Sequence[int],
    optimizer_bytes: int | Sequence[int],
    activation_bytes: int | Sequence[int],
    correction_buffers: int = 0,
    grad_bytes: int | Sequence[int] | None = None,
    data_parallel_size: int = 1,
    shard_optimizer: bool = False,
    weight_grad_bytes: int | Sequence[int] | None = None,
    fsdp: bool = False,
    tied_weights: bool = False,
    clipping: bool = False,
) -> list[dict[str, int]]:
    """Per rank, the bytes ``schedule`` holds at its peak: weights (one version per ``weight_versions``), one
    gradient accumulator, optimizer state, a correction's parameter-sized buffers (EF: 1), and the activations held
    at the peak (:func:`peak_activation_bytes`).

    Activations, per micro-batch and piece: from ``F`` to ``B`` (or to ``I``, the input gradient of a split
    backward) everything autograd saves for the backward, ``activation_bytes``; from ``I`` to ``W`` (zero-bubble
    schedules: ``zbh1``, ``zbv``, ``2bw-split``) only what the deferred weight gradients need, the linear layers'
    inputs and output gradients, ``weight_grad_bytes`` (per micro-batch, in the same form as ``activation_bytes``;
    default :data:`WEIGHT_GRAD_SHARE` of it; ``stage_costs`` gives both). So ZB-H1's peak is 1F1B's plus the
    weight-gradient residue of the micro-batches whose ``W`` it defers, not their whole activations.

    ``param_bytes``/``optimizer_bytes``/``grad_bytes`` (default ``param_bytes``): a rank's share, a scalar or one value
    per rank, the same whatever the schedule (``param_bytes`` may also give one value per piece: where a schedule keeps
    each chunk's versions on their own, WPipe's, the weights are counted per chunk; from a rank's share, ``1/v`` each). ``activation_bytes``: what one micro-batch saves for the backward on a
    rank's whole share (a scalar or one per rank: a schedule with ``v`` chunks holds ``v`` pieces of ``1/v`` of it
    each), or one value per piece. ``shard_optimizer`` (ZeRO-1 over ``data_parallel_size`` replicas): the optimizer
    state and the correction's buffers are split evenly over the replicas (the runtime's shares are whole parameters
    balanced by size, so a stage of few large tensors holds a little more; ``benchmarks/memory.py`` measures it).
    ``fsdp`` (FSDP2 inside a stage, :mod:`~lightning_async.pipeline.fsdp`): the optimizer state, the buffers and the
    weights are ``1/dp`` each, under 2BW three weight shards (the two versions and the parameters FSDP gathers from);
    the gradient stays whole, as FSDP accumulates it unsharded over a batch's micro-batches and reduce-scatters once
    (a unit's gathered weights, transient, are left out).

    ``tied_weights`` (the first and the last piece share a weight) and ``clipping`` (by the global norm) are the
    reductions across stages: a rank of a delayed schedule with a weight stash that takes part in one and waits for
    the participant that begins the update last (2BW: the first stage) keeps the pending update's gradients while the
    next batch's backwards accumulate into the other slot, two gradient buffers (:func:`holds_two_gradients`;
    measured, docs/benchmarks.md "Memory per stage").
    """
    if (shard_optimizer or fsdp) and data_parallel_size < 2:
        raise ValueError("shard_optimizer and fsdp need data_parallel_size > 1 (the state is split over the replicas).")
    if shard_optimizer and fsdp:
        raise ValueError("fsdp already shards the optimizer state: pass shard_optimizer=False with it.")
    share = data_parallel_size if shard_optimizer or fsdp else 1
    s_ = spec(schedule)
    p = num_stages
    lists = [s_.run_actions(r, p, n_microbatches, 2) for r in range(p)]
    inflight, _ = inflight_and_versions(s_, lists)

    def per(v, name):
        return [int(x) for x in per_rank(v, p, name)]

    piece_params = per_piece(param_bytes, s_, p, "param_bytes")  # (a rank's weights per chunk: wpipe's versions)
    params = [int(sum(piece_params[s_.piece(r, c, p)] for c in range(s_.chunks))) for r in range(p)]
    opt = per(optimizer_bytes, "optimizer_bytes")
    piece_bytes = per_piece(activation_bytes, s_, p, "activation_bytes")
    residue = None if weight_grad_bytes is None else per_piece(weight_grad_bytes, s_, p, "weight_grad_bytes")
    activations = peak_activation_bytes(s_, lists, piece_bytes, residue)
    grads = params if grad_bytes is None else per(grad_bytes, "grad_bytes")
    clock = s_.clock(p)
    out = []
    for r in range(p):
        versions = clock.rank(r).versions if not s_.update_per_chunk else None
        if versions is None:  # (wpipe: each chunk its own versions of its own weights)
            kept = sum(c.versions * piece_params[s_.piece(r, chunks[0], p)] for chunks, c in clock.update_groups(r))
        else:
            kept = (versions + (1 if fsdp and versions > 1 else 0)) * params[r]  # (FSDP: the parameters' shards too)
        row = {
            "weights": int(kept) // (data_parallel_size if fsdp else 1),
            "gradients": grads[r] * (2 if holds_two_gradients(s_, p, r, tied_weights, clipping) else 1),
            "optimizer": opt[r] // share,
            "correction": correction_buffers * params[r] // share, "activations": int(round(activations[r])),
            "inflight_microbatches": inflight[r],
        }
        row["total"] = row["weights"] + row["gradients"] + row["optimizer"] + row["correction"] + row["activations"]
        out.append(row)
    return out
