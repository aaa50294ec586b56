"""The package as a newcomer installs it: build the wheel, install it into a fresh virtual environment (with
the dependencies of this one, but not its editable install), and run the quick start, `study --dry-run` and
`recipes` by name from an empty directory. Downloads nothing (``--no-index``); about a minute on 2 cores."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytestmark = pytest.mark.slow  # the tests here start processes or run the CLI (README.md, Tests)

REPO = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("setup.cfg", "pyproject.toml", "README.md", "lightning_async", "recipes")  # what setuptools reads
BIN = "Scripts" if os.name == "nt" else "bin"


def clean_env() -> dict[str, str]:
    """The environment without anything that could point Python at the source tree or pip at the network
    (the PATH still finds this environment's ``lightning-async``, as a user's PATH may)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    return dict(env, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONWARNINGS="ignore")


def run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def outer_site_dirs() -> list[str]:
    """The site-packages folders of this environment (the dependencies, pip, setuptools). Put in the new
    environment by a ``.pth`` file, whose plain path lines do not run this environment's own ``.pth`` files,
    so the editable install's import hook stays out."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> SimpleNamespace:
    """A fresh virtual environment with the wheel of the current source installed, and an empty directory."""
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.fail("building the wheel needs setuptools in this environment: pip install -e '.[dev]'")
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a clean copy: no stale build/ or egg-info of the checkout gets into the wheel
    source.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", root / "dist", source], cwd=root)
    (wheel,) = (root / "dist").glob("lightning_async-*.whl")

    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False, symlinks=os.name != "nt")
    python = env_dir / BIN / ("python.exe" if os.name == "nt" else "python")
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout.strip()
    Path(site, "outer_site_packages.pth").write_text("\n".join(outer_site_dirs()) + "\n")
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", "--no-compile",
         wheel], cwd=root)
    empty = root / "empty"
    empty.mkdir()
    return SimpleNamespace(env=env_dir, python=python, cli=env_dir / BIN / "lightning-async", empty=empty)


def cli(installed: SimpleNamespace, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``lightning-async ARGS`` of the new environment, run in the empty directory."""
    return run([installed.cli, *args], cwd=installed.empty, timeout=timeout)


def test_the_wheels_copy_is_imported_and_ships_the_recipes(installed):
    code = "import importlib.util; print(importlib.util.find_spec('lightning_async').origin)"  # no torch import
    package = Path(run([installed.python, "-c", code], cwd=installed.empty).stdout.strip())
    assert package.is_relative_to(installed.env), package  # not the checkout's editable install
    def yaml_files(folder: Path) -> list[Path]:
        return sorted(p.relative_to(folder) for p in folder.rglob("*.yaml"))

    assert yaml_files(package.parent / "recipes") == yaml_files(REPO / "recipes")
    findings = sorted(p.name for p in (REPO / "lightning_async" / "tools").glob("*.json"))  # probe's and plan's advice
    assert findings and sorted(p.name for p in (package.parent / "tools").glob("*.json")) == findings
    assert installed.cli.is_file()  # the console script


def test_quickstart_composes_recipes_by_name_from_an_empty_directory(installed):
    cli(installed, "fit", "--config", "quickstart", "--config", "optimizers/muon", "--config", "modes/delayed-ef.yaml",
        "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false", "--data.max_chars", "100000", "--data.val_batches", "1",
        "--data.progress", "false", "--data.cache_dir", "cache")
    run_dir = installed.empty / "runs" / "quickstart" / "delayed-ef-muon" / "version_0"
    assert (run_dir / "DONE").exists()
    identity = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    composed = (identity["optimizer"], identity["mode"], identity["delay"], identity["ef_strength"])
    assert composed == ("muon", "delayed", 1, 1.0)


def test_study_dry_run_and_recipes_by_name_from_an_empty_directory(installed):
    out = cli(installed, "study", "--config", "quickstart", "--dry-run").stdout
    assert "study quickstart: 21 runs -> studies/quickstart" in out and "not found" not in out
    assert f"  {installed.cli} fit --config" in out  # the runs use this environment's command, not the PATH's
    configs = {line.split()[i + 1] for line in out.splitlines() if "--config" in line
               for i, word in enumerate(line.split()) if word == "--config"}
    assert len(configs) == 1 + 7 + 3  # the quick start, seven optimizers, three modes, all from the wheel
    assert all(Path(c).is_file() and Path(c).is_relative_to(installed.env) for c in configs), configs

    listing = cli(installed, "recipes").stdout
    assert "optimizers/muon" in listing and "study/quickstart" in listing
    root = installed.env.glob("lib*/python*/site-packages/lightning_async/recipes")  # where they come from
    assert f"Recipes shipped with lightning-async ({next(root)})." in listing
