"""Callbacks that turn on the delayed update rule (one device) and a staleness correction (anywhere).

``DelaySimulation(delay=1)`` wraps the module's optimizer in
:class:`~lightning_async.optim.DelayedOptimizer` with the exact 2BW pairing, so a single device follows
the same update rule, step for step, as the multi-process ``async_pipe`` strategy; ``profile=`` gives
units delays of their own (the original PipeDream's ``p - 1 - s``); ``profile="paci"`` runs PACI's micro-batch rule
as the module's training step instead (:mod:`lightning_async.callbacks.paci_step`).
``DelayCorrection(method, strength)`` (and ``ErrorFeedback(strength)``, its ``method="ef"``) switches a
correction of :mod:`lightning_async.optim.corrections` on for whichever delay source the run has: this
callback's wrapper, or the pipeline strategy. Both paths apply it through the same code.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_async import compat
from lightning_async.optim.corrections import NO_CORRECTION, as_correction, build_correction, check_applicable
from lightning_async.optim.delay import DelayedOptimizer, check_delay
from lightning_async.pipeline import profiles
from lightning_async.callbacks import paci_step  # profile "paci" (PACI's rule)
from lightning_async.pipeline import paci


def two_corrections(names: str) -> ValueError:
    """The error for two staleness corrections switched on at once (``names``: theirs, comma-separated)."""
    return ValueError(f"Two staleness corrections are switched on ({names}); choose one (set the other's strength to "
                      "0, or give the one you want as the correction: section only).")


def pipeline_schedule(trainer: Trainer):
    """The schedule spec of a pipeline strategy (``AsyncPipelineStrategy.schedule_spec``), ``None`` for any other
    strategy. (Asked of the strategy, not imported from ``strategies``: the strategy imports the callbacks.)"""
    return getattr(trainer.strategy, "schedule_spec", None)


def _wrap_configured(result, wrap):
    """Apply ``wrap`` to the optimizer(s) in any ``configure_optimizers`` return format; rebind schedulers."""
    from torch.optim import Optimizer

    def fix_schedulers(schedulers, old, new):
        for s in schedulers:
            sched = s["scheduler"] if isinstance(s, dict) else s
            if getattr(sched, "optimizer", None) is old:
                compat.rebind_lr_scheduler(sched, new)

    if isinstance(result, Optimizer):
        return wrap(result)
    if isinstance(result, dict):
        old = result["optimizer"]
        result["optimizer"] = wrap(old)
        if "lr_scheduler" in result:
            fix_schedulers([result["lr_scheduler"]], old, result["optimizer"])
        return result
    if isinstance(result, (list, tuple)) and len(result) == 2 and isinstance(result[0], (list, tuple)):
        optimizers, schedulers = result
        new = [wrap(o) for o in optimizers]
        for old, fresh in zip(optimizers, new):
            fix_schedulers(schedulers, old, fresh)
        return new, schedulers
    if isinstance(result, (list, tuple)):
        return [_wrap_configured(r, wrap) for r in result]
    raise TypeError(f"DelaySimulation cannot find the optimizer in configure_optimizers()' result {type(result).__name__}.")


def _delay_sources(trainer: Trainer) -> list:
    return [cb for cb in trainer.callbacks if isinstance(cb, DelaySimulation) and cb.active]


def check_corrections(trainer: Trainer) -> None:
    """Every active correction callback's :meth:`DelayCorrection.check`, and on a pipeline that the strategy's own
    ``correction=`` agrees with them (before any rank starts)."""
    for callback in trainer.callbacks:
        if isinstance(callback, DelayCorrection):
            callback.check(trainer)
    if pipeline_schedule(trainer) is not None:
        pipeline_correction_setting(trainer, getattr(trainer.strategy, "correction", None))


def _effective(setting) -> tuple | None:
    """What a correction setting amounts to: the correction's class and its plain options, defaults filled in."""
    correction = as_correction(setting)
    if correction is None:
        return None
    return type(correction), {k: v for k, v in vars(correction).items() if isinstance(v, (bool, int, float, str))}


def pipeline_correction_setting(trainer: Trainer, given):
    """The correction a pipeline run applies: the strategy's ``correction=`` (``given``) or an active correction
    callback's (the strategy reads it at setup; the callback changes nothing); both set and different is refused."""
    active = [cb for cb in trainer.callbacks if isinstance(cb, DelayCorrection) and cb.active]
    if not active:
        return given
    setting = active[0].settings
    if given is not None and _effective(given) != _effective(setting):
        raise ValueError(
            f"AsyncPipelineStrategy(correction={given!r}) and a correction callback ({setting!r}) are both set; "
            "choose one."
        )
    return setting


def check_delay_profiles(trainer: Trainer, pl_module: LightningModule) -> None:
    """Every active :class:`DelaySimulation`'s :meth:`~DelaySimulation.check_profile` (before training starts)."""
    for callback in trainer.callbacks:
        if isinstance(callback, DelaySimulation):
            callback.check_profile(pl_module)
            if callback.paci and callback.active:  # profile "paci": what its rule does not cover
                paci_step.refuse_unsupported(trainer, _active_corrections(trainer))


def _active_corrections(trainer: Trainer) -> list:
    return [cb for cb in trainer.callbacks if isinstance(cb, DelayCorrection) and cb.active]


def _restricted(delays: dict, optimizer) -> dict:
    """The entries of ``delays`` for the parameters ``optimizer`` updates."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return {p: k for p, k in delays.items() if id(p) in mine}


class DelaySimulation(Callback):
    """Simulate an asynchronous pipeline's weight staleness on one device.

    Args:
        delay: ``1`` is PipeDream-2BW (every stage one step stale); ``k > 1`` a uniform k-step delay;
            ``0`` is plain synchronous training. With a ``profile``, the delay of units it does not name.
        pairing: ``"2bw"`` (evaluate batch t at ``x(t-k)``; exact pipeline pairing) or ``"fifo"``.
        start_fraction: share of ``trainer.max_steps`` trained synchronously before the delay starts
            (the paper's "sync start" baseline; 0 = delayed from the first step).
        profile: per-unit delays (:mod:`lightning_async.pipeline.profiles`): ``"2bw"``, ``"pipedream"``, ``"wpipe"``
            (stage ``s`` of ``stages`` is ``stages - 1 - s`` steps stale), a list of per-stage delays, or a
            mapping from the module's ``pipeline_units()`` names to delays. Needs a module with ``pipeline_units``.
        stages: how many stages the profile splits the units into (as the pipeline's ``partition`` would).
        partition: how units are split into stages (``"uniform"``, ``"parameters"`` or the unit names where
            stages 1.. begin).
        n_microbatches: micro-batches per batch for ``profile="paci"`` (PACI's rule, docs/delay.md "PACI"; at least
            ``stages - 1``; ``None``: twice the stages, the pipeline's default). Only that profile takes it.
        replicas: for ``profile="paci"``, the pipeline replicas the rule simulates (``PaciRule(replicas=R)``: the
            batch's micro-batches are the replicas' in turn, ``n_microbatches / R`` each, and each replica's first
            ``p - 1 - s`` read stage ``s``'s previous weights), so a run pairs with ``paci_pipe`` over ``R`` replicas
            (recorded as ``paci-4x2``). Only that profile takes it.
    """

    def __init__(
        self,
        delay: int = 1,
        pairing: str = "2bw",
        start_fraction: float = 0.0,
        profile: str | list[int] | dict[str, int] | None = None,
        stages: int | None = None,
        partition: str | list[str] = "uniform",
        n_microbatches: int | None = None,
        replicas: int = 1,
    ) -> None:
        check_delay(delay)
        if not 0.0 <= start_fraction < 1.0:
            raise ValueError(f"start_fraction must be in [0, 1), got {start_fraction}.")
        if profile is not None and not isinstance(profile, Mapping):
            self._per_stage = profiles.stage_delays(profile, stages, delay)  # checks the profile now
            for k in self._per_stage or []:
                check_delay(k, "a stage's delay")
        elif isinstance(profile, Mapping):
            for k in profile.values():
                check_delay(k, "a unit's delay")
        self.delay, self.pairing, self.start_fraction = delay, pairing, start_fraction
        self.profile, self.stages, self.partition = profile, stages, partition
        # ---- profile "paci": PACI's rule replaces the training step, not the optimizer (callbacks/paci_step.py)
        self.n_microbatches, self.replicas = n_microbatches, replicas
        if self.paci:
            paci.check_replicas(stages, paci.check_paci(stages, n_microbatches), replicas)
        else:
            for name, value, default in (("n_microbatches", n_microbatches, None), ("replicas", replicas, 1)):
                if value != default:
                    raise ValueError(f"{name} is the 'paci' profile's setting; the delay profile "
                                     f"{profiles.describe(profile, stages, delay)} stashes whole batches. "
                                     f"Remove {name}.")
        self._paci: paci.PaciRule | None = None
        # ---- end of profile "paci"
        self._start_step = 0
        self._parameter_delays: dict = {}
        self.correction_settings: dict | None = None  # set by a DelayCorrection callback
        self.optimizers: list[DelayedOptimizer] = []

    @property
    def max_delay(self) -> int:
        """The largest delay any unit gets (what the run is recorded with)."""
        if self.profile is None:
            return self.delay
        if isinstance(self.profile, Mapping):
            return max([self.delay, *self.profile.values()])
        return max(self._per_stage or [self.delay])

    @property
    def active(self) -> bool:
        return self.max_delay > 0

    @property
    def paci(self) -> bool:
        """Whether the profile is PACI's micro-batch rule (run as the training step, no delayed optimizer)."""
        return self.profile == paci.PROFILE

    def profile_label(self) -> str:
        return profiles.describe(self.profile, self.stages, self.delay, self.replicas)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.active or stage != "fit":
            return
        if pipeline_schedule(trainer) is not None:
            raise ValueError(
                "DelaySimulation simulates the pipeline's delay on one device, but strategy is already a pipeline, "
                "which delays for real. Remove the DelaySimulation callback (or set delay: 0)."
            )
        if self.start_fraction:
            if trainer.max_steps is None or trainer.max_steps < 0:
                raise ValueError("DelaySimulation(start_fraction=...) needs trainer.max_steps to place the switch.")
            self._start_step = int(round(self.start_fraction * trainer.max_steps))
        if self.paci:  # ---- profile "paci"
            paci_step.refuse_unsupported(trainer, _active_corrections(trainer))
            self._paci = paci_step.build_rule(pl_module, self.stages, self.n_microbatches, self.partition, self.replicas)
            paci_step.install(pl_module, trainer, self._paci, self._start_step)
            return
        self._parameter_delays = self._profile_delays(pl_module)
        self.optimizers = []
        original = pl_module.configure_optimizers

        def configure_optimizers():
            return _wrap_configured(original(), self._wrap)

        pl_module.configure_optimizers = configure_optimizers

    def check_profile(self, pl_module: LightningModule) -> None:
        """Raise the ``ValueError`` that :meth:`setup` would raise for this module's units (e.g. more stages than
        units), naming the profile, so that the CLI reports it before any data is prepared."""
        if not self.active:
            return
        try:
            self._profile_delays(pl_module)
        except ValueError as err:
            raise ValueError(f"DelaySimulation (delay profile {self.profile_label()}): {err}") from err

    def _profile_delays(self, pl_module: LightningModule) -> dict:
        if self.profile is None:
            return {}
        if self.paci:  # checks the module and its units; no per-parameter delays
            paci_step.build_rule(pl_module, self.stages, self.n_microbatches, self.partition)
            return {}
        if not callable(getattr(pl_module, "pipeline_units", None)):
            raise ValueError(
                f"DelaySimulation(profile=...) maps delays onto pipeline units, but {type(pl_module).__name__} has no "
                "pipeline_units(). Define it (docs/models.md) or use a uniform delay."
            )
        units = list(pl_module.pipeline_units())
        by_unit = profiles.unit_delays(units, self.profile, self.stages, self.delay, self.partition)
        return profiles.parameter_delays(units, by_unit)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Undo the wrapping, so a later fit of the same module starts from its own optimizer."""
        if "configure_optimizers" in vars(pl_module):
            del pl_module.configure_optimizers
        paci_step.uninstall(pl_module)

    def _wrap(self, optimizer) -> DelayedOptimizer:
        settings = dict(self.correction_settings or {"method": NO_CORRECTION})
        wrapped = DelayedOptimizer(
            optimizer,
            self.delay,
            pairing=self.pairing,
            start_step=self._start_step,
            correction=build_correction(**settings),
            parameter_delays=_restricted(self._parameter_delays, optimizer),
        )
        self.optimizers.append(wrapped)
        return wrapped

    def _show_newest(self) -> list:
        """Point the parameters at the newest weights; return what they showed before."""
        shown = []
        for opt in self.optimizers:
            shown.append([p.data for p in opt.params])
            for p, w in zip(opt.params, opt.newest_weights()):
                p.data = w
        return shown

    def _restore(self, shown: list) -> None:
        for opt, datas in zip(self.optimizers, shown):
            for p, d in zip(opt.params, datas):
                p.data = d

    # Evaluation and checkpoints use the newest weights x(t), not the stale ones the next forward reads.
    def on_validation_start(self, trainer, pl_module) -> None:
        self._shown = self._show_newest() if trainer.state.fn == "fit" else None
        if self._paci is not None and trainer.state.fn == "fit":
            self._paci.forget()  # the pipeline drains to evaluate: the batch after reads the current weights everywhere

    def on_validation_end(self, trainer, pl_module) -> None:
        if getattr(self, "_shown", None) is not None:
            self._restore(self._shown)
            self._shown = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._paci is not None:  # the pipeline drains to save (as to evaluate): the batch after reads the current
            self._paci.forget()       # weights everywhere, so the checkpoint holds no previous version
            checkpoint["paci"] = self._paci.state_dict()
        if not self.optimizers:
            return
        shown = self._show_newest()
        newest_state = pl_module.state_dict()
        self._restore(shown)
        checkpoint["state_dict"] = newest_state

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._paci is not None and "paci" in checkpoint:
            self._paci.load_state_dict(checkpoint["paci"])

    def on_fit_end(self, trainer, pl_module) -> None:
        self._show_newest()  # after fit the module holds the newest weights

    def state_dict(self) -> dict:
        return {"delay": self.delay, "pairing": self.pairing, "start_fraction": self.start_fraction,
                "profile": self.profile_label()}


class DelayCorrection(Callback):
    """Correct the delayed update with a correction of :mod:`lightning_async.optim.corrections`.

    Works with a ``DelaySimulation`` callback on one device or with ``strategy="async_pipe"`` (where the
    corrections that change the forward's weights, ``weight-prediction``, are refused), through the same code.

    Args:
        method: ``ef``, ``adaptive-ef``, ``nesterov``, ``dc-asgd``, ``weight-prediction`` or ``none``.
        strength: the correction's strength (``None``: its default; 0 switches it off).
        options: the correction's other arguments (e.g. ``{"momentum": 0.9}`` for ``nesterov``).
    """

    def __init__(self, method: str = "ef", strength: float | None = None, options: dict | None = None) -> None:
        self.method, self.strength, self.options = method, strength, dict(options or {})
        self.correction = build_correction(**self.settings)  # checks the name and options now

    @property
    def settings(self) -> dict:
        """What builds the correction: ``build_correction(**settings)``."""
        return {"method": self.method, **({} if self.strength is None else {"strength": self.strength}), **self.options}

    @property
    def active(self) -> bool:
        return self.correction is not None and self.correction.enabled

    def describe(self) -> str:
        return f"{type(self).__name__}({self.method!r})"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.active or stage != "fit":
            return
        self.check(trainer)
        if pipeline_schedule(trainer) is not None:
            return  # the pipeline strategy reads it at its setup (pipeline_correction_setting)
        for source in _delay_sources(trainer):
            source.correction_settings = self.settings

    def check(self, trainer: Trainer) -> None:
        """Raise ``ValueError`` (naming the fix) if this correction cannot apply to ``trainer``'s run; changes
        nothing (the pipeline's launcher calls it before starting other ranks)."""
        if not self.active:
            return
        others = [cb for cb in trainer.callbacks if isinstance(cb, DelayCorrection) and cb.active and cb is not self]
        if others:
            names = ", ".join(cb.correction.method for cb in [self, *others])
            raise two_corrections(names)
        check_applicable(self.correction, pipeline_schedule(trainer), len(_delay_sources(trainer)), self.describe())


class ErrorFeedback(DelayCorrection):
    """Correct the delayed update: applied displacement ``u + strength * (u - u_prev)`` (paper: strength 1).

    ``DelayCorrection("ef", ...)`` under its own name. ``extrapolate_weight_decay=False`` removes the decoupled
    decay ``lr * wd * x`` from the extrapolated part (the paper's form, the default, extrapolates everything
    the step changes).
    """

    def __init__(self, strength: float = 1.0, extrapolate_weight_decay: bool = True) -> None:
        if strength < 0:
            raise ValueError(f"ErrorFeedback strength must be >= 0, got {strength}.")
        self.extrapolate_weight_decay = extrapolate_weight_decay
        super().__init__("ef", float(strength), {"extrapolate_weight_decay": extrapolate_weight_decay})

    def describe(self) -> str:
        return "ErrorFeedback"
