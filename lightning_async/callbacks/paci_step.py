"""``DelaySimulation(profile="paci")``: PACI's rule (:mod:`lightning_async.pipeline.paci`) as the module's training step.

A delayed optimizer cannot express PACI (it stashes one version per batch; PACI's forwards read a version that
depends on the micro-batch, its backwards the current one), so the callback replaces the module's
``training_step`` for the fit: the batch is cut into ``n_microbatches`` micro-batches and run stage by stage with
:class:`~lightning_async.pipeline.paci.PaciRule`, whose loss Lightning back-propagates, clips and steps as usual (one
optimizer step per batch: every stage updates after every batch). The module needs the pipeline contract
(``pipeline_units``, ``pipeline_split_batch``, ``pipeline_loss``; optionally ``pipeline_context`` and ``log_loss``).
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer

from lightning_async.pipeline.paci import PaciRule

CONTRACT = ("pipeline_units", "pipeline_split_batch", "pipeline_loss")


def build_rule(pl_module: LightningModule, stages: int, n_microbatches: int | None, partition,
               replicas: int = 1) -> PaciRule:
    """The rule for ``pl_module``'s units, or a ``ValueError`` naming what the module lacks."""
    missing = [name for name in CONTRACT if not callable(getattr(pl_module, name, None))]
    if missing:
        raise ValueError(
            f"DelaySimulation(profile='paci') runs the model stage by stage, but {type(pl_module).__name__} has no "
            f"{', '.join(missing)}. Define the pipeline contract (docs/models.md) or use another profile."
        )
    return PaciRule(list(pl_module.pipeline_units()), stages, n_microbatches, partition, replicas)


def refuse_unsupported(trainer: Trainer, corrections: list) -> None:
    """What PACI's rule does not cover: gradient accumulation across batches, a staleness correction."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"DelaySimulation(profile='paci') steps every stage once per batch of n_microbatches micro-batches; "
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} would change when updates land. Set "
            "trainer.accumulate_grad_batches to 1 and use delay.n_microbatches (or a larger batch)."
        )
    if corrections:
        raise ValueError(
            f"{corrections[0].describe()} corrects a delayed optimizer's update; PACI's rule (profile 'paci') has none "
            "to correct. Set correction.method to none (or use another delay profile)."
        )


def install(pl_module: LightningModule, trainer: Trainer, rule: PaciRule, start_step: int) -> None:
    """Make ``pl_module.training_step`` run ``rule`` (every forward current before ``start_step``)."""

    def training_step(batch, *args, **kwargs):
        stale = trainer.global_step >= start_step
        if not stale:
            rule.forget()  # the first delayed batch reads the weights reached then everywhere
        loss, extras = rule.batch_loss(pl_module, batch, stale=stale)
        if callable(getattr(pl_module, "log_loss", None)):
            pl_module.log_loss("train", loss, batch)
        else:
            pl_module.log("train/loss", loss.detach(), prog_bar=True)
        for name, value in extras.items():
            pl_module.log(f"train/{name}", value)
        return loss

    pl_module.training_step = training_step


def uninstall(pl_module: LightningModule) -> None:
    if "training_step" in vars(pl_module):
        del pl_module.training_step
