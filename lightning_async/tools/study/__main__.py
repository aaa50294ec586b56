"""``python -m lightning_async.tools.study``: the same as ``lightning-async study``."""

import sys

from lightning_async.tools.study.cli import study_main

if __name__ == "__main__":
    sys.exit(study_main())
