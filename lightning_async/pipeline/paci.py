"""PACI's update rule on one device: asynchronous 1F1B without a flush and without weight stashing.

PACI (Elam et al., arXiv 2606.07881; code ``ItayElam/PACI``) keeps one weight version per stage. Stage ``s`` of ``p``
runs the 1F1B stream with no flush (``p - 1 - s`` warm-up forwards, then ``F(j + p - 1 - s), B(j)`` pairs) and steps
its optimizer after the last backward of every batch of ``m`` micro-batches (each micro-batch's loss scaled ``1/m``).
With ``m >= p - 1`` the order of actions fixes which version each computation reads. Writing ``W_s(b)`` for stage
``s``'s weights after the updates of batches ``0 .. b - 1`` (``W_s(-1) = W_s(0)``), micro-batch ``j`` of batch ``b``:

* runs its **forward** on stage ``s`` with ``W_s(b - 1)`` when ``j < p - 1 - s`` (its forward came before batch
  ``b - 1``'s update landed on that stage), with ``W_s(b)`` otherwise;
* runs its **backward** with ``W_s(b)`` (after batch ``b - 1``'s update, before batch ``b``'s): the stage's forward is
  recomputed from the stage input it received, at ``W_s(b)``, and the gradient that arrived from stage ``s + 1``
  (taken on the output of the forward-time version) is back-propagated through it. That is the vector-Jacobian
  product of ``f_s(x_in; W_s(b))`` at ``x_in`` with the incoming cotangent: PACI's ``mem`` mode (``DistPACI/Workers.py``
  recomputes in ``backward_other_layers``), made exact. Where the two versions agree it is ordinary backprop.

:class:`PaciRule` computes one batch's loss so that its ``backward()`` gives exactly these gradients (summed over the
micro-batches); one optimizer over all parameters, stepped once per batch, is each stage's update since every stage
updates after every batch. It keeps the previous version only of the weights that a forward reads stale (stages
``0 .. p - 2``): one copy of them, the simulation's cost (the pipeline itself keeps one version).
:class:`~lightning_async.callbacks.DelaySimulation` runs it for ``profile="paci"`` (``docs/delay.md``, "PACI").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_async.pipeline.boundary import NO_CONTEXT, flatten, rows, split_rows, unflatten
from lightning_async.pipeline.metrics import split_loss_result
from lightning_async.pipeline.partition import partition_units
from lightning_async.pipeline.stage import PieceModule
from lightning_async.pipeline.weight_swap import WeightSwap

PROFILE = "paci"


def microbatches(stages: int, n_microbatches: int | None) -> int:
    """Micro-batches per batch: ``n_microbatches``, or twice the stages (the pipeline's default)."""
    return n_microbatches or 2 * stages


def check_paci(stages, n_microbatches) -> int:
    """The number of micro-batches PACI's rule runs with, or a ``ValueError`` naming the fix."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"The 'paci' delay profile needs the number of stages: set stages (e.g. 4), got {stages!r}.")
    if n_microbatches is not None and (not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool)
                                       or n_microbatches < 1):
        raise ValueError(f"n_microbatches must be a positive integer (or null: twice the stages), "
                         f"got {n_microbatches!r}.")
    m = microbatches(stages, n_microbatches)
    if m < stages - 1:
        raise ValueError(
            "PACI's rule needs n_microbatches >= stages - 1 (a micro-batch crosses at most one update of a stage); "
            f"got n_microbatches={m} for {stages} stages. Set n_microbatches to at least {stages - 1} (e.g. "
            f"--delay.n_microbatches {2 * stages}) or use fewer stages."
        )
    return m


def check_replicas(stages: int, n_microbatches: int, replicas) -> int:
    """``replicas`` when it splits the batch's ``n_microbatches`` micro-batches evenly, each replica's share still
    PACI's minimum (``stages - 1``), or a ``ValueError`` naming the fix."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1 or n_microbatches % replicas:
        raise ValueError(f"PACI's rule splits the batch's {n_microbatches} micro-batches over the replicas, "
                         f"but replicas={replicas!r} does not divide them: give n_microbatches = replicas x the "
                         "micro-batches of one replica.")
    check_paci(stages, n_microbatches // replicas)
    return replicas


def reads_previous(stage: int, microbatch: int, stages: int) -> bool:
    """Whether micro-batch ``microbatch``'s forward on ``stage`` reads the previous version ``W_s(b - 1)``."""
    return microbatch < stages - 1 - stage


class PaciRule:
    """PACI's rule for a model cut into ``stages`` stages (``units`` split as the pipeline's ``partition``).

    :meth:`batch_loss` runs a batch (forwards with each stage's forward-time version) and returns the loss whose
    ``backward()`` gives PACI's gradient; call it once per optimizer step, before the step.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], stages: int, n_microbatches: int | None = None,
                 partition: str | Sequence[str] = "uniform", replicas: int = 1) -> None:
        self.stages, self.n_microbatches = stages, check_paci(stages, n_microbatches)
        #: data-parallel replicas of the pipeline: the batch's micro-batches are theirs in turn, ``n / replicas`` each,
        #: and each replica's first ``p - 1 - s`` read stage ``s``'s previous version
        self.replicas = check_replicas(stages, self.n_microbatches, replicas)
        by_name = dict(units)
        self.stage_units = partition_units(units, stages, partition)
        self.pieces = [PieceModule([(name, by_name[name]) for name in names]) for names in self.stage_units]
        #: every weight once, in model order (a weight tied across stages, the embedding and the head, once)
        self.params: list[torch.Tensor] = list({id(p): p for piece in self.pieces for p in piece.parameters()}.values())
        index = {id(p): i for i, p in enumerate(self.params)}
        self._swaps = [WeightSwap(piece, {n: index[id(p)] for n, p in piece.named_parameters(remove_duplicate=False)})
                       for piece in self.pieces]
        self._stage_params = [sorted({index[id(p)] for p in piece.parameters()}) for piece in self.pieces]
        #: the weights some forward reads stale (those of stages 0 .. p - 2), by position in ``params``
        self._kept = sorted({i for positions in self._stage_params[:-1] for i in positions})
        self._previous: list[torch.Tensor] | None = None  # W(b - 1) of the kept weights; None: no batch yet

    # ---- versions -------------------------------------------------------------------------------
    def previous_weights(self) -> list[torch.Tensor]:
        """The previous version held (the kept weights' ``W(b - 1)``; empty before the first batch)."""
        return list(self._previous or [])

    @torch.no_grad()
    def _remember(self) -> None:
        """Keep the current weights ``W(b)``: the version the next batch's early forwards read."""
        if self._previous is None:
            self._previous = [self.params[i].detach().clone() for i in self._kept]
        else:
            for held, i in zip(self._previous, self._kept):
                held.copy_(self.params[i])

    def forget(self) -> None:
        """Drop the previous version: the next batch reads the current weights everywhere (a refilled pipeline)."""
        self._previous = None

    def _versions(self) -> list[torch.Tensor]:
        versions = list(self.params)
        for held, i in zip(self._previous, self._kept):
            versions[i] = held
        return versions

    def state_dict(self) -> dict:
        """What a checkpoint holds: the settings and the previous version (``None`` before the first batch)."""
        return {"stages": self.stages, "n_microbatches": self.n_microbatches, "previous": self._previous}

    def load_state_dict(self, state: dict) -> None:
        if state.get("stages") != self.stages or state.get("n_microbatches") != self.n_microbatches:
            raise ValueError(
                f"The checkpoint was saved by PACI's rule on {state.get('stages')} stages and "
                f"{state.get('n_microbatches')} micro-batches; this run has {self.stages} and {self.n_microbatches}. "
                "Resume with the same delay settings."
            )
        previous = state.get("previous")
        self._previous = None if previous is None else [
            t.to(self.params[i].device, self.params[i].dtype).clone() for t, i in zip(previous, self._kept)]

    # ---- one batch ------------------------------------------------------------------------------
    def batch_loss(self, module, batch, stale: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
        """The mean of the micro-batches' losses (each at the forward-time versions) and the means of
        ``pipeline_loss``'s scalar extras. ``module`` has the pipeline contract (``pipeline_split_batch``,
        ``pipeline_loss``, optionally ``pipeline_context``). ``stale=False``: every forward on the current weights
        (the synchronous start). Afterwards the current weights are kept as the next batch's previous version."""
        m, p, per_replica = self.n_microbatches, self.stages, self.n_microbatches // self.replicas
        inputs, targets = module.pipeline_split_batch(batch)
        size = rows(inputs)
        if size % m or rows(targets) != size:
            raise ValueError(
                f"DelaySimulation(profile='paci') splits each batch into n_microbatches={m} micro-batches, but the "
                f"batch has {size} rows (targets {rows(targets)}): choose a batch size that is a multiple of {m}, or set "
                "delay.n_microbatches."
            )
        context_fn = getattr(module, "pipeline_context", None)
        versions = self._versions() if stale and self._previous is not None else None
        total, extras = None, {}
        for j, (x, target) in enumerate(zip(split_rows(inputs, m), split_rows(targets, m))):
            context = context_fn(x) if callable(context_fn) else NO_CONTEXT
            value = x
            for s, piece in enumerate(self.pieces):
                if versions is not None and reads_previous(s, j % per_replica, p):
                    value = self._stale_forward(s, value, context, versions)
                else:
                    value = piece(value, context)
            loss, more = split_loss_result(module.pipeline_loss(value, target))
            total = loss / m if total is None else total + loss / m
            for name, v in more.items():
                if isinstance(v, (int, float, torch.Tensor)):
                    extras[name] = extras.get(name, 0.0) + float(v) / m
            torch.clear_autocast_cache()  # each micro-batch casts the weights itself, as a pipeline stage does
        if stale:
            self._remember()
        return total, extras

    def _stale_forward(self, s: int, value, context, versions: list[torch.Tensor]):
        """Stage ``s`` on ``value``: the output of the previous version, the backward of the current one."""
        piece, swap = self.pieces[s], self._swaps[s]

        def run(v, previous: bool):
            if previous:
                with swap.using(versions):
                    return piece(v, context)
            return piece(v, context)

        return recomputed_at_backward(run, value, [self.params[i] for i in self._stage_params[s]])


def recomputed_at_backward(run: Callable, value, params: Sequence[torch.Tensor]):
    """``run(value, True)`` now, without a graph; in the backward, ``run`` again on the same ``value`` with
    ``previous=False`` (the same random state and autocast as the forward) and the incoming gradient back-propagated
    through that recompute into ``value``'s leaves and ``params`` (the weights it reads, whatever they hold by then).

    PACI's backward (:class:`PaciRule`, and the pipeline's ``paci`` schedule, where ``run`` ignores ``previous``: its
    one weight version has been updated in place between the two calls)."""
    leaves, structure = flatten(value)
    out_structure: list = []

    def flat_run(inputs: Sequence[torch.Tensor], previous: bool) -> list[torch.Tensor]:
        out, shape = flatten(run(unflatten(list(inputs), structure), previous))
        out_structure[:] = [shape]
        return out

    params = list(params)
    outputs = _RecomputedBackward.apply(flat_run, len(leaves), params, *leaves, *params)
    return unflatten(list(outputs), out_structure[0])


class _RecomputedBackward(torch.autograd.Function):
    """Forward: ``run(inputs, previous=True)`` (the stage at its previous version). Backward: the stage recomputed
    from the same inputs at the current weights, the incoming gradient back-propagated through it (same random
    state and autocast as the forward)."""

    @staticmethod
    def forward(ctx, run: Callable, n_inputs: int, params: list, *tensors):
        inputs = tensors[:n_inputs]
        ctx.run, ctx.n_inputs, ctx.params = run, n_inputs, params
        ctx.replay = _State.capture(tensors)
        ctx.save_for_backward(*inputs)
        outputs = run(inputs, True)
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[3:]
        inputs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad(), ctx.replay.restored():  # the recompute as the forward ran; its backward outside
            outputs = ctx.run(inputs, False)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        wanted = [t for t, need in zip([*inputs, *ctx.params], needs) if need]
        found = list(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                     ) if pairs and wanted else [None] * len(wanted)
        found.reverse()
        return (None, None, None, *[found.pop() if need else None for need in needs])


class _State:
    """The random-number state and autocast setting of a forward, replayed in its recompute."""

    def __init__(self, device: torch.device, cpu_rng, device_rng, autocast: tuple[bool, torch.dtype]) -> None:
        self.device, self.cpu_rng, self.device_rng, self.autocast = device, cpu_rng, device_rng, autocast

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor]) -> "_State":
        device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        return cls(device, torch.get_rng_state(), device_rng, autocast)

    def restored(self):
        return _Replay(self)


class _Replay:
    def __init__(self, state: _State) -> None:
        self.state = state

    def __enter__(self) -> None:
        s = self.state
        self.saved = torch.get_rng_state(), (torch.cuda.get_rng_state(s.device) if s.device_rng is not None else None)
        torch.set_rng_state(s.cpu_rng)
        if s.device_rng is not None:
            torch.cuda.set_rng_state(s.device_rng, s.device)
        self.cast = torch.autocast(s.device.type, dtype=s.autocast[1], enabled=s.autocast[0])
        self.cast.__enter__()

    def __exit__(self, *exc) -> bool:
        self.cast.__exit__(*exc)
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.state.device)
        return False
