"""A pipeline checkpoint (``checkpoint_format="dcp"``) as the one-device Lightning checkpoint of the same run, and back.

The one-device run is the delay simulation of the pipeline's rule (``strategy="auto"`` with
``DelaySimulation(delay=1)`` and the same correction callback): it follows PipeDream-2BW step for step, so a run may
move between the two (an ablation from identical weights, a pipeline run continued on one device, a one-device run
continued on a pipeline). Both hold the same state under other names; parameters are matched by global name:

====================================  =================================================================
pipeline (DCP keys)                   one device (Lightning ``.ckpt``)
====================================  =================================================================
``model/<name>``                      ``state_dict`` (the newest weights) and ``rings[i][-1]``
``version/<name>``                    ``rings[i][0]``: the older version, what the next forward reads
``optimizer/<name>/<key>``            ``optimizer_states[0]["optimizer"]["state"][index of <name>]``
``optimizer_group/<name>``            that index's ``param_groups`` entry
``correction/<buffer>/<name>``        ``optimizer_states[0]["delay"]["correction"][<buffer>][index]``
``runtime``: ``batches_done``         ``optimizer_states[0]["delay"]["steps_taken"]``
``trainer``                           everything else (loops, so the step and data position; schedulers)
====================================  =================================================================

(``rings``: :class:`~lightning_async.optim.delay.DelayedOptimizer`'s weight versions per parameter, in the order of
its optimizer's parameters.) A pipeline checkpoint is written after a drain, which applies the pending update: its
two versions are ``x(t)`` and ``x(t+1)``, exactly what the simulation holds after step ``t``.

Both directions need the module (its parameter names and the order ``configure_optimizers`` gives them); the
command ``lightning-async export CKPT OUT --to one-device|pipeline`` builds it from the checkpoint's hyperparameters.
(No Lightning here: the checkpoint dicts are plain dicts.)
"""

from __future__ import annotations

import os
import warnings

import torch

from lightning_async.optim.clock import PieceClock
from lightning_async.pipeline import checkpoint as layout
from lightning_async.pipeline import distributed_checkpoint as distributed
from lightning_async.pipeline import schedules

DELAYED_SCHEDULE = "2bw"  # the pipeline schedule DelaySimulation(delay=1, pairing="2bw") simulates
_RUNTIME_KEYS = ("pipeline_runtime", "pipeline")  # a pipeline's own entries, not a one-device checkpoint's


def optimizer_of(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """``optimizer``, or the one optimizer ``module.configure_optimizers()`` returns (in any of Lightning's forms)."""
    if optimizer is not None:
        return optimizer
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    elif isinstance(configured, (list, tuple)):
        first = configured[0] if configured else None
        found = list(first) if isinstance(first, (list, tuple)) else list(configured)
        found = [o["optimizer"] if isinstance(o, dict) else o for o in found]
        if len(found) != 1:
            raise ValueError(f"{type(module).__name__}.configure_optimizers() returns {len(found)} optimizers; a pipeline "
                             "checkpoint holds one. Pass the optimizer to convert explicitly (optimizer=...).")
        configured = found[0]
    if not isinstance(configured, torch.optim.Optimizer):
        raise ValueError(f"{type(module).__name__}.configure_optimizers() returns no optimizer ({type(configured).__name__}).")
    return configured


def _order(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _refuse_other_model(path: str, problem: str) -> ValueError:
    return ValueError(f"{path} was saved from another model ({problem}): convert it with the model it was saved from "
                      "(the same class and shape).")


def _check_shapes(path: str, saved: dict, module: torch.nn.Module) -> None:
    """``saved`` (name -> shape) must hold every weight of ``module`` with its shape."""
    own = module.state_dict()
    missing = [k for k in own if k not in saved]
    if missing:
        raise _refuse_other_model(path, f"no weights for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    wrong = [f"{k} {tuple(saved[k])} vs {tuple(v.shape)}" for k, v in own.items() if tuple(saved[k]) != tuple(v.shape)]
    if wrong:
        raise _refuse_other_model(path, f"shapes differ: {', '.join(wrong[:3])}")


def to_one_device(directory: str | os.PathLike, out: str | os.PathLike, module: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Write the pipeline DCP checkpoint ``directory`` as the Lightning ``.ckpt`` ``out`` of a one-device run of
    ``module`` (``Trainer(strategy="auto", callbacks=[DelaySimulation(1), <the same correction>])``,
    ``fit(ckpt_path=out)``); return the checkpoint dict. A checkpoint of a synchronous schedule (one weight version)
    becomes a plain one-device checkpoint (no DelaySimulation)."""
    path = layout.resolve(directory)
    if layout.read_meta(path).get("format") != "dcp":
        raise ValueError(f"{path} is a pipeline checkpoint of stage files, not of checkpoint_format='dcp': resume it once "
                         "with AsyncPipelineStrategy(checkpoint_format='dcp') on its own layout and save, then convert that.")
    keys = distributed.saved_keys(path)
    _check_shapes(path, {k[len(distributed.MODEL):]: m.size for k, m in keys.items() if k.startswith(distributed.MODEL)
                         and isinstance(m, distributed.dcp.TensorStorageMetadata)}, module)
    if distributed.RUNTIME not in keys:
        raise ValueError(f"{path} holds no pipeline runtime state (it was saved outside training): its weights load with "
                         "consolidate(), but there is no optimizer state to continue from.")
    optimizer = optimizer_of(module, optimizer)
    params = _order(optimizer)
    request = distributed.RankRequest(keys, module.state_dict(), optimizer, params, 2, distributed.parameter_names(module))
    request.load(path)
    checkpoint = request.checkpoint()
    runtime = checkpoint.pop("pipeline_runtime")
    checkpoint.pop("pipeline", None)
    inner = checkpoint["optimizer_states"][0]
    if runtime["schedule"] != DELAYED_SCHEDULE and schedules.spec(runtime["schedule"]).delayed:
        raise ValueError(
            f"{path} was saved by schedule {runtime['schedule']!r}, whose stages keep their own numbers of weight "
            f"versions; only {DELAYED_SCHEDULE!r} and the synchronous schedules convert to one device. Resume it on a "
            f"pipeline with schedule={runtime['schedule']!r}."
        )
    if runtime["schedule"] == DELAYED_SCHEDULE:
        newest = runtime["slots"][runtime["newest_slot"]]
        older = runtime["slots"][1 - runtime["newest_slot"]]
        checkpoint["optimizer_states"] = [{"optimizer": inner, "delay": {
            "delay": 1, "delays": [1] * len(params), "pairing": "2bw", "steps_taken": runtime["batches_done"],
            "start_step": 0, "grad_queue": [], "rings": [[o, n] for o, n in zip(older, newest)],
            "correction": runtime["correction"] or {},
        }}]
    torch.save(checkpoint, os.fspath(out))
    return checkpoint


def _delay_state(path: str, saved: dict, count: int) -> dict:
    """The ``DelayedOptimizer`` part of a one-device optimizer state, refused where no pipeline runs that rule."""
    own = saved.get("delay")
    fix = "continue on a pipeline only runs of DelaySimulation(delay=1) (pairing '2bw', no profile, no sync start)"
    if own is None:
        raise ValueError(f"{path} is a checkpoint of a run without DelaySimulation (no delayed optimizer state): {fix}.")
    delays = own.get("delays") or [own["delay"]] * count
    if own["pairing"] != "2bw" or own["delay"] != 1 or any(k != 1 for k in delays):
        raise ValueError(f"{path} was saved with delay={own['delay']}, pairing={own['pairing']!r}, per-parameter delays "
                         f"{sorted(set(delays))}: the pipeline's 2BW rule is a one-step delay; {fix}.")
    if own["steps_taken"] < own.get("start_step", 0) or own.get("grad_queue"):
        raise ValueError(f"{path} was saved during DelaySimulation's synchronous start (step {own['steps_taken']} < "
                         f"{own['start_step']}): {fix}.")
    if len(delays) != count:
        raise _refuse_other_model(path, f"its optimizer has {len(delays)} parameters, this model's {count}")
    return own


def to_pipeline(ckpt: str | os.PathLike, out: str | os.PathLike, module: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Write the one-device Lightning checkpoint ``ckpt`` of a ``DelaySimulation(delay=1)`` run of ``module`` as a
    pipeline DCP checkpoint directory ``out`` (``AsyncPipelineStrategy(schedule="2bw", checkpoint_format="dcp")``
    resumes it on any stage count, split and replica count); return ``meta.json``'s content."""
    path = os.fspath(ckpt)
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory (a pipeline checkpoint?): --to pipeline converts a one-device .ckpt file.")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    _check_shapes(path, {k: v.shape for k, v in checkpoint["state_dict"].items()}, module)
    optimizer = optimizer_of(module, optimizer)
    params = _order(optimizer)
    states = checkpoint.get("optimizer_states") or []
    if len(states) != 1:
        raise ValueError(f"{path} holds {len(states)} optimizer states; a pipeline checkpoint holds one optimizer's.")
    own = _delay_state(path, states[0], len(params))
    names = distributed.parameter_names(module)
    newest = [checkpoint["state_dict"][names[id(p)][0]] for p in params]
    rings = own.get("rings") or [[w, w] for w in newest]  # (saved before the first step: one version)
    older = [ring[0] for ring in rings]
    newest_slot = PieceClock(1).write_slot(own["steps_taken"] - 1)  # where the last update landed (2BW's clock)
    runtime = {"schedule": DELAYED_SCHEDULE, "batches_done": own["steps_taken"], "newest_slot": newest_slot,
               "slots": [newest, older] if newest_slot == 0 else [older, newest], "correction": own.get("correction")}
    rest = {k: v for k, v in checkpoint.items() if k not in ("optimizer_states", *_RUNTIME_KEYS)}
    rest["callbacks"] = {k: v for k, v in (rest.get("callbacks") or {}).items() if not k.startswith("DelaySimulation")}
    flat = distributed.rank_state({**rest, "optimizer_states": [states[0]["optimizer"]], "pipeline_runtime": runtime},
                                  optimizer, params, names, with_trainer=True)
    units = getattr(module, "pipeline_units", None)
    meta = {"stages": 1, "units": [[n for n, _ in units()]] if callable(units) else None, "schedule": DELAYED_SCHEDULE,
            "global_step": checkpoint.get("global_step"), "optimizer_shares": None, "format": "dcp",
            "data_parallel_size": 1, "converted_from": "one-device"}
    out = os.fspath(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (begin_save's notes on repairs of the output's folder)
        staging = layout.begin_save(out)
    try:
        distributed.save(flat, staging)
        layout.publish(out, meta)
    except BaseException:
        layout.discard_save(out)
        raise
    return meta
