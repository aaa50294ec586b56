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
runtime uses, with Error Feedback from :class:`~lightning_async.optim.error_feedback.ErrorFeedbackCorrection`.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch
from torch.optim import Optimizer

from lightning_async.optim.delayed_step import delayed_step
from lightning_async.optim.error_feedback import ErrorFeedbackCorrection

PAIRINGS = ("fifo", "2bw")


def validate_delay(delay: int, error_feedback: float) -> None:
    """Reject settings that cannot describe a delayed run, with the fix in the message."""
    if not isinstance(delay, int) or delay < 0:
        raise ValueError(f"delay must be a non-negative integer number of steps, got {delay!r}.")
    if error_feedback < 0:
        raise ValueError(f"error_feedback (EF strength) must be >= 0, got {error_feedback}.")
    if error_feedback and delay == 0:
        raise ValueError(
            "Error Feedback corrects a delayed update, but no delay source is set (delay=0). "
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
        error_feedback: EF strength ``lam``; applied displacement ``u + lam (u - u_prev)``.
        pairing: ``"fifo"`` (gradient FIFO) or ``"2bw"`` (weight stash, exact pipeline pairing).
        extrapolate_weight_decay: whether EF extrapolates the decoupled weight decay too.
        start_step: steps before this one are plain synchronous steps (the paper's "sync start"
            baseline); the delay begins from the weights reached then, like a freshly filled pipeline.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        delay: int = 1,
        error_feedback: float = 0.0,
        pairing: str = "fifo",
        extrapolate_weight_decay: bool = True,
        start_step: int = 0,
    ) -> None:
        super().__init__(optimizer)
        validate_delay(delay, error_feedback)
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}.")
        self.start_step = start_step
        if pairing not in PAIRINGS:
            raise ValueError(f"Unknown pairing {pairing!r}; choose one of {PAIRINGS}.")
        self.delay = delay
        self.pairing = pairing
        self.correction = ErrorFeedbackCorrection(error_feedback, extrapolate_weight_decay)
        self.steps_taken = 0
        self._grad_queue: deque[list[torch.Tensor | None]] = deque()
        self._versions: deque[list[torch.Tensor]] | None = None

    @property
    def error_feedback(self) -> float:
        return self.correction.strength

    @error_feedback.setter
    def error_feedback(self, strength: float) -> None:
        validate_delay(self.delay, strength)
        self.correction.strength = float(strength)

    def _take_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for p in self.params:
            grads.append(p.grad)
            p.grad = None  # the buffer is ours now: nobody may zero or modify it in place
        return grads

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.delay == 0 or self.steps_taken < self.start_step:
            self.optimizer.step()
        elif self.pairing == "fifo":
            self._fifo_step()
        else:
            self._stash_step()
        self.steps_taken += 1
        self._opt_called = True  # what torch's LRScheduler records on the optimizers it patches
        return loss

    # Schedulers built on the wrapped optimizer are rebound to this wrapper (Lightning requires it); torch's
    # LRScheduler checks this marker on ``optimizer.step`` and would otherwise warn that ``step()`` was
    # overridden after the scheduler was created.
    step._wrapped_by_lr_sched = True

    def _fifo_step(self) -> None:
        self._grad_queue.append(self._take_grads())
        if len(self._grad_queue) <= self.delay:
            return  # no gradient is old enough yet
        params = self.params
        current = [p.data for p in params]
        newest = [t.clone() for t in current] if self.correction.enabled else current
        delayed_step(self.optimizer, params, self._grad_queue.popleft(), newest, current, self.correction)

    def _stash_step(self) -> None:
        params = self.params
        if self._versions is None:
            self._versions = deque([[p.data for p in params]] + [[p.data.clone() for p in params] for _ in range(self.delay)])
        newest = self._versions[-1]
        out = self._versions.popleft()  # the version this batch was evaluated at: free once its gradient exists
        delayed_step(self.optimizer, params, self._take_grads(), newest, out, self.correction)
        self._versions.append(out)
        for p, forward_weights in zip(params, self._versions[0]):
            p.data = forward_weights

    def newest_weights(self) -> list[torch.Tensor]:
        """The newest weights ``x(t)``, in parameter order (what a checkpoint or evaluation should use)."""
        if self.pairing == "2bw" and self._versions is not None:
            return list(self._versions[-1])
        return [p.data for p in self.params]

    def state_dict(self) -> dict:
        params = self.params
        return {
            "optimizer": self.optimizer.state_dict(),
            "delay": {
                "delay": self.delay,
                "pairing": self.pairing,
                "steps_taken": self.steps_taken,
                "start_step": self.start_step,
                "grad_queue": [list(g) for g in self._grad_queue],
                "versions": None if self._versions is None else [list(v) for v in self._versions],
                "error_feedback": self.correction.state_dict(params),
            },
        }

    def load_state_dict(self, state_dict: dict) -> None:
        own = state_dict["delay"]
        if own["delay"] != self.delay or own["pairing"] != self.pairing:
            raise ValueError(
                f"Checkpoint was saved with delay={own['delay']}, pairing={own['pairing']!r}; this run uses "
                f"delay={self.delay}, pairing={self.pairing!r}. Resume with the same delay settings."
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        params = self.params
        self.steps_taken = own["steps_taken"]
        self._grad_queue = deque(
            [None if g is None else g.to(p.device, p.dtype).clone() for p, g in zip(params, grads)]
            for grads in own["grad_queue"]
        )
        self.correction.load_state_dict(own["error_feedback"], params)
        if own["versions"] is None:
            self._versions = None
            return
        self._versions = deque([t.to(p.device, p.dtype).clone() for p, t in zip(params, v)] for v in own["versions"])
        for p, forward_weights in zip(params, self._versions[0]):
            p.data = forward_weights
