"""Reading a study: the YAML file (or shipped study by name), its validation, and ``--set`` overrides."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_async.recipes_index import find_recipe, recipes_root
from lightning_async.tools.study.matrix import DEFAULT_DELAY_KEY, DEFAULT_EF_STRENGTH_KEY, Study
from lightning_async.tools.study.spec import CATEGORY_MODES, StudyError, study_mode, valid_modes

STUDY_KEYS = (
    "name", "description", "base", "optimizers", "modes", "lrs", "seeds", "max_steps", "output", "overrides",
    "ef_strengths", "delays", "ef_strength_key", "delay_key", "launcher", "optimizer_recipes", "jobs", "lengths",
)


def valid_optimizers(recipes_dir: Path | None = None) -> list[str]:
    """Known optimizers: the zoo's names and any ``recipes/optimizers/*.yaml``."""
    from lightning_async.optim import OPTIMIZER_NAMES  # here: the zoo imports torch, parsing a study does not

    names = set(OPTIMIZER_NAMES)
    recipes_dir = recipes_dir or find_recipes_dir()
    if recipes_dir is not None and (recipes_dir / "optimizers").is_dir():
        names.update(p.stem for p in (recipes_dir / "optimizers").glob("*.yaml"))
    return sorted(names)


def find_recipes_dir() -> Path:
    """The shipped recipes (:func:`~lightning_async.recipes_index.recipes_root`), relative to the current
    directory when they are below it (``recipes`` in the repository root), so commands stay short."""
    root = recipes_root()
    try:
        return root.relative_to(Path.cwd())
    except ValueError:
        return root


def _as_list(value: Any, what: str) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (str, int, float)):
        return [value]
    raise StudyError(f"{what}: expected a list, got {type(value).__name__}")


def _floats(values: Any, what: str) -> list[float]:
    out = []
    for v in _as_list(values, what):
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            raise StudyError(f"{what}: {v!r} is not a number") from None
    return out


def _resolve_file(raw: str, study_dir: Path | None, recipes_dir: Path | None = None) -> str:
    """A recipe path as given if it exists (relative to the cwd), else next to the study file, else the
    shipped recipe of that name (``quickstart`` or ``recipes/quickstart.yaml``); unchanged if none exists."""
    path = Path(raw).expanduser()
    if path.is_absolute() or path.exists():
        return str(path)
    if study_dir is not None and (study_dir / path).exists():
        return str(study_dir / path)
    found = find_recipe(raw, recipes_dir)
    return str(found) if found is not None else str(path)


def _overrides(value: Any, what: str = "overrides") -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"--{str(k).lstrip('-')}={_scalar(v)}" for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    if isinstance(value, str):
        return shlex.split(value)
    raise StudyError(f"{what}: expected a list of CLI args or a mapping key: value")


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def parse_set(items: Sequence[str]) -> list[str]:
    """``key=value`` pairs from ``--set`` as CLI args ``--key=value``."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StudyError(f"--set {item!r}: expected key=value (e.g. --set data.path=corpus.txt)")
        out.append(f"--{key.strip().lstrip('-')}={value}")
    return out


def add_jobs_argument(parser) -> None:
    """``--jobs N`` (study and probe): runs trained at the same time."""
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="train up to N runs at the same time (default: a study file's jobs, else 1); each gets "
                        "OMP_NUM_THREADS = cores // N unless OMP_NUM_THREADS is set")


def check_jobs(value: Any, what: str = "--jobs") -> int:
    """``value`` as a number of runs at the same time (a positive integer), else :class:`StudyError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StudyError(f"{what} must be a positive integer (runs trained at the same time), got {value!r}")
    return value


def study_from_dict(
    data: dict[str, Any], *, name: str = "study", study_dir: Path | None = None, recipes_dir: Path | None = None
) -> Study:
    """Validate a study mapping (unknown optimizer/mode/key -> :class:`StudyError` listing valid ones)."""
    if not isinstance(data, dict):
        raise StudyError("a study file must be a mapping (base, optimizers, modes, ...)")
    unknown = sorted(set(data) - set(STUDY_KEYS))
    if unknown:
        raise StudyError(f"unknown study key(s) {', '.join(unknown)}; valid keys: {', '.join(STUDY_KEYS)}")
    recipes_dir = recipes_dir or find_recipes_dir()
    name = str(data.get("name") or name)

    optimizers = [str(o) for o in _as_list(data.get("optimizers"), "optimizers")]
    if not optimizers:
        raise StudyError(f"study {name}: 'optimizers' is empty; valid: {', '.join(valid_optimizers(recipes_dir))}")
    valid = valid_optimizers(recipes_dir)
    bad = [o for o in optimizers if o not in valid]
    if bad:
        raise StudyError(f"study {name}: unknown optimizer(s) {', '.join(bad)}; valid optimizers: {', '.join(valid)}")

    modes = [str(m) for m in _as_list(data.get("modes", list(CATEGORY_MODES)), "modes")]
    bad = [m for m in modes if study_mode(m, recipes_dir) is None]
    if bad:
        raise StudyError(f"study {name}: unknown mode(s) {', '.join(bad)}; valid modes: {', '.join(valid_modes(recipes_dir))}")
    if not modes:
        raise StudyError(f"study {name}: 'modes' is empty; valid modes: {', '.join(valid_modes(recipes_dir))}")

    raw_lrs = data.get("lrs")
    lrs: dict[str | None, list[float | None]] = {}
    if isinstance(raw_lrs, dict):
        bad = [k for k in raw_lrs if k not in optimizers]
        if bad:
            raise StudyError(f"study {name}: lrs given for {', '.join(map(str, bad))}, not in optimizers {optimizers}")
        lrs = {str(k): _floats(v, f"lrs.{k}") or [None] for k, v in raw_lrs.items()}
    elif raw_lrs is not None:
        lrs = {None: _floats(raw_lrs, "lrs") or [None]}

    raw_seeds = data.get("seeds", [0])
    if isinstance(raw_seeds, int) and not isinstance(raw_seeds, bool):
        if raw_seeds < 1:
            raise StudyError(f"study {name}: seeds: {raw_seeds} (an int N means seeds 0..N-1; N >= 1)")
        seeds: list[int | None] = list(range(raw_seeds))
    else:
        seeds = []
        for s in _as_list(raw_seeds, "seeds"):
            if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
                raise StudyError(f"study {name}: seed {s!r} is not an integer")
            seeds.append(s)
        seeds = seeds or [0]
    if len(set(seeds)) != len(seeds):
        raise StudyError(f"study {name}: repeated seeds {seeds}")

    max_steps = data.get("max_steps")
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1):
        raise StudyError(f"study {name}: max_steps must be a positive integer, got {max_steps!r}")
    jobs = 1 if data.get("jobs") is None else check_jobs(data["jobs"], f"study {name}: jobs")

    ef_strengths = _floats(data["ef_strengths"], "ef_strengths") if data.get("ef_strengths") is not None else None
    if ef_strengths is not None and any(e <= 0 for e in ef_strengths):
        raise StudyError(f"study {name}: ef_strengths must be > 0 (the sync/delayed modes cover EF off)")
    lengths = None
    if data.get("lengths") is not None:
        lengths = [int(n) for n in _floats(data["lengths"], "lengths")]
        if not lengths or any(n < 1 for n in lengths) or len(set(lengths)) != len(lengths):
            raise StudyError(f"study {name}: lengths must be distinct positive step counts, got {data['lengths']!r}")
        if max_steps is not None:
            raise StudyError(f"study {name}: give max_steps (one length) or lengths (an ablation), not both")
    delays = None
    if data.get("delays") is not None:
        delays = [int(d) for d in _floats(data["delays"], "delays")]
        if any(d < 1 for d in delays):
            raise StudyError(f"study {name}: delays must be >= 1 (sync covers delay 0)")

    base = [_resolve_file(str(b), study_dir, recipes_dir) for b in _as_list(data.get("base"), "base")]
    optimizer_recipes = data.get("optimizer_recipes")
    if optimizer_recipes is not None and not (recipes_dir is not None and (recipes_dir / str(optimizer_recipes)).is_dir()):
        raise StudyError(f"study {name}: optimizer_recipes: {optimizer_recipes!r} is not a folder of the shipped "
                         f"recipes ({recipes_dir})")
    launcher = data.get("launcher")
    if launcher is not None:
        launcher = shlex.split(launcher) if isinstance(launcher, str) else [str(x) for x in launcher]
    return Study(
        name=name,
        description=str(data.get("description") or ""),
        base=base,
        optimizers=list(optimizers),
        modes=modes,
        lrs=lrs,
        seeds=seeds,
        max_steps=max_steps,
        lengths=lengths,
        output=Path(data.get("output") or Path("studies") / name),
        overrides=_overrides(data.get("overrides")),
        ef_strengths=ef_strengths,
        delays=delays,
        ef_strength_key=str(data.get("ef_strength_key") or DEFAULT_EF_STRENGTH_KEY),
        delay_key=str(data.get("delay_key") or DEFAULT_DELAY_KEY),
        launcher=launcher,
        optimizer_recipes=None if optimizer_recipes is None else str(optimizer_recipes),
        recipes_dir=recipes_dir,
        jobs=jobs,
    )


def find_study_file(raw: str | os.PathLike, recipes_dir: Path | None = None) -> Path:
    """The study file ``raw``: a path, else a shipped study by name (``quickstart``, ``study/quickstart`` or
    ``recipes/study/quickstart.yaml``)."""
    path = Path(raw).expanduser()
    if path.is_file():
        return path
    found = find_recipe(f"study/{raw}", recipes_dir) or find_recipe(str(raw), recipes_dir)
    if found is None:
        raise StudyError(f"study file {raw} not found, and no shipped study of that name "
                         "(`lightning-async recipes` lists them under study/)")
    return found


def load_study(path: str | os.PathLike, *, recipes_dir: Path | None = None) -> Study:
    """The study of the file (or shipped study name) ``path``; recipes it names resolve next to it or by name."""
    path = find_study_file(path, recipes_dir)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise StudyError(f"study file {path}: not valid YAML: {err}") from None
    return study_from_dict(data, name=path.stem, study_dir=path.parent, recipes_dir=recipes_dir)
