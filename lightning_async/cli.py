"""The ``lightning-async`` command: the training commands of LightningCLI (``fit``, ``validate``, ``test``,
``predict``; :mod:`lightning_async.training_cli`) plus ``compare``, ``study``, ``probe``, ``plan``, ``recipes`` and
``export``.

This module imports neither torch nor Lightning: ``lightning-async --help`` lists every command at once, and each
command imports only what it needs (a tool its module, a training command LightningCLI). Names of the training
part (``run_cli``, ``AsyncCLI``, ``CLIError``, ...) are still reachable from here.
"""

from __future__ import annotations

import importlib
import sys

from lightning_async.exit_codes import EXIT_BAD_INPUT, EXIT_SIGTERM  # noqa: F401  (EXIT_SIGTERM: the training part's)

# subcommand -> (module, function); imported lazily so `fit` does not pay for matplotlib & co.
TOOLS = {
    "compare": ("lightning_async.compare", "compare_main"),
    "study": ("lightning_async.tools.study", "study_main"),
    "probe": ("lightning_async.tools.probe", "probe_main"),
    "plan": ("lightning_async.tools.plan", "plan_main"),
    "recipes": ("lightning_async.recipes_index", "recipes_main"),
    "export": ("lightning_async.export", "export_main"),
}

#: the training commands (LightningCLI's subcommands) and their line in `lightning-async --help`
TRAINING_SUMMARIES = {
    "fit": "train a model (e.g. --config quickstart --config pipeline/async)",
    "validate": "one pass over the validation data (a checkpoint: --ckpt_path)",
    "test": "one pass over the test data (a checkpoint: --ckpt_path)",
    "predict": "run the model's predict_step over the data",
}

# the one line each tool gets in `lightning-async --help`
TOOL_SUMMARIES = {
    "study": "run a matrix of trainings: optimizers x modes x corrections x seeds",
    "compare": "gap table, report and curves of finished runs (sync vs async)",
    "probe": "what the one-step delay costs your recipe, and the correction to use",
    "plan": "each schedule's time and memory per shape; 2BW vs the best sync one",
    "export": "a checkpoint as a Hugging Face model (--to: one-device|pipeline)",
    "recipes": "list the shipped recipes, or copy one out to edit",
}
HELP_FLAGS = ("-h", "--help")
#: commands removed in 0.2.0 -> the command to use (an error that names it, not LightningCLI's "invalid choice")
REMOVED_COMMANDS = {"simulate": "plan"}


def _listing(summaries: dict[str, str]) -> list[str]:
    width = max(map(len, {**TRAINING_SUMMARIES, **TOOL_SUMMARIES})) + 2
    return [f"  {name:<{width}}{summary}" for name, summary in summaries.items()]


def top_level_help() -> str:
    """``lightning-async --help``: every command on the usage line and one line each below it."""
    commands = ",".join([*TRAINING_SUMMARIES, *TOOL_SUMMARIES])
    return "\n".join([
        "usage: lightning-async [-h]",
        f"       {{{commands}}} ...",
        "",
        "lightning-async: asynchronous pipeline-parallel pretraining with Lightning.",
        "",
        "training commands (LightningCLI; `lightning-async fit --help` for every option):",
        *_listing(TRAINING_SUMMARIES),
        "",
        "more commands (run `lightning-async COMMAND --help` for their options):",
        *_listing(TOOL_SUMMARIES),
        "",
        "options:",
        "  -h, --help  show this help message and exit",
    ])


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 done, 2 bad input (one ``error:`` line), 143 stopped by SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in REMOVED_COMMANDS:
        print(f"error: `lightning-async {argv[0]}` was removed in 0.2.0: use `lightning-async {REMOVED_COMMANDS[argv[0]]}` "
              "(the same options)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv and argv[0] in TOOLS:
        module, function = TOOLS[argv[0]]
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    if not argv or argv[0] in HELP_FLAGS:
        print(top_level_help())
        if not argv:
            print(f"error: give a command: {', '.join([*TRAINING_SUMMARIES, *TOOL_SUMMARIES])}", file=sys.stderr)
        return 0 if argv else EXIT_BAD_INPUT
    from lightning_async.training_cli import run_training

    return run_training(argv)


def __getattr__(name: str):
    """The training part's names (``run_cli``, ``CLIError``, ``AsyncCLI``, ...), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    training_cli = importlib.import_module("lightning_async.training_cli")
    try:
        return getattr(training_cli, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":
    sys.exit(main())
