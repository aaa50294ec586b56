"""``python -m lightning_async.compare RUN_DIR ... [--output DIR]``."""

import sys

from lightning_async.compare import compare_main

sys.exit(compare_main())
