"""Recipes by name: find, list and copy the YAML recipes shipped with the package.

The recipes live in the repository's top-level ``recipes/`` folder, which the package installs as the data
package ``lightning_async.recipes`` (``package_dir`` in ``setup.cfg``), so an editable install and a wheel
both see them. A recipe's name is its path below that folder without ``.yaml``::

    lightning-async fit --config quickstart --config optimizers/muon --config modes/delayed-ef
    lightning-async recipes                        # list them, grouped by folder
    lightning-async recipes copy optimizers/muon   # ./muon.yaml, to edit

A ``--config`` value that is an existing file is used as it is (paths keep working and win over names);
``.yaml`` and a leading ``recipes/`` are optional in a name, so the repository-relative paths of the docs
(``recipes/quickstart.yaml``) work from any directory.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

RECIPES_PACKAGE = "lightning_async.recipes"
SUFFIXES = (".yaml", ".yml")
CONFIG_FLAGS = ("--config", "-c")
PREFIX = "recipes/"  # the repository-relative spelling of a name
NAME_PATTERN = re.compile(r"[\w.~/-]+")  # anything else (spaces, ':', '{') is inline YAML for jsonargparse
DESCRIPTION_WIDTH = 100


class RecipeNotFound(ValueError):
    """A ``--config`` value that is neither a file nor the name of a shipped recipe."""


def recipes_root() -> Path:
    """The folder of the shipped recipes: the installed ``lightning_async.recipes`` data package (wheel or
    editable install), or ``recipes/`` beside the package in a source checkout that is not installed."""
    try:
        return Path(importlib.import_module(RECIPES_PACKAGE).__file__).parent
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "recipes"


def recipe_names(root: Path | None = None) -> list[str]:
    """The names of all shipped recipes (``quickstart``, ``optimizers/muon``, ...), top level first."""
    root = root or recipes_root()
    files = [p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    names = [p.relative_to(root).with_suffix("").as_posix() for p in files]
    return sorted(names, key=lambda name: (name.count("/"), name))


def _name_of(value: str) -> str:
    """``value`` as a recipe name: without ``recipes/`` in front and without the YAML suffix."""
    name = value.replace(os.sep, "/")
    name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def find_recipe(value: str, root: Path | None = None) -> Path | None:
    """The shipped recipe called ``value`` (``optimizers/muon``, ``optimizers/muon.yaml`` or
    ``recipes/optimizers/muon.yaml``), or ``None`` when there is none."""
    root = root or recipes_root()
    name = _name_of(value)
    if not name or name.startswith("/") or ".." in name.split("/"):
        return None
    for suffix in SUFFIXES:
        path = root / f"{name}{suffix}"
        if path.is_file():
            return path
    return None


def _not_found(value: str, root: Path) -> RecipeNotFound:
    names = recipe_names(root)
    close = difflib.get_close_matches(_name_of(value), names, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return RecipeNotFound(
        f"--config {value}: no such file, and no shipped recipe of that name.{hint} "
        f"`lightning-async recipes` lists the recipes ({len(names)} in {root}); give a file by its path."
    )


def resolve_config(value: str, root: Path | None = None) -> str:
    """What ``--config value`` means: ``value`` itself if it is an existing file (or inline YAML, which
    jsonargparse parses), else the path of the shipped recipe of that name. Raises :class:`RecipeNotFound`
    (naming close matches) for a name that is neither."""
    if Path(value).expanduser().is_file() or not NAME_PATTERN.fullmatch(value):
        return value
    root = root or recipes_root()
    found = find_recipe(value, root)
    if found is None:
        raise _not_found(value, root)
    return str(found)


def resolve_config_args(argv: Sequence[str], root: Path | None = None) -> list[str]:
    """``argv`` with every ``--config``/``-c`` value (``--config X`` or ``--config=X``) resolved by
    :func:`resolve_config`; every other argument unchanged."""
    out = list(argv)
    for i, arg in enumerate(out):
        if i > 0 and out[i - 1] in CONFIG_FLAGS:
            out[i] = resolve_config(arg, root)
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_config(arg.split("=", 1)[1], root)
    return out


# ---- the `recipes` command ----------------------------------------------------------------------
def description(path: Path) -> str:
    """The recipe's first line when it is a comment (without ``#``), shortened to one screen line."""
    with open(path) as stream:
        first = next((line.strip() for line in stream if line.strip()), "")
    if not first.startswith("#"):
        return ""
    text = first.lstrip("#").strip()
    return text if len(text) <= DESCRIPTION_WIDTH else text[: DESCRIPTION_WIDTH - 3].rstrip() + "..."


def listing(root: Path | None = None) -> str:
    """All shipped recipes, grouped by folder, each with its description."""
    root = root or recipes_root()
    names = recipe_names(root)
    width = max(map(len, names), default=0)
    lines = [
        f"Recipes shipped with lightning-async ({root}).",
        "Use them by name, later ones win: lightning-async fit --config quickstart --config optimizers/muon",
    ]
    folder = None
    for name in names:
        here = name.rpartition("/")[0]
        if here != folder:
            folder = here
            lines += ["", f"{folder}/" if folder else "(top level)"]
        text = description(find_recipe(name, root))
        lines.append(f"  {name:<{width}}  {text}".rstrip())
    lines += ["", "Copy one to edit: lightning-async recipes copy NAME [DEST]"]
    return "\n".join(lines)


def copy_recipe(value: str, dest: str | os.PathLike | None = None, *, force: bool = False,
                root: Path | None = None) -> Path:
    """Copy the shipped recipe ``value`` to ``dest`` (a file, or a folder to copy into; default: the
    current directory) and return the new file. Refuses to overwrite a file unless ``force``."""
    root = root or recipes_root()
    source = find_recipe(value, root)
    if source is None:
        raise _not_found(value, root)
    target = Path(dest) if dest is not None else Path()
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        raise FileExistsError(f"{target} exists; give another DEST, or --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target


def build_parser(prog: str = "lightning-async recipes") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="List the shipped recipes, or copy one out to edit.")
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("list", help="list the recipes (the default)")
    copy = commands.add_parser("copy", help="copy a recipe to edit it")
    copy.add_argument("name", help="recipe name, e.g. optimizers/muon")
    copy.add_argument("dest", nargs="?", help="file or folder to copy to (default: the current directory)")
    copy.add_argument("--force", action="store_true", help="overwrite DEST if it exists")
    return parser


def recipes_main(argv: Iterable[str] | None = None) -> int:
    """Entry point of ``lightning-async recipes``: 0 done, 2 unknown recipe or existing destination."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    if args.command != "copy":
        print(listing())
        return 0
    try:
        target = copy_recipe(args.name, args.dest, force=args.force)
    except (RecipeNotFound, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"copied {_name_of(args.name)} to {target}; use it with --config {target}")
    return 0


if __name__ == "__main__":
    sys.exit(recipes_main())
