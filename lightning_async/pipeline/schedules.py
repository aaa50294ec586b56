"""Pipeline schedules as data: each rank's ordered actions, with no processes involved.

An :class:`Action` runs one micro-batch through one of the rank's *chunks* (virtual stages): ``F`` its forward,
``B`` its whole backward, or the backward split in two (zero-bubble schedules): ``I`` the gradient with respect
to the chunk's inputs (what the previous stage waits for) and ``W`` the gradient with respect to its weights
(which nobody waits for, so it can fill a bubble). ``U`` is the rank's optimizer update after the last backward
of a batch. Micro-batches carry *global* indices ``batch * n_microbatches + i``, so a schedule can span batch
boundaries.

Virtual stages: the model is cut into ``p x v`` pieces; rank ``r`` holds ``v`` of them. ``loop`` placement (the
interleaved schedule) gives rank ``r`` the pieces ``r, r + p, r + 2p, ...``; ``v`` placement (ZB-V) gives it
``r`` and ``2p - 1 - r``, so the first and the last piece (the embedding and the head) share rank 0.

* ``gpipe``: per batch, all forwards then all backwards, then the update (flush every batch).
* ``1f1b``: per batch, warmup forwards, one-forward-one-backward, cooldown, update (flush every batch).
* ``zbh1``: ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split, the
  weight gradients of rank ``r`` deferred by ``r`` micro-batches into the cooldown, where they fill the bubble
  1F1B leaves there (about a third of 1F1B's bubble when F, I and W take equal time; the same peak memory).
* ``interleaved``: interleaved 1F1B (Narayanan et al. 2021; Megatron-LM) over ``v`` chunks per rank in loop
  placement: the warm-up and cooldown bubbles shrink by ``v``, at ``v`` times the messages.
* ``zbv``: ZB-V (Qi et al. 2024, section 6): two chunks per rank in a V, split backward; close to no bubble
  once ``m >= 2p``, with 1F1B's peak activation memory.
* ``2bw``: PipeDream-2BW. One endless 1F1B stream over global micro-batches; stage ``s`` updates right
  after the last backward of batch ``b``, while micro-batches of batch ``b + 1`` are in flight.
  There is no flush between batches; :func:`drain_actions` empties the pipeline when needed
  (before validation, a checkpoint, or the end of fit).
* ``2bw-split``: 2BW with each backward split into ``I`` then ``W``: the gradient leaves for the previous stage
  before the weight gradient is computed, so a micro-batch's round trip through the pipeline is shorter by the
  weight gradients of the stages it crosses. The same update rule; faster when hops cost time (2BW's steady
  state is bound by that round trip, ``docs/schedules.md``).
* ``pipedream``: PipeDream with weight stashing (Narayanan et al. 2019): 2BW's endless 1F1B stream, but stage
  ``s`` of ``p`` is ``p - 1 - s`` steps stale (the delay profile ``pipedream``) and keeps ``p - s`` weight
  versions. With one micro-batch per batch (PipeDream's update after every micro-batch) that is the stream's own
  staleness; with more it is staler than needed (2BW is the schedule for that). Its warm-up spans ``p - 1 - s``
  calls when ``m`` is below the stage's warm-up forwards.
* ``paci``: PACI (Elam et al. 2026): the same stream with one weight version per stage and no stash. A stage's
  update lands right after its last backward of a batch, so the first ``p - 1 - s`` forwards of the next batch
  on stage ``s`` (which ran before it) read the previous version; their backwards recompute the stage at the
  current one (``lightning_async.pipeline.paci``). Needs ``m >= p - 1``.
* ``wpipe``: WPipe (Yang et al. 2022): two chunks per rank in loop placement (rank ``s`` holds pieces ``s`` and
  ``p + s``), no flush, each chunk its own update once per batch (:func:`wpipe_stream`). The first half (chunk 0,
  G0) is one step stale and keeps two versions, as under 2BW; the second half (chunk 1, G1) updates in place
  between its backwards of a batch and its forwards of the next, so it is current, but reads G0's older output:
  the delay profile ``wpipe``. ``m`` a multiple of ``p`` (the reference runs ``m = p``).

The runtime executes one *call* per training batch. :meth:`ScheduleSpec.call_actions` gives the actions of the
call for batch ``b``: for the flushing schedules the whole batch, for ``2bw`` everything in the stream before the
first forward of batch ``b + 1`` (a stage cannot run that forward before the next batch is handed over).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from lightning_async.pipeline import profiles
from lightning_async.pipeline.clock import UpdateClock

FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD, UPDATE = "F", "B", "I", "W", "U"
#: actions that send a gradient to the previous virtual stage (and need the next one's)
GRADIENT_ACTIONS = (BACKWARD, INPUT_GRAD)
LOOP, V_SHAPE = "loop", "v"


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B", "I", "W" or "U"
    microbatch: int  # global micro-batch index; for "U" the last micro-batch of the batch
    batch: int
    chunk: int = 0  # which of the rank's chunks (virtual stages) it runs on

    def __repr__(self) -> str:
        if self.kind == UPDATE:
            return f"U(b{self.batch})" + (f"c{self.chunk}" if self.chunk else "")
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


# ------------------------------------------------------------------------------------------- placements
def virtual_stage(rank: int, chunk: int, num_stages: int, placement: str = LOOP) -> int:
    """The model piece (virtual stage) chunk ``chunk`` of rank ``rank`` runs, of ``num_stages x chunks`` pieces."""
    if placement == V_SHAPE:
        return rank if chunk == 0 else 2 * num_stages - 1 - rank
    return chunk * num_stages + rank


def rank_and_chunk(piece: int, num_stages: int, placement: str = LOOP) -> tuple[int, int]:
    """Inverse of :func:`virtual_stage`: which rank holds virtual stage ``piece``, as which of its chunks."""
    if placement == V_SHAPE:
        return (piece, 0) if piece < num_stages else (2 * num_stages - 1 - piece, 1)
    return piece % num_stages, piece // num_stages


# ------------------------------------------------------------------------------------------- one batch each
def _b(kind: str, first: int, m: int):
    """A maker of actions of one kind for the batch whose first micro-batch is ``first``."""
    batch = first // m
    return lambda i, chunk=0: Action(kind, first + i, batch, chunk)


def warmup_forwards(stage: int, num_stages: int) -> int:
    """Forwards a stage runs before its first backward in 1F1B order."""
    return num_stages - stage - 1


def _gpipe(rank: int, p: int, m: int, v: int, first: int) -> list[Action]:
    f, b = _b(FORWARD, first, m), _b(BACKWARD, first, m)
    return [f(i) for i in range(m)] + [b(i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, v: int, first: int) -> list[Action]:
    f, b = _b(FORWARD, first, m), _b(BACKWARD, first, m)
    w = min(warmup_forwards(rank, p), m)
    actions = [f(i) for i in range(w)]
    for k in range(m - w):
        actions += [f(w + k), b(k)]
    return actions + [b(k) for k in range(m - w, m)]


def _zb_h1(rank: int, p: int, m: int, v: int, first: int) -> list[Action]:
    """1F1B with ``B = I + W``; rank ``r`` keeps up to ``r`` weight gradients pending in the steady phase and runs
    one after each input gradient of the cooldown, then the rest (its bubble)."""
    f, i_, w_ = _b(FORWARD, first, m), _b(INPUT_GRAD, first, m), _b(WEIGHT_GRAD, first, m)
    warm = min(warmup_forwards(rank, p), m)
    actions = [f(k) for k in range(warm)]
    pending: deque[int] = deque()
    for k in range(m):
        if k < m - warm:
            actions.append(f(warm + k))
        actions.append(i_(k))
        pending.append(k)
        if k >= m - warm or len(pending) > rank:
            actions.append(w_(pending.popleft()))
    return actions + [w_(k) for k in pending]


def _interleaved(rank: int, p: int, m: int, v: int, first: int) -> list[Action]:
    """Megatron's interleaved 1F1B: forwards in groups of ``p`` micro-batches per chunk, chunks in order;
    backwards the same with chunks reversed; ``2 (p - r - 1) + (v - 1) p`` warm-up forwards."""
    f, b = _b(FORWARD, first, m), _b(BACKWARD, first, m)
    total = m * v

    def order(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)

    warm = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
    actions = [f(*order(k, False)) for k in range(warm)]
    for k in range(total - warm):
        actions += [f(*order(warm + k, False)), b(*order(k, True))]
    return actions + [b(*order(k, True)) for k in range(total - warm, total)]


def _zb_v(rank: int, p: int, m: int, v: int, first: int) -> list[Action]:
    """ZB-V (the zero-bubble paper, section 6): chunk 0 runs down the V, chunk 1 back up; phases as the paper's
    figure: chunk-0 forwards, paired forwards, chunk-1 F-I-W, the stable F-I-W of both chunks, the cooldown.
    Built for ``max(m, 2p - 1)`` micro-batches, then the ones beyond ``m`` dropped (few micro-batches)."""
    n = max(m, 2 * p - 1)
    makers = {k: _b(k, first, m) for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)}
    count = {(k, c): 0 for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD) for c in (0, 1)}
    out: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        out.append(makers[kind](count[kind, chunk], chunk))
        count[kind, chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        run(FORWARD, 0)
    for _ in range(rank):
        run(FORWARD, 1)
        run(FORWARD, 0)
    for _ in range(p - rank):
        run(FORWARD, 1), run(INPUT_GRAD, 1), run(WEIGHT_GRAD, 1)
    while count[FORWARD, 1] < count[FORWARD, 0] or count[FORWARD, 0] < n:
        if count[FORWARD, 0] < n:
            run(FORWARD, 0)
        run(INPUT_GRAD, 0), run(WEIGHT_GRAD, 0)
        run(FORWARD, 1), run(INPUT_GRAD, 1), run(WEIGHT_GRAD, 1)
    for _ in range(rank):
        run(INPUT_GRAD, 0), run(INPUT_GRAD, 1)
    for _ in range(p - rank):
        run(INPUT_GRAD, 0), run(WEIGHT_GRAD, 0)
    while count[WEIGHT_GRAD, 1] < count[INPUT_GRAD, 1]:
        run(WEIGHT_GRAD, 1)
    while count[WEIGHT_GRAD, 0] < count[INPUT_GRAD, 0]:
        run(WEIGHT_GRAD, 0)
    return [a for a in out if a.microbatch - first < m]


# ------------------------------------------------------------------------------------------- delayed streams
@dataclass(frozen=True)
class StreamOrder:
    """A delayed schedule's endless order on one rank: its ``k``-th forward and backward (over global micro-batches,
    from an empty pipeline), ``warmup`` forwards before the first backward, then one forward and one backward in turn;
    a batch's forwards are ``per_batch`` consecutive ones. Each backward that ends a batch's backwards of its chunk is
    followed by that batch's update (of the chunk under per-chunk updates, else of the rank)."""

    warmup: int
    per_batch: int
    n_microbatches: int
    forward_at: Callable[[int], tuple[int, int]]  # k -> (micro-batch, chunk)
    backward_at: Callable[[int], tuple[int, int]]
    update_per_chunk: bool = False

    def forward(self, k: int) -> Action:
        mb, chunk = self.forward_at(k)
        return Action(FORWARD, mb, mb // self.n_microbatches, chunk)

    def backward_then_update(self, k: int, out: list[Action]) -> None:
        """Append the ``k``-th backward to ``out``, and the update it completes."""
        mb, chunk = self.backward_at(k)
        batch = mb // self.n_microbatches
        out.append(Action(BACKWARD, mb, batch, chunk))
        if (mb + 1) % self.n_microbatches == 0:
            out.append(Action(UPDATE, mb, batch, chunk if self.update_per_chunk else 0))


def one_f_one_b_stream(stage: int, num_stages: int, m: int) -> StreamOrder:
    """2BW's (and PipeDream's, PACI's) order: 1F1B over global micro-batches without a flush (:func:`stream_2bw`)."""
    return StreamOrder(warmup_forwards(stage, num_stages), m, m, lambda k: (k, 0), lambda k: (k, 0))


def wpipe_stream(stage: int, num_stages: int, m: int) -> StreamOrder:
    """WPipe's order (Yang et al. 2022, ``lib/layout.py``): two chunks in loop placement, micro-batches in blocks of
    ``p``; the ``k``-th forward runs block ``k // p`` of chunk ``(k // p) % 2``, the ``k``-th backward the same block
    of the other chunk, after ``2p - 1 - s`` warm-up forwards on stage ``s``. So chunk 0's forwards of the next block
    run among its backwards of the previous one (the "moving operation"), while chunk 1's backwards of a batch, and
    its update, come before its forwards of the next. Each chunk updates once per batch."""
    p = num_stages

    def at(k: int, flip: int) -> tuple[int, int]:
        return (k // (2 * p)) * p + k % p, ((k // p) + flip) % 2

    return StreamOrder(2 * p - 1 - stage, 2 * m, m, lambda k: at(k, 0), lambda k: at(k, 1), update_per_chunk=True)


# ------------------------------------------------------------------------------------------- the specs
@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule means for everything outside the action lists, and its action lists (the one place that
    says either).

    Attributes:
        name: the schedule's name (``SCHEDULES``).
        delay: steps of staleness of every piece's updates (2BW: one; 0: a flushing schedule), or the name of a
            delay profile (:mod:`~lightning_async.pipeline.profiles`) giving each piece its own (``"pipedream"``:
            ``p - 1 - s``). Weight versions, slots, when an update lands and which loss a step reports follow from
            it in :meth:`clock` (:mod:`~lightning_async.pipeline.clock`).
        min_microbatches_per_stage: micro-batches per batch must be at least this many times the stages.
        chunks: model pieces (virtual stages) per rank.
        placement: ``loop`` (rank ``r`` holds pieces ``r, r + p, ...``) or ``v`` (``r`` and ``2p - 1 - r``).
        split_backward: the backward runs as ``I`` (input gradient) and ``W`` (weight gradient) actions.
        microbatch_multiple_of_stages: micro-batches per batch must be a multiple of the stages.
        per_batch: the flushing schedules' actions of one batch ``(rank, p, m, chunks, first micro-batch)``.
        stash: a micro-batch's backward reads the weight version its forward read (every schedule but ``paci``,
            which keeps one version: a forward that ran before an update is recomputed at the new weights).
        stream: a delayed schedule's endless order on a rank, ``(rank, p, m) -> StreamOrder`` (default: 1F1B's,
            :func:`one_f_one_b_stream`); calls and drains are slices of it.
        update_per_chunk: each chunk of a rank has its own update (``U`` names the chunk) at its own time, with its
            own clock (``wpipe``: chunk 0 one step stale, chunk 1 current); otherwise a rank's chunks update at once.
    """

    name: str
    delay: int | str
    min_microbatches_per_stage: int
    chunks: int = 1
    placement: str = LOOP
    split_backward: bool = False
    microbatch_multiple_of_stages: bool = False
    per_batch: Callable | None = None
    configurable_chunks: bool = False
    stash: bool = True
    stream: Callable | None = None
    update_per_chunk: bool = False

    @property
    def delayed(self) -> bool:
        """Asynchronous: no flush between batches, so some forwards read weights that miss recent updates
        (staleness corrections apply where the schedule stashes versions: :meth:`require_delay`)."""
        return isinstance(self.delay, str) or self.delay > 0 or not self.stash

    @property
    def uniform_delay(self) -> bool:
        """Every piece has the same delay (cross-stage reductions, i.e. global clipping and tied weights, apply)."""
        return not isinstance(self.delay, str)

    def piece_delays(self, num_stages: int) -> tuple[int, ...]:
        """Each piece's delay, in piece order."""
        if isinstance(self.delay, str):
            return tuple(profiles.stage_delays(self.delay, num_stages, 1))  # (a profile lists every piece's)
        return (self.delay,) * self.virtual_stages(num_stages)

    def recorded_delay(self, num_stages: int, replicas: int = 1) -> tuple[int, str]:
        """``(delay, delay_profile)`` for a run's record, as the one-device simulation of the same rule records them
        (so a pipeline run pairs with it): the largest delay and ``"uniform"``, or ``"pipedream-4"``, ``"paci-4"``
        (``"paci-4x2"`` over 2 replicas: which micro-batches read old weights depends on them)."""
        if self.stash and not isinstance(self.delay, str):
            return self.delay, "uniform"
        profile = self.delay if isinstance(self.delay, str) else self.name
        return max(max(self.piece_delays(num_stages)), 1), profiles.describe(profile, num_stages, 1, replicas)

    def clock(self, num_stages: int) -> UpdateClock:
        """The update clock of this schedule on ``num_stages`` ranks."""
        return UpdateClock.of(self, num_stages)

    @property
    def one_forward_one_backward(self) -> bool:
        """Forwards and backwards interleave (1F1B order), which needs at least as many micro-batches as stages."""
        return self.min_microbatches_per_stage > 0

    def require_delay(self, what: str) -> None:
        """Refuse ``what`` (a correction, EF) on a schedule without a delayed update, naming the fix."""
        if not self.delayed:
            raise ValueError(
                f"{what} corrects the one-step delay of schedule '2bw', but schedule {self.name!r} is synchronous "
                "(no delay). Use strategy='async_pipe' (schedule='2bw') or remove the correction."
            )
        if not self.stash:
            raise ValueError(
                f"{what} corrects a delayed update, but schedule {self.name!r} has none: every gradient is taken at "
                "the current weights (only some forwards read the previous version, and their backwards recompute). "
                "Remove the correction, or use schedule='2bw' or 'pipedream'."
            )

    def with_chunks(self, chunks: int | None) -> "ScheduleSpec":
        """This schedule with ``chunks`` virtual stages per rank (only ``interleaved`` takes a number)."""
        if chunks is None or chunks == self.chunks:
            return self
        if not self.configurable_chunks:
            raise ValueError(
                f"Schedule {self.name!r} runs {self.chunks} chunk(s) per rank; virtual_stages={chunks} applies to "
                "schedule 'interleaved' only."
            )
        if not isinstance(chunks, int) or chunks < 2:
            raise ValueError(f"virtual_stages must be an integer >= 2 for schedule 'interleaved', got {chunks!r}.")
        return replace(self, chunks=chunks)

    def virtual_stages(self, num_stages: int) -> int:
        return num_stages * self.chunks

    def piece(self, rank: int, chunk: int, num_stages: int) -> int:
        return virtual_stage(rank, chunk, num_stages, self.placement)

    def holder(self, piece: int, num_stages: int) -> tuple[int, int]:
        return rank_and_chunk(piece, num_stages, self.placement)

    def validate(self, num_stages: int, n_microbatches: int) -> None:
        """Raise ``ValueError`` (with the fix) for settings this schedule cannot run."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}.")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}.")
        if not self.stash and n_microbatches < num_stages - 1:
            raise ValueError(
                f"schedule {self.name!r} needs n_microbatches >= stages - 1 (a micro-batch may cross at most one update "
                f"of a stage between its forward and its backward): got {n_microbatches} for {num_stages} stages. "
                f"Raise n_microbatches to >= {num_stages - 1} or use fewer stages."
            )
        need = self.min_microbatches_per_stage * num_stages
        if n_microbatches < need:
            raise ValueError(
                f"schedule {self.name!r} needs at least as many micro-batches per batch as pipeline stages "
                f"(n_microbatches={n_microbatches} < {num_stages} stages). Raise n_microbatches to >= {need} "
                f"or use fewer stages."
            )
        if self.microbatch_multiple_of_stages and n_microbatches % num_stages:
            raise ValueError(
                f"schedule {self.name!r} needs n_microbatches to be a multiple of the pipeline stages "
                f"(n_microbatches={n_microbatches}, {num_stages} stages): use "
                f"{(n_microbatches // num_stages + 1) * num_stages}."
            )

    # ---- action lists -----------------------------------------------------------------------------
    def call_actions(self, stage: int, num_stages: int, n_microbatches: int, batch: int, fresh: bool = True,
                     started: int | None = None) -> list[Action]:
        """Actions of the training call for ``batch`` on rank ``stage``.

        Delayed schedules: ``fresh``: the pipeline is empty before this call (first batch, or after a drain);
        otherwise ``started`` is the batch whose call last began with an empty pipeline (default 0: a warm-up that
        spans several calls, ``pipedream`` with few micro-batches, needs it). The result is the slice of
        :func:`stream_2bw` begun at ``started`` between the first forwards of ``batch`` and ``batch + 1``.
        """
        self.validate(num_stages, n_microbatches)
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}.")
        if self.delayed and batch == 0 and not fresh:
            raise ValueError("batch 0 always starts with an empty pipeline: use fresh=True.")
        started = batch if fresh else (started or 0)
        if not 0 <= started <= batch:
            raise ValueError(f"started must be between 0 and batch ({batch}), got {started}.")
        return self.checked_call_actions(stage, num_stages, n_microbatches, batch, started)

    def checked_call_actions(self, stage: int, num_stages: int, n_microbatches: int, batch: int, started: int) -> list[Action]:
        """:meth:`call_actions` for settings already validated (the runtime's, checked once when it was built: this
        runs every training call); ``started``: the batch whose call began with an empty pipeline."""
        m = n_microbatches
        if not self.delayed:
            actions = self.per_batch(stage, num_stages, m, self.chunks, batch * m)
            return actions + [Action(UPDATE, (batch + 1) * m - 1, batch)]
        order = self._order(stage, num_stages, m)
        w, n = order.warmup, order.per_batch
        begin, end, first = batch * n, (batch + 1) * n, started * n
        actions = [order.forward(k) for k in range(max(begin, first), min(end, first + w))]
        for k in range(max(begin - w, first), end - w):
            actions.append(order.forward(k + w))
            order.backward_then_update(k, actions)
        return self._split(actions)

    def _order(self, stage: int, num_stages: int, m: int) -> "StreamOrder":
        return (self.stream or one_f_one_b_stream)(stage, num_stages, m)

    def _split(self, actions: list[Action]) -> list[Action]:
        """A 1F1B-ordered list with each ``B`` as ``I`` then ``W`` when the backward is split (2BW-split: the input
        gradient leaves before the weight gradient is computed)."""
        if not self.split_backward:
            return actions
        out = []
        for a in actions:
            out += [replace(a, kind=INPUT_GRAD), replace(a, kind=WEIGHT_GRAD)] if a.kind == BACKWARD else [a]
        return out

    def drain_actions(self, stage: int, num_stages: int, n_microbatches: int, batch: int, started: int = 0) -> list[Action]:
        """Actions that empty the pipeline after the call for ``batch`` (empty for flushing schedules); ``started``:
        the batch whose call began with an empty pipeline (nothing before it is in flight)."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch} (nothing to drain before the first batch).")
        if not self.delayed:
            return []
        order = self._order(stage, num_stages, n_microbatches)
        end, out = (batch + 1) * order.per_batch, []
        for k in range(max(end - order.warmup, started * order.per_batch), end):  # the backwards in flight
            order.backward_then_update(k, out)
        return self._split(out)

    def run_actions(self, stage: int, num_stages: int, n_microbatches: int, num_batches: int) -> list[Action]:
        """All actions of ``num_batches`` training calls followed by a drain (for tests and the simulator)."""
        if num_batches < 1:
            raise ValueError(f"num_batches must be >= 1, got {num_batches}.")
        actions: list[Action] = []
        for b in range(num_batches):
            actions += self.call_actions(stage, num_stages, n_microbatches, b, fresh=b == 0)
        return actions + self.drain_actions(stage, num_stages, n_microbatches, num_batches - 1, started=0)


def _sync(name: str, per_batch: Callable, min_per_stage: int, **kwargs) -> ScheduleSpec:
    return ScheduleSpec(name, delay=0,
                        min_microbatches_per_stage=min_per_stage, per_batch=per_batch, **kwargs)


SPECS = {
    "gpipe": _sync("gpipe", _gpipe, 0),
    "1f1b": _sync("1f1b", _one_f_one_b, 1),
    "zbh1": _sync("zbh1", _zb_h1, 1, split_backward=True),
    "interleaved": _sync("interleaved", _interleaved, 1, chunks=2, microbatch_multiple_of_stages=True,
                         configurable_chunks=True),
    "zbv": _sync("zbv", _zb_v, 0, chunks=2, placement=V_SHAPE, split_backward=True),
    "2bw": ScheduleSpec("2bw", delay=1, min_microbatches_per_stage=1),
    "2bw-split": ScheduleSpec("2bw-split", delay=1, min_microbatches_per_stage=1, split_backward=True),
    "pipedream": ScheduleSpec("pipedream", delay="pipedream", min_microbatches_per_stage=0),
    "paci": ScheduleSpec("paci", delay=0, min_microbatches_per_stage=0, stash=False),
    "wpipe": ScheduleSpec("wpipe", delay="wpipe", min_microbatches_per_stage=1, chunks=2,
                          microbatch_multiple_of_stages=True, stream=wpipe_stream, update_per_chunk=True),
}
SCHEDULES = tuple(SPECS)
#: the synchronous schedule a comparison should beat: no stale gradients, the smallest bubble we run
BEST_SYNC = "zbv"
#: the delayed (asynchronous) schedules, and the synchronous ones the planning map sets against them (GPipe is
#: left out: at equal micro-batches it has 1F1B's bubble and keeps every micro-batch's activations)
DELAYED_SCHEDULES = tuple(name for name, s in SPECS.items() if s.delayed)
MAP_SYNC_SCHEDULES = tuple(name for name, s in SPECS.items() if not s.delayed and name != "gpipe")
#: the names ``Trainer(strategy=...)`` takes for the pipeline strategy: name -> (schedule, description)
STRATEGY_NAMES = {
    "async_pipe": ("2bw", "PipeDream-2BW pipeline (asynchronous)"),
    "sync_pipe": ("1f1b", "1F1B pipeline with a flush per step"),
    "gpipe_pipe": ("gpipe", "GPipe pipeline with a flush per step"),
    "zb_pipe": (BEST_SYNC, "ZB-V zero-bubble pipeline (the best synchronous baseline)"),
    "pipedream_pipe": ("pipedream", "PipeDream pipeline with weight stashing (asynchronous, per-stage delays)"),
    "paci_pipe": ("paci", "PACI pipeline: asynchronous 1F1B without a weight stash"),
    "wpipe_pipe": ("wpipe", "WPipe pipeline: two chunks per rank, the first half one step stale (asynchronous)"),
}


def spec(schedule: "str | ScheduleSpec", virtual_stages: int | None = None) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``schedule`` (a name or a spec), with ``virtual_stages`` chunks per rank where
    the schedule takes a number (a clear error for an unknown name)."""
    if isinstance(schedule, ScheduleSpec):
        return schedule.with_chunks(virtual_stages)
    if schedule not in SPECS:
        raise ValueError(
            f"Unknown pipeline schedule {schedule!r}. Choose one of: {', '.join(SCHEDULES)} "
            f"(or strategy={', '.join(repr(n) for n in STRATEGY_NAMES)})."
        )
    return SPECS[schedule].with_chunks(virtual_stages)


# ------------------------------------------------------------------------------------------- 2BW's stream
def stream_2bw(stage: int, num_stages: int, n_microbatches: int, first_batch: int = 0) -> Iterator[Action]:
    """The endless 2BW action stream of ``stage``, starting with an empty pipeline at ``first_batch``."""
    m, w = n_microbatches, warmup_forwards(stage, num_stages)
    start = first_batch * m
    for i in range(w):
        yield Action(FORWARD, start + i, (start + i) // m)
    j = start
    while True:
        yield Action(FORWARD, j + w, (j + w) // m)
        yield Action(BACKWARD, j, j // m)
        if (j + 1) % m == 0:
            yield Action(UPDATE, j, j // m)
        j += 1


# ------------------------------------------------------------------------------------------- by name (tools, tests)
def validate(schedule: "str | ScheduleSpec", num_stages: int, n_microbatches: int) -> None:
    """Raise ``ValueError`` (with the fix) for settings no schedule can run."""
    spec(schedule).validate(num_stages, n_microbatches)


def call_actions(schedule, stage: int, num_stages: int, n_microbatches: int, batch: int, fresh: bool = True,
                 started: int | None = None) -> list[Action]:
    """:meth:`ScheduleSpec.call_actions` of ``schedule`` (a name or a spec)."""
    return spec(schedule).call_actions(stage, num_stages, n_microbatches, batch, fresh, started)


def drain_actions(schedule, stage: int, num_stages: int, n_microbatches: int, batch: int, started: int = 0) -> list[Action]:
    """:meth:`ScheduleSpec.drain_actions` of ``schedule`` (a name or a spec)."""
    return spec(schedule).drain_actions(stage, num_stages, n_microbatches, batch, started)


def run_actions(schedule, stage: int, num_stages: int, n_microbatches: int, num_batches: int) -> list[Action]:
    """:meth:`ScheduleSpec.run_actions` of ``schedule`` (a name or a spec)."""
    return spec(schedule).run_actions(stage, num_stages, n_microbatches, num_batches)
