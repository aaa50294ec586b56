"""What every staleness correction is: the hooks :func:`~lightning_async.optim.delayed_step.delayed_step` calls.

A delayed step applies the update ``u`` that the optimizer computes from a gradient taken at stale weights
``x_stale`` to the newest weights ``x_new``. A correction acts at one of three places:

``gradient``  before the optimizer's step: it may rewrite the stale gradient, knowing ``x_new`` and ``x_stale``
              (DC-ASGD). Needs the stale weights, which the 2BW pairing and the pipeline's slots hold.
``update``    after the step: it may change the displacement the step applied, knowing ``u`` (EF, adaptive EF,
              the Nesterov-style look-ahead). Needs nothing but its own buffers.
``forward``   it changes the weights the next forward reads (weight prediction). The single-device simulation
              supports it; the pipeline does not (it would need a third weight version per stage).

Gradient- and update-level corrections run in the same code in the simulation and in the pipeline runtime,
so both follow one rule (tested by the pipeline oracle).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch.optim import Optimizer

GRADIENT, UPDATE, FORWARD = "gradient", "update", "forward"


def chunks(tensors: list[torch.Tensor], max_elements: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of ``tensors`` holding at most ``max_elements`` elements (a larger tensor stands alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        if out and size + t.numel() <= max_elements:
            out[-1].append(t)
            size += t.numel()
        else:
            out.append([t])
            size = t.numel()
    return out


#: parameters are corrected in groups of at most this many elements: ``torch._foreach_*`` launches one kernel per
#: group and dtype, and the temporaries stay bounded (a few x 64 MiB in fp32)
CHUNK_ELEMENTS = 1 << 24


class ParameterBuffers:
    """One tensor per parameter (keyed by the parameter object), created as zeros on first use: shaped like
    the parameter, or a 0-d fp32 statistic with ``scalar=True``."""

    def __init__(self, scalar: bool = False) -> None:
        self.scalar = scalar
        self.tensors: dict[torch.Tensor, torch.Tensor] = {}

    def get(self, p: torch.Tensor) -> torch.Tensor:
        buffer = self.tensors.get(p)
        if buffer is not None:
            return buffer
        return torch.zeros((), device=p.device, dtype=torch.float32) if self.scalar else torch.zeros_like(p)

    def __contains__(self, p: torch.Tensor) -> bool:
        return p in self.tensors

    def update(self, pairs) -> None:
        """Replace buffers (new tensors: an earlier ``state_dict`` keeps its own)."""
        self.tensors.update(pairs)

    def values(self):
        return self.tensors.values()

    def __len__(self) -> int:
        return len(self.tensors)

    def state(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        return [self.tensors.get(p) for p in params]

    def load(self, buffers: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], what: str) -> None:
        if len(buffers) != len(params):
            raise ValueError(f"{what} state has {len(buffers)} buffers for {len(params)} parameters.")
        self.tensors = {
            p: b.to(p.device, b.dtype if self.scalar else p.dtype).clone() for p, b in zip(params, buffers) if b is not None
        }


class Correction:
    """Base of the staleness corrections; subclasses override the hook of their :attr:`level`.

    ``strength`` 0 switches a correction off (it then holds no memory). :meth:`state_dict` /
    :meth:`load_state_dict` take the parameters in the optimizer's order, so a checkpoint resumes exactly.
    """

    #: the name recipes and the CLI use (``correction.method``)
    method: ClassVar[str] = ""
    level: ClassVar[str] = UPDATE
    #: reads the weights the gradient was taken at (the 2BW pairing and the pipeline have them; a FIFO does not)
    needs_stale_weights: ClassVar[bool] = False

    def __init__(self, strength: float = 1.0) -> None:
        if not isinstance(strength, (int, float)) or isinstance(strength, bool) or strength < 0:
            raise ValueError(f"{type(self).__name__} strength must be a number >= 0, got {strength!r}.")
        self.strength = float(strength)

    @property
    def enabled(self) -> bool:
        return self.strength != 0.0

    @property
    def pipeline_supported(self) -> bool:
        return self.level != FORWARD

    # ---- hooks -----------------------------------------------------------------------------------
    def compensate_(self, optimizer: Optimizer, grads: dict, newest: dict, stale: dict) -> None:
        """Gradient level, before the step: rewrite ``grads[p]`` in place (``newest[p]``/``stale[p]``: weights)."""

    def correct_(self, optimizer: Optimizer, before: dict) -> None:
        """Update level, after the step: ``before[p]`` held the weights before it, ``p`` holds ``before[p] - u``."""

    def predict_(self, p: torch.Tensor, forward: torch.Tensor, previous: torch.Tensor, delay: int) -> torch.Tensor:
        """Forward level: the weights the next forward of ``p`` reads, given its stale version ``forward`` and
        the version before it, ``previous`` (``delay`` steps behind the newest)."""
        return forward

    def set_delays(self, delays) -> None:
        """Learn each parameter's delay in steps (``{parameter: k}``); corrections whose formula depends on ``k``
        (Error Feedback's k-step form) override this. Without a call every parameter is one step stale."""

    # ---- accounting --------------------------------------------------------------------------------
    def statistics(self) -> dict[str, float]:
        """Scalars worth logging (e.g. the strength an adaptive rule chose), by short name."""
        return {}

    def describe(self) -> dict:
        """The settings that identify the correction in a run's record."""
        return {"method": self.method, "strength": self.strength}

    def state_dict(self, params: Sequence[torch.Tensor]) -> dict:
        return {"method": self.method, "strength": self.strength, **self._buffer_state(params)}

    def _buffer_state(self, params: Sequence[torch.Tensor]) -> dict:
        return {name: buffers.state(params) for name, buffers in self._named_buffers().items()}

    def _named_buffers(self) -> dict[str, ParameterBuffers]:
        return {k: v for k, v in vars(self).items() if isinstance(v, ParameterBuffers)}

    def load_state_dict(self, state: dict, params: Sequence[torch.Tensor]) -> None:
        method = state.get("method", self.method)
        if method != self.method:
            raise ValueError(
                f"The checkpoint's correction is {method!r}, this run's is {self.method!r}: resume with the same correction."
            )
        for name, buffers in self._named_buffers().items():
            buffers.load(state.get(name, [None] * len(params)), params, f"{type(self).__name__} {name}")

    def buffers(self) -> list[torch.Tensor]:
        """Every persistent tensor the correction holds (what ``memory_report`` counts)."""
        return [t for buffers in self._named_buffers().values() for t in buffers.values()]
