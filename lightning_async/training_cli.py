"""The training commands of ``lightning-async`` (``fit``, ``validate``, ``test``, ``predict``): LightningCLI with the
package's config sections, checks and one-line errors. :mod:`lightning_async.cli` is the entry point; it imports this
module (and so torch and Lightning) only for these commands.

Recipes compose through repeated ``--config`` (later files win); a value that is not a file is the name of
a shipped recipe (``--config quickstart --config optimizers/muon``, :mod:`lightning_async.recipes_index`).
The delay and its correction are config sections of their own (``delay:``, the cause: ``DelaySimulation``;
``correction:``, the remedy: ``DelayCorrection``, Error Feedback being ``method: ef``), so mode and correction
recipes never have to replace the trainer's callback list. ``error_feedback:``, the spelling of
``correction: {method: ef}`` before 0.2.0, is refused with the new spelling (:func:`refuse_removed_sections`).

The ``model`` section takes any LightningModule (``class_path`` + ``init_args``); without a
``class_path`` it is :class:`~lightning_async.lm.CausalLM`, so ``model: {optimizer: muon}`` and
``--model.lr 1e-3`` keep working. The model's ``vocab_size`` always comes from the data module.

Mistakes in the command line or a recipe end with one ``error:`` line and exit code 2 (set
``LIGHTNING_ASYNC_TRACEBACK=1`` for the traceback); a fit stopped by SIGTERM exits with 143.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async import compat
from lightning_async.exit_codes import EXIT_BAD_INPUT, EXIT_SIGTERM
from lightning_async.strategies import AsyncPipelineStrategy  # (importing registers async_pipe / sync_pipe)
from lightning_async.callbacks import (
    DelayCorrection, DelaySimulation, DivergenceGuard, RunTelemetry, StepProgress,
)
from lightning_async.callbacks.progress import replace_default_bar
from lightning_async.callbacks.delay import check_corrections, check_delay_profiles
from lightning_async.callbacks.telemetry import label_log_dirs
from lightning_async.data import TextDataModule
from lightning_async.lm import CausalLM
from lightning_async.pipeline.checkpoint import refuse_pipeline_checkpoint
from lightning_async.recipes_index import RecipeNotFound, resolve_config_args
from lightning_async.run_limits import shorten_cli_config

DEFAULT_MODEL = f"{CausalLM.__module__}.{CausalLM.__name__}"
VOCAB_KEYS = ("model.vocab_size", "model.init_args.vocab_size")


class CLIError(Exception):
    """A mistake in the command line or a recipe: :func:`main` prints it as one ``error:`` line."""


# ---- checks before parsing -------------------------------------------------------------------
def config_paths(args: list[str]) -> list[str]:
    """The files given with ``--config``/``-c`` (either ``--config PATH`` or ``--config=PATH``)."""
    paths = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            paths.append(args[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def _vocab_message(where: str) -> str:
    return (
        f"{where} sets the model's vocab_size, which always comes from the data module (the tokenizer's "
        "vocabulary, linked data.vocab_size -> model.vocab_size). Remove it; to give the model a larger "
        "vocabulary than the tokenizer's, set --data.token_vocab_size N instead."
    )


#: the config section that ``correction: {method: ef}`` replaced (removed in 0.2.0)
REMOVED_SECTION = "error_feedback"


def _removed_section_message(where: str, section: dict) -> str:
    """The error for an ``error_feedback:`` section given at ``where``, its values written the 0.2.0 way."""
    strength = section.get("strength")
    strength = f"{strength:g}" if isinstance(strength, (int, float)) and not isinstance(strength, bool) else "S"
    if strength == "0":
        spelled, flags = "correction: {method: none}", "--correction.method none"
    else:
        keep = section.get("extrapolate_weight_decay")
        options = "" if keep is None else f", options: {{extrapolate_weight_decay: {str(bool(keep)).lower()}}}"
        spelled = f"correction: {{method: ef, strength: {strength}{options}}}"
        flags = f"--correction.method ef --correction.strength {strength}"
    return (f"{where}: the {REMOVED_SECTION}: section was removed in 0.2.0; write {spelled} instead ({flags} on "
            "the command line; CHANGELOG.md, \"Migrating from 0.1\").")


def _removed_sections_in(recipe: dict) -> dict | None:
    """The ``error_feedback`` section of a recipe, at the top or under a subcommand (``fit: {error_feedback: ...}``)."""
    for scope in (recipe, *(recipe.get(sub) for sub in ("fit", "validate", "test", "predict"))):
        if isinstance(scope, dict) and REMOVED_SECTION in scope:
            return scope[REMOVED_SECTION] if isinstance(scope[REMOVED_SECTION], dict) else {}
    return None


def refuse_removed_sections(args: list[str], recipes: dict[str, dict]) -> None:
    """Refuse the ``error_feedback:`` section, in a recipe or as ``--error_feedback.*``, naming the new spelling
    (without this, jsonargparse reports an unknown key and says nothing of ``correction:``)."""
    for path, recipe in recipes.items():
        section = _removed_sections_in(recipe)
        if section is not None:
            raise CLIError(_removed_section_message(f"recipe {path}", section))
    for i, arg in enumerate(args):
        key, _, value = arg.lstrip("-").partition("=")
        if arg.startswith("--") and (key == REMOVED_SECTION or key.startswith(REMOVED_SECTION + ".")):
            field = key.partition(".")[2]
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            try:  # --error_feedback.strength 0.5, or the whole section: --error_feedback '{strength: 0.5}'
                given = yaml.safe_load(value) if value else None
            except yaml.YAMLError:
                given = None
            section = {field: given} if field else given if isinstance(given, dict) else {}
            raise CLIError(_removed_section_message(arg.split("=", 1)[0], section))


def check_recipes(args: list[str]) -> None:
    """Refuse recipe files that are not YAML mappings (naming the file), any setting of the model's
    ``vocab_size`` (it is linked from the data module; jsonargparse would fail with "int | None is not
    callable" or drop the value silently) and the ``error_feedback:`` section removed in 0.2.0."""
    recipes = {}
    for path in config_paths(args):
        if not Path(path).is_file():
            continue  # jsonargparse names a missing file itself
        try:
            with open(path) as stream:  # a stream, so that YAML errors name the file
                recipe = yaml.safe_load(stream)
        except yaml.YAMLError as err:
            raise CLIError(f"recipe {path} is not valid YAML: {err}") from err
        if recipe is not None and not isinstance(recipe, dict):
            raise CLIError(f"recipe {path} must be a mapping of sections (trainer:, model:, data:, ...), "
                           f"got a {type(recipe).__name__}")
        recipes[path] = recipe or {}
        model = (recipe or {}).get("model")
        if isinstance(model, dict):
            init_args = model.get("init_args") if isinstance(model.get("init_args"), dict) else {}
            if model.get("vocab_size") is not None or init_args.get("vocab_size") is not None:
                raise CLIError(_vocab_message(f"recipe {path}"))
    for arg in args:
        if arg.lstrip("-").split("=", 1)[0] in VOCAB_KEYS and arg.startswith("--"):
            raise CLIError(_vocab_message(arg.split("=", 1)[0]))
    refuse_removed_sections(args, recipes)


# ---- checks after instantiation -------------------------------------------------------------------
def max_seq_len(model) -> int | None:
    """The model's ``max_seq_len`` property (``None`` when it has none)."""
    try:
        return getattr(model, "max_seq_len", None)
    except NotImplementedError:
        return None


def check_sequence_length(model, datamodule) -> None:
    """Refuse windows longer than the model's position encoding is built for (it would train silently)."""
    limit, seq_len = max_seq_len(model), getattr(datamodule, "seq_len", None)
    if limit is not None and seq_len is not None and seq_len > limit:
        longer = (f"--model.model_overrides '{{max_seq_len: {seq_len}}}'" if isinstance(model, CausalLM)
                  else "a model configured for longer sequences")
        raise CLIError(
            f"data.seq_len = {seq_len} is longer than the model's maximum sequence length "
            f"({type(model).__name__}.max_seq_len = {limit}). Lower --data.seq_len to at most {limit}, or use {longer}."
        )


def construct(class_type: type, *args, **kwargs):
    """jsonargparse's default way to build a class from the config."""
    return class_type(*args, **kwargs)


class ConstructorErrors:
    """Remembers the exceptions raised by the constructors jsonargparse calls, which it buries: a ``Union``
    such as ``trainer.strategy`` or ``model`` reports "Does not validate against any of the Union
    subtypes" and a Namespace dump instead of the constructor's message."""

    def __init__(self) -> None:
        self.seen: list[tuple[type, Exception]] = []

    def around(self, instantiator):
        """``instantiator`` (jsonargparse's signature), recording what it raises."""
        takes_links = "applied_instantiation_links" in inspect.signature(instantiator).parameters

        def instantiate(class_type, *args, applied_instantiation_links=None, **kwargs):
            if takes_links:
                kwargs["applied_instantiation_links"] = applied_instantiation_links or {}
            try:
                return instantiator(class_type, *args, **kwargs)
            except Exception as err:
                self.seen.append((class_type, err))
                raise

        return instantiate

    def cause(self, err: Exception) -> tuple[type | None, Exception]:
        """The class whose constructor raised the exception behind ``err``, and that exception
        (``None`` and ``err`` itself when no constructor did)."""
        for class_type, cause in reversed(self.seen):
            lines = str(cause).strip().splitlines()
            if cause is err or (lines and lines[0] in str(err)):
                return class_type, cause
        return None, err


# ---- the CLI --------------------------------------------------------------------------------------
class AsyncCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(DelaySimulation, "delay")
        parser.set_defaults({"delay.delay": 0})
        parser.add_lightning_class_args(DelayCorrection, "correction")  # recipes/corrections/<method>.yaml
        parser.set_defaults({"correction.method": "none"})
        parser.add_lightning_class_args(RunTelemetry, "telemetry")
        parser.add_lightning_class_args(DivergenceGuard, "divergence")  # on by default; --divergence.stop false
        parser.add_lightning_class_args(StepProgress, "progress")  # lines instead of the default bar (callbacks/progress.py)
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")

    def parse_arguments(self, parser, args) -> None:
        # `main` always passes the argument list (sys.argv[1:] by default), so LightningCLI's warning
        # about `args` given together with sys.argv does not apply.
        args = list(sys.argv[1:] if args is None else args)
        try:
            args = resolve_config_args(args)  # recipe names -> the shipped files
        except RecipeNotFound as err:
            raise CLIError(str(err)) from err
        check_recipes(args)
        self.config = parser.parse_args(args)
        try:  # LIGHTNING_ASYNC_MAX_STEPS=N: every run trains at most N steps (the docs test; run_limits.py)
            shorten_cli_config(self.config)
        except ValueError as err:
            raise CLIError(str(err)) from err

    def _add_instantiators(self) -> None:
        """LightningCLI's instantiators (model and data: they save the hyperparameters) and a default one
        for every other class, all recording constructor errors. Relies on jsonargparse's
        ``ArgumentParser._instantiators`` registry through ``compat.wrap_instantiators`` (guarded in tests/test_compat.py).
        ``_add_instantiators`` is the hook LightningCLI calls to add them."""
        super()._add_instantiators()
        self.constructor_errors = ConstructorErrors()
        compat.wrap_instantiators(self.parser, self.constructor_errors.around)
        self.parser.add_instantiator(self.constructor_errors.around(construct), object)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as err:
            class_type, cause = getattr(self, "constructor_errors", ConstructorErrors()).cause(err)
            if os.environ.get("LIGHTNING_ASYNC_TRACEBACK"):
                raise cause
            raise CLIError(f"{class_type.__name__}: {cause}" if class_type else str(cause)) from cause

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """Lightning's, after noting the callbacks the user configured: Lightning extends that very list with the
        config sections' callbacks and its own defaults (the progress bar among them)."""
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks")
        self.user_callbacks = list(configured) if isinstance(configured, list) else [configured] if configured else []
        return super().instantiate_trainer(**kwargs)

    def after_instantiate_classes(self) -> None:
        check_sequence_length(self.model, self.datamodule)
        pipeline = isinstance(self.trainer.strategy, AsyncPipelineStrategy)
        try:  # before any data is prepared or any rank starts
            if pipeline:
                self.trainer.strategy.validate_mesh()
            if self.subcommand == "fit":
                check_corrections(self.trainer)
                check_delay_profiles(self.trainer, self.model)
            if not pipeline:
                refuse_pipeline_checkpoint(self.config_init.get(self.subcommand, {}).get("ckpt_path"))
        except ValueError as err:
            raise CLIError(str(err)) from err
        for progress in [cb for cb in self.trainer.callbacks if isinstance(cb, StepProgress)]:
            replace_default_bar(self.trainer, progress, self.user_callbacks)
        telemetry = [cb for cb in self.trainer.callbacks if isinstance(cb, RunTelemetry) and cb.label_log_dir]
        if telemetry:  # runs/quickstart/2bw-async-adamw/version_0: TensorBoard's run list says what each run is
            label_log_dirs(self.trainer, self.model)


def run_cli(args: list[str] | None = None) -> AsyncCLI:
    return AsyncCLI(
        LightningModule,  # any LightningModule; CausalLM when the config gives no class_path
        TextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=False,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def stop_on_sigterm_until_lightning_handles_it(signum: int, frame: object) -> None:
    """SIGTERM handler for the time before Lightning installs its own (that happens after the strategy's
    setup, long after the run folder exists): stop at once with :class:`SIGTERMException`. Once Lightning's
    handler is in place it calls this one too, which then does nothing: Lightning stops at the next batch."""
    if signal.getsignal(signal.SIGTERM) is stop_on_sigterm_until_lightning_handles_it:
        raise SIGTERMException()


def run_training(argv: list[str]) -> int:
    """A training command (``fit``, ``validate``, ``test``, ``predict``): 0 done, 2 bad input (one ``error:`` line),
    143 stopped by SIGTERM."""
    # torch 2.10+ deprecates a check Lightning's _pytree makes on every batch: said once per rank, to no use of yours
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous_handler = signal.signal(signal.SIGTERM, stop_on_sigterm_until_lightning_handles_it) if in_main_thread else None
    try:
        cli = run_cli(argv)
        stopped = cli.trainer.received_sigterm if hasattr(cli, "trainer") else False
    except CLIError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SIGTERMException:  # a SystemExit without a code: the process would exit 0
        stopped = True
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    if stopped:
        print("error: stopped by SIGTERM before the end of the run", file=sys.stderr)
        return EXIT_SIGTERM
    return 0
