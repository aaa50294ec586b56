"""CI: the README's shell commands (quick start, compose, Hugging Face), as written, on the README's own install.

Run by ``.ci/run`` after ``pip install -e .`` and before the test extras go in, so a command that needs a package
the README's install does not bring (matplotlib for compare's plots, once) fails here instead of hiding behind
``.[dev]``; the Hugging Face block installs its own extra (``.[hf]``) as the README says. The commands come from README.md itself (``tests/_doc_blocks.py`` reads its blocks as the docs test
does); they run in bash in a fresh working directory, shortened by the package's own rule
(``LIGHTNING_ASYNC_MAX_STEPS``, ``LIGHTNING_ASYNC_MAX_RUNS``: lightning_async/run_limits.py). ``pip install``
parts run from the repository (``.`` is the checkout), except the CPU-torch line: CI installs torch==2.13.0 from
the package registry first. ``my_recipe.yaml`` (your recipe, in the README) is the quick start's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from _doc_blocks import read_blocks, shell_commands  # noqa: E402

SECTIONS = ("## Quick start", "## Compose recipes", "## Bring your own model: Hugging Face")
SHORTENED = {"LIGHTNING_ASYNC_MAX_STEPS": "5", "LIGHTNING_ASYNC_MAX_RUNS": "2", "OMP_NUM_THREADS": "1"}


def section_blocks(readme: Path) -> list:
    """The shell blocks under the :data:`SECTIONS` headings of ``readme``, in order."""
    lines = readme.read_text().splitlines()
    headings = [(i + 1, line) for i, line in enumerate(lines) if line.startswith("## ")]

    def section(line_number: int) -> str:
        return max(((n, h) for n, h in headings if n < line_number), default=(0, ""))[1]

    def wanted(block) -> bool:
        return block.kind == "shell" and section(block.line).startswith(SECTIONS)

    found = [b for b in read_blocks(readme) if wanted(b)]
    missing = [s for s in SECTIONS if not any(section(b.line).startswith(s) for b in found)]
    if missing:
        raise SystemExit(f"README.md has no shell block under {missing}: update .ci/readme_commands.py")
    return found


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="readme-commands-"))
    (work / "my_recipe.yaml").write_text((REPO / "recipes/quickstart.yaml").read_text())
    env = {**os.environ, **SHORTENED}
    for block in section_blocks(REPO / "README.md"):
        for command in shell_commands(block.text):
            for part in command.split(" && "):
                if part.startswith("pip install torch"):
                    print(f"[README.md:{block.line}] skipped (torch==2.13.0 is installed by .ci/run): {part}", flush=True)
                    continue
                cwd = REPO if part.startswith("pip install") else work
                print(f"[README.md:{block.line}] {part}", flush=True)
                start = time.perf_counter()
                done = subprocess.run(["bash", "-c", part], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
                if done.returncode != 0:
                    print(done.stdout[-6000:])
                    print(f"FAILED (exit {done.returncode}) in {work}: {part}", flush=True)
                    return 1
                print(f"  ok in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
