"""``DelayedOptimizer``: the one-step (or k-step) delay of asynchronous pipelines on one device.

Two ways to pair gradients with weights, both following ``x(t+1) = x(t) - u(g(x(t-k)))``:

``pairing="fifo"`` (gradient FIFO)
    Batch t's gradient is taken at the current weights and applied ``k`` steps later; the first ``k``
    steps apply no update. No weight copies, ``k`` gradient buffers.

``pairing="2bw"`` (weight stash, the exact PipeDream-2BW pairing)
    Batch t is evaluated at ``x(max(t-k, 0))`` (so with ``k=1`` both of the first two batches see
    the initial weights) and its update lands on the newest weights ``x(t)``. ``k + 1`` weight
    versions, exactly as the pipeline stage holds them; this is the oracle the multi-process
    pipeline is tested against. After ``step()`` the parameters hold the version the *next* forward
    must use; :meth:`DelayedOptimizer.newest_weights` returns ``x(t+1)``.

Both call :func:`~lightning_async.optim.delayed_step.delayed_step`, the same code the pipeline
runtime uses, with the staleness corrections of :mod:`lightning_async.optim.corrections`.

**Delay profiles.** ``parameter_delays`` gives parameters delays of their own (a ring of ``k_i + 1`` versions
each, or ``k_i`` queued gradients): the original PipeDream's stage ``s`` of ``p`` is ``p - 1 - s`` steps stale,
which :class:`~lightning_async.callbacks.DelaySimulation` maps onto the units of a model (``profile=``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping

import torch
from torch.optim import Optimizer

from lightning_async.optim.closure import evaluate_closure
from lightning_async.optim.corrections import FORWARD, Correction, ErrorFeedbackCorrection
from lightning_async.optim.delayed_step import delayed_step
from lightning_async.optim.clock import PieceClock

PAIRINGS = ("fifo", "2bw")


def check_delay(delay, what: str = "delay") -> int:
    """``delay`` if it is a non-negative integer number of steps, else a ``ValueError`` saying so."""
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise ValueError(f"{what} must be a non-negative integer number of steps, got {delay!r}.")
    return delay


def validate_delay(delay: int, error_feedback: float, correction: str = "Error Feedback") -> None:
    """Reject settings that cannot describe a delayed run, with the fix in the message."""
    check_delay(delay)
    if error_feedback < 0:
        raise ValueError(f"error_feedback (EF strength) must be >= 0, got {error_feedback}.")
    if error_feedback and delay == 0:
        raise ValueError(
            f"{correction} corrects a delayed update, but no delay source is set (delay=0). "
            "Use delay >= 1 (DelaySimulation callback, DelayedOptimizer) or strategy='async_pipe'."
        )


class OptimizerWrapper(Optimizer):
    """Base for wrappers that share ``param_groups`` and ``state`` with the optimizer they wrap.

    Learning-rate schedulers, Lightning and gradient clipping see the wrapped optimizer's groups.
    """

    def __init__(self, optimizer: Optimizer) -> None:  # noqa: super().__init__ would copy the groups
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for hooks in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, hooks, OrderedDict())

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class DelayedOptimizer(OptimizerWrapper):
    """Apply, at step t, the update the wrapped optimizer computes from the gradient of step ``t - delay``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (the zoo's, or your own).
        delay: steps of staleness ``k``; 0 is plain training, bit-identical to the bare optimizer.
        error_feedback: EF strength ``lam``; applied displacement ``u + lam (u - u_prev)`` (shorthand for
            ``correction=ErrorFeedbackCorrection(lam)``).
        pairing: ``"fifo"`` (gradient FIFO) or ``"2bw"`` (weight stash, exact pipeline pairing).
        extrapolate_weight_decay: whether EF extrapolates the decoupled weight decay too.
        start_step: steps before this one are plain synchronous steps (the paper's "sync start"
            baseline); the delay begins from the weights reached then, like a freshly filled pipeline.
        correction: any staleness correction of :mod:`lightning_async.optim.corrections` (instead of
            ``error_feedback``). Those that read the stale weights (DC-ASGD) or change the forward's weights
            (weight prediction) need ``pairing="2bw"``.
        parameter_delays: delays of individual parameters (the others get ``delay``): a delay profile.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        delay: int = 1,
        error_feedback: float = 0.0,
        pairing: str = "fifo",
        extrapolate_weight_decay: bool = True,
        start_step: int = 0,
        correction: Correction | None = None,
        parameter_delays: Mapping[torch.Tensor, int] | None = None,
    ) -> None:
        super().__init__(optimizer)
        check_delay(delay)
        self.parameter_delays = {p: check_delay(k, "a parameter's delay") for p, k in (parameter_delays or {}).items()}
        known = {id(p) for p in self.params}
        if any(id(p) not in known for p in self.parameter_delays):
            raise ValueError("parameter_delays names a tensor that is not a parameter of the wrapped optimizer.")
        self.delay = delay
        if correction is not None and error_feedback:
            raise ValueError("Give either error_feedback (EF strength) or correction, not both.")
        if correction is None:
            validate_delay(self.max_delay, error_feedback)
            correction = ErrorFeedbackCorrection(error_feedback, extrapolate_weight_decay)
        else:
            validate_delay(self.max_delay, float(correction.enabled), f"The {correction.method!r} correction")
        self.correction = correction
        correction.set_delays(dict(zip(self.params, self.delays())))
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}.")
        self.start_step = start_step
        if pairing not in PAIRINGS:
            raise ValueError(f"Unknown pairing {pairing!r}; choose one of {PAIRINGS}.")
        needs_versions = self.correction.needs_stale_weights or self.correction.level == FORWARD
        if pairing == "fifo" and self.correction.enabled and needs_versions:
            raise ValueError(
                f"The {self.correction.method!r} correction reads the weight versions the gradient was taken at; a "
                "gradient FIFO keeps none. Use pairing='2bw' (the DelaySimulation callback's default)."
            )
        self.pairing = pairing
        self.steps_taken = 0
        self._grad_queue: deque[list[torch.Tensor | None]] = deque()
        self._rings: list[deque[torch.Tensor]] | None = None  # 2bw: per parameter, versions oldest first

    @property
    def max_delay(self) -> int:
        return max([self.delay, *self.parameter_delays.values()])

    def delays(self) -> list[int]:
        """Each parameter's delay, in parameter order."""
        return [self.parameter_delays.get(p, self.delay) for p in self.params]

    @property
    def error_feedback(self) -> float:
        """The EF strength (0 when the correction is another method)."""
        return self.correction.strength if isinstance(self.correction, ErrorFeedbackCorrection) else 0.0

    @error_feedback.setter
    def error_feedback(self, strength: float) -> None:
        validate_delay(self.max_delay, strength)
        if not isinstance(self.correction, ErrorFeedbackCorrection):
            raise ValueError(f"This optimizer's correction is {self.correction.method!r}, not Error Feedback.")
        self.correction.strength = float(strength)

    def _take_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for p in self.params:
            grads.append(p.grad)
            p.grad = None  # the buffer is ours now: nobody may zero or modify it in place
        return grads

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        if self.max_delay == 0 or self.steps_taken < self.start_step:
            self.optimizer.step()
        elif self.pairing == "fifo":
            self._fifo_step()
        else:
            self._stash_step()
        self.steps_taken += 1
        return loss

    def _fifo_step(self) -> None:
        queue = self._grad_queue
        queue.append(self._take_grads())
        grads = [queue[-1 - k][i] if len(queue) > k else None for i, k in enumerate(self.delays())]
        while len(queue) > self.max_delay:
            queue.popleft()
        if all(g is None for g in grads):
            return  # no gradient is old enough yet
        params = self.params
        current = [p.data for p in params]
        newest = [t.clone() for t in current] if self.correction.enabled else current
        delayed_step(self.optimizer, params, grads, newest, current, self.correction)

    def clocks(self) -> list[PieceClock]:
        """Each parameter's update clock (the pipeline's: its versions, which one a step reads and writes)."""
        return [PieceClock(k) for k in self.delays()]

    def _stash_step(self) -> None:
        params = self.params
        clocks = self.clocks()
        if self._rings is None:  # per parameter, the clock's versions oldest first: ring[0] is V(t), ring[-1] the newest
            self._rings = [deque([p.data] + [p.data.clone() for _ in range(c.versions - 1)]) for p, c in zip(params, clocks)]
        rings = self._rings
        predicting = self.correction.enabled and self.correction.level == FORWARD
        # the versions the next forwards read: V(t + 1), ring[1] once ring[0] (this batch's) is freed; predicted
        following = [
            ring[0] if c.applies_at_once else self.correction.predict_(p, ring[1], ring[0], c.delay) if predicting else ring[1]
            for p, ring, c in zip(params, rings, clocks)
        ]
        newest = [ring[-1] for ring in rings]
        # the update lands in the slot of V(t), free once its gradient exists (in place when applied at once)
        out = [ring[0] if c.applies_at_once else ring.popleft() for ring, c in zip(rings, clocks)]
        delayed_step(self.optimizer, params, self._take_grads(), newest, out, self.correction)
        for ring, c, version in zip(rings, clocks, out):
            if not c.applies_at_once:
                ring.append(version)
        for p, forward_weights in zip(params, following):
            p.data = forward_weights

    def newest_weights(self) -> list[torch.Tensor]:
        """The newest weights ``x(t)``, in parameter order (what a checkpoint or evaluation should use)."""
        if self.pairing == "2bw" and self._rings is not None:
            return [ring[-1] for ring in self._rings]
        return [p.data for p in self.params]

    def forward_weights(self) -> list[torch.Tensor]:
        """The weights the next forward reads, in parameter order (the stale version, or the predicted one)."""
        if self._rings is None:
            return [p.data for p in self.params]
        predicted = getattr(self.correction, "predicted", None)
        found = predicted.tensors if predicted is not None and self.correction.enabled else {}
        return [found.get(p, ring[0]) if len(ring) > 1 else ring[0] for p, ring in zip(self.params, self._rings)]

    def weight_versions(self) -> list[torch.Tensor]:
        """Every weight version held (2bw), for memory accounting."""
        return [t for ring in self._rings or [] for t in ring]

    def state_dict(self) -> dict:
        params = self.params
        return {
            "optimizer": self.optimizer.state_dict(),
            "delay": {
                "delay": self.delay,
                "delays": self.delays(),
                "pairing": self.pairing,
                "steps_taken": self.steps_taken,
                "start_step": self.start_step,
                "grad_queue": [list(g) for g in self._grad_queue],
                "rings": None if self._rings is None else [list(ring) for ring in self._rings],
                "correction": self.correction.state_dict(params),
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:
        own = state_dict["delay"]
        saved_delays = own.get("delays")
        if own["delay"] != self.delay or own["pairing"] != self.pairing or saved_delays not in (None, self.delays()):
            raise ValueError(
                f"Checkpoint was saved with delay={own['delay']}, pairing={own['pairing']!r}"
                f"{'' if saved_delays is None else f', per-parameter delays {saved_delays}'}; this run uses "
                f"delay={self.delay}, pairing={self.pairing!r}, per-parameter delays {self.delays()}. "
                "Resume with the same delay settings."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        params = self.params
        self.steps_taken = own["steps_taken"]

        def local(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            return t.to(p.device, p.dtype).clone()

        self._grad_queue = deque(
            [None if g is None else local(g, p) for p, g in zip(params, grads)] for grads in own["grad_queue"]
        )
        self.correction.load_state_dict(own.get("correction", own.get("error_feedback")), params)
        rings = own.get("rings")
        if rings is None and own.get("versions") is not None:  # checkpoints of 0.x: one list per version
            rings = [list(per_param) for per_param in zip(*own["versions"])]
        if rings is None:
            self._rings = None
            return
        self._rings = [deque(local(t, p) for t in ring) for p, ring in zip(params, rings)]
        for p, forward in zip(params, self.forward_weights()):
            p.data = forward
