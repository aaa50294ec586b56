"""The run matrix of a study: optimizers x lrs x modes (x delays x EF strengths x lengths) x seeds, and each run's command."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lightning_async.tools.study.spec import MODES, RunSpec, StudyError, StudyMode, study_mode

DEFAULT_EF_STRENGTH_KEY = "correction.strength"  # (the delayed-ef mode's correction is method ef)
DEFAULT_DELAY_KEY = "delay.delay"


def validation_interval(max_steps: int, evaluations: int = 5) -> int:
    """Smallest divisor of ``max_steps`` giving at most ``evaluations`` validations; the last lands on the final step."""
    for interval in range(max(1, -(-max_steps // evaluations)), max_steps + 1):
        if max_steps % interval == 0:
            return interval
    return max_steps


def default_launcher() -> list[str]:
    """This environment's ``lightning-async`` (by name when it is also the one on the PATH, else by its path:
    runs never use another installation's), or ``python -m lightning_async.cli`` when it has none."""
    mine = Path(sys.executable).with_name("lightning-async")
    if not mine.is_file():
        return [sys.executable, "-m", "lightning_async.cli"]
    on_path = shutil.which("lightning-async")
    return ["lightning-async"] if on_path and Path(on_path).samefile(mine) else [str(mine)]


def _fmt_lr(lr: float) -> str:
    return f"{lr:g}"


@dataclass
class Study:
    """A parsed, validated study."""

    name: str
    base: list[str]
    optimizers: list[str | None]
    modes: list[str]
    lrs: dict[str | None, list[float | None]] = field(default_factory=dict)
    seeds: list[int | None] = field(default_factory=lambda: [0])
    max_steps: int | None = None
    lengths: list[int] | None = None  # an ablation of max_steps (each run once per value)
    output: Path = Path("studies/study")
    overrides: list[str] = field(default_factory=list)
    ef_strengths: list[float] | None = None
    delays: list[int] | None = None
    ef_strength_key: str = DEFAULT_EF_STRENGTH_KEY
    delay_key: str = DEFAULT_DELAY_KEY
    launcher: list[str] | None = None
    optimizer_recipes: str | None = None
    extra_configs: list[str] = field(default_factory=list)
    recipes_dir: Path | None = None
    description: str = ""
    jobs: int = 1  # runs trained at the same time (--jobs)

    @property
    def runs_dir(self) -> Path:
        return self.output / "runs"

    @property
    def logs_dir(self) -> Path:
        return self.output / "logs"

    @property
    def compare_dir(self) -> Path:
        return self.output / "compare"

    # ---- matrix -----------------------------------------------------------------------------
    def recipe(self, relative: str) -> Path | None:
        if self.recipes_dir is None:
            return None
        path = self.recipes_dir / relative
        return path if path.is_file() else None

    def mode_info(self, mode: str) -> StudyMode:
        return study_mode(mode, self.recipes_dir) or MODES[mode]

    def mode_recipes(self, mode: str) -> list[Path]:
        return [self.recipe(rel) or (self.recipes_dir or Path("recipes")) / rel for rel in self.mode_info(mode).recipes]

    def missing_files(self) -> list[str]:
        missing = [b for b in self.base + self.extra_configs if not Path(b).is_file()]
        missing += [str(r) for m in self.modes for r in self.mode_recipes(m) if not r.is_file()]
        return missing

    def run_name(self, optimizer, mode, lr, seed, ef_strength, delay, steps=None) -> str:
        parts = [optimizer] if optimizer else []
        parts.append(mode)
        if steps is not None and self.lengths is not None and len(self.lengths) > 1:
            parts.append(f"n{steps}")
        if delay is not None and self.delays is not None and len(self.delays) > 1:
            parts.append(f"d{delay}")
        if ef_strength is not None and self.ef_strengths is not None and len(self.ef_strengths) > 1:
            parts.append(f"ef{ef_strength:g}")
        if lr is not None:
            parts.append(f"lr{_fmt_lr(lr)}")
        parts.append(f"s{seed}" if seed is not None else "snone")
        return "-".join(parts)

    def command(self, optimizer, mode, lr, seed, ef_strength, delay, name, steps=None) -> list[str]:
        cmd = list(self.launcher or default_launcher()) + ["fit"]
        for config in self.base:
            cmd += ["--config", str(config)]
        if optimizer:
            for folder in ["optimizers"] + ([self.optimizer_recipes] if self.optimizer_recipes else []):
                opt_recipe = self.recipe(f"{folder}/{optimizer}.yaml")
                if opt_recipe is not None:
                    cmd += ["--config", str(opt_recipe)]
        for recipe in self.mode_recipes(mode):
            cmd += ["--config", str(recipe)]
        for config in self.extra_configs:
            cmd += ["--config", str(config)]
        if seed is not None:
            cmd += ["--seed_everything", str(seed)]
        if optimizer:
            cmd += ["--model.optimizer", optimizer]
        if lr is not None:
            cmd += ["--model.lr", _fmt_lr(lr)]
        if delay is not None:
            cmd += [f"--{self.delay_key}", str(delay)]
        if ef_strength is not None:
            cmd += [f"--{self.ef_strength_key}", f"{ef_strength:g}"]
        if steps is not None:
            cmd += ["--trainer.max_steps", str(steps)]
            cmd += ["--trainer.val_check_interval", str(validation_interval(steps))]
        cmd += [
            "--trainer.logger.init_args.save_dir", str(self.output),
            "--trainer.logger.init_args.name", "runs",
            "--trainer.logger.init_args.version", name,
        ]
        return cmd + list(self.overrides)

    def expand(self) -> list[RunSpec]:
        """Every run of the matrix, seeds outermost (so a partial study has whole seeds)."""
        specs: list[RunSpec] = []
        for seed, steps in ((seed, steps) for seed in self.seeds for steps in (self.lengths or [self.max_steps])):
            for optimizer in self.optimizers:
                for lr in self.lrs.get(optimizer, self.lrs.get(None, [None])):
                    for mode in self.modes:
                        delayed = self.mode_info(mode).logged == "delayed"
                        delays = self.delays if (self.delays is not None and delayed) else [None]
                        efs = self.ef_strengths if (self.ef_strengths is not None and mode == "delayed-ef") else [None]
                        for delay in delays:
                            for ef in efs:
                                name = self.run_name(optimizer, mode, lr, seed, ef, delay, steps)
                                specs.append(RunSpec(
                                    name=name, optimizer=optimizer, mode=mode, lr=lr, seed=seed, ef_strength=ef,
                                    delay=delay, run_dir=self.runs_dir / name, log_path=self.logs_dir / f"{name}.log",
                                    command=self.command(optimizer, mode, lr, seed, ef, delay, name, steps),
                                    max_steps=steps, mode_info=self.mode_info(mode),
                                ))
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise StudyError(f"study {self.name}: duplicate run names {duplicates} (repeated optimizer/lr/seed?)")
        return specs
