"""The ``lightning-async`` command: LightningCLI (``fit``, ``validate``, ``test``) plus ``compare``,
``study``, ``probe`` and ``simulate``.

Recipes compose through repeated ``--config`` (later files win). The delay and the correction are
config sections of their own (``delay:``, ``error_feedback:``), so mode recipes never have to
replace the trainer's callback list.
"""

from __future__ import annotations

import importlib
import sys

from lightning.pytorch.cli import LightningCLI

import lightning_async.strategies  # noqa: F401  (registers async_pipe / sync_pipe)
from lightning_async.callbacks import DelaySimulation, ErrorFeedback, RunTelemetry
from lightning_async.data import TextDataModule
from lightning_async.lm import CausalLM

# subcommand -> (module, function); imported lazily so `fit` does not pay for matplotlib & co.
TOOLS = {
    "compare": ("lightning_async.compare", "compare_main"),
    "study": ("lightning_async.study", "study_main"),
    "probe": ("lightning_async.probe", "probe_main"),
    "simulate": ("lightning_async.simulate", "simulate_main"),
}


class AsyncCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(DelaySimulation, "delay")
        parser.set_defaults({"delay.delay": 0})
        parser.add_lightning_class_args(ErrorFeedback, "error_feedback")
        parser.set_defaults({"error_feedback.strength": 0.0})
        parser.add_lightning_class_args(RunTelemetry, "telemetry")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def run_cli(args: list[str] | None = None) -> AsyncCLI:
    return AsyncCLI(
        CausalLM,
        TextDataModule,
        subclass_mode_model=False,
        subclass_mode_data=False,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        module, function = TOOLS[argv[0]]
        return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    run_cli(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
