"""What a pipeline cannot train, refused before any rank starts (the launcher calls :func:`refuse_before_launch`).

Each refusal is one line naming the rule and the fix. Before, manual optimization waited for the whole ``timeout``
and ended in a SIGTERM message that did not name the cause, two optimizers ended in torch's "optimizer got an empty
parameter list" on stage 0, and gradient accumulation and clipping by value were refused only once every rank had
started.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_async import compat

#: the steps Lightning calls on one device and the pipeline strategy does not
BYPASSED_STEPS = ("training_step", "validation_step", "test_step")


def count_optimizers(module) -> int | None:
    """How many optimizers ``module.configure_optimizers()`` returns; ``None`` when it cannot run yet (it reads the
    trainer, which is attached only after launch)."""
    try:
        with torch.no_grad():
            return len(compat.configured_optimizers(module.configure_optimizers()))
    except Exception:
        return None


def refuse_optimizers(module, count: int | None) -> None:
    """One optimizer, stepped by the strategy (``count``: :func:`count_optimizers`; ``None`` is not refused)."""
    if count is not None and count != 1:
        raise ValueError(
            f"configure_optimizers returned {count} optimizers, but the pipeline strategy steps exactly one per stage: "
            "put every parameter into one optimizer (parameter groups, or the zoo's composite optimizers such as muon)."
        )


def refuse_before_launch(trainer, module) -> bool:
    """Refuse a fit the pipeline cannot run; returns whether the optimizers could be counted already."""
    if module is None or trainer.state.fn != TrainerFn.FITTING:
        return True
    if not module.automatic_optimization:
        raise ValueError(
            "automatic_optimization = False cannot run under a pipeline strategy: the pipeline runs the forwards, "
            "backwards and optimizer step itself. Use automatic optimization (return one optimizer from "
            "configure_optimizers, the loss from pipeline_loss)."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} with a pipeline strategy: micro-batches are "
            "its accumulation. Set accumulate_grad_batches=1 and raise n_microbatches (and the batch size) instead."
        )
    algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)  # (a str enum)
    if trainer.gradient_clip_val and algorithm not in (None, "norm"):
        raise ValueError(
            f"gradient_clip_algorithm={algorithm!r}: the pipeline strategy clips by the global "
            "norm over all stages only. Set gradient_clip_algorithm='norm'."
        )
    if type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        raise ValueError(
            f"{type(module).__name__} overrides configure_gradient_clipping, which a pipeline strategy cannot honour: "
            "each stage holds only its own gradients, and the pipeline clips by the global norm over all stages "
            "(gradient_clip_val). Remove the override and set Trainer(gradient_clip_val=...), or log norms in "
            "on_before_optimizer_step, which runs on every stage."
        )
    count = count_optimizers(module)
    refuse_optimizers(module, count)
    return count is not None


def warn_bypassed_steps(module) -> None:
    """One warning when the module overrides steps the pipeline does not run (their ``self.log`` calls would vanish);
    ``pipeline_ignores_steps = True`` on the class says they are its single-device path only."""
    if module is None or getattr(module, "pipeline_ignores_steps", False):
        return
    overridden = [name for name in BYPASSED_STEPS if getattr(type(module), name, None) is not getattr(LightningModule, name)]
    if overridden:
        rank_zero_warn(
            f"{type(module).__name__} overrides {', '.join(overridden)}, which the pipeline strategy does not run (only "
            "pipeline_loss runs, on the last stage): what they log will not appear. Return extra values from "
            "pipeline_loss as (loss, {name: value}) to log them as train/<name>, val/<name>, test/<name>; set "
            "pipeline_ignores_steps = True on the class once they are the single-device path only.",
            category=UserWarning,
        )
