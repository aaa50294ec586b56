"""Run a documentation snippet as a script: ``python tests/_doc_snippet.py SNIPPET.py``.

Every Lightning ``Trainer`` the snippet builds is shortened by ``LIGHTNING_ASYNC_MAX_STEPS`` with the function the
CLI uses (:func:`lightning_async.run_limits.shorten_trainer_settings`), so a snippet's ``max_steps=100`` obeys the
same rule as a command's ``--trainer.max_steps``. The snippet runs with ``__name__ == "__main__"`` while
``sys.argv`` stays ``[this file, SNIPPET]`` (``runpy.run_path`` would put the snippet in ``sys.argv[0]``), so
Lightning re-executes this runner, not the bare snippet, on a pipeline's other ranks: they are shortened too.
"""

from __future__ import annotations

import functools
import sys


def shorten_every_trainer(max_steps: int) -> None:
    from lightning.pytorch import Trainer

    from lightning_async.run_limits import shorten_trainer_settings

    original = Trainer.__init__

    @functools.wraps(original)
    def shortened(self, *args, **kwargs):
        shorten_trainer_settings(kwargs, max_steps)
        original(self, *args, **kwargs)

    Trainer.__init__ = shortened


def main(script: str) -> None:
    with open(script) as file:
        source = file.read()
    if "Trainer(" in source:  # (importing lightning_async imports Lightning, seconds: only when it is needed anyway)
        from lightning_async.run_limits import MAX_STEPS_VARIABLE, limit_from_environment

        max_steps = limit_from_environment(MAX_STEPS_VARIABLE)
        if max_steps is not None:
            shorten_every_trainer(max_steps)
    exec(compile(source, script, "exec"), {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})


if __name__ == "__main__":
    main(sys.argv[1])
