"""The exit codes of ``lightning-async`` (shared by :mod:`lightning_async.cli` and :mod:`lightning_async.training_cli`)."""

import signal

#: a mistake in the command line or a recipe (one ``error:`` line)
EXIT_BAD_INPUT = 2
#: a fit stopped by SIGTERM
EXIT_SIGTERM = 128 + signal.SIGTERM
