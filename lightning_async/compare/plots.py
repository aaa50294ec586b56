"""PNG curves: validation and training loss vs step, sync / async / async+EF (and each other correction) overlaid.

One colour per category (sync blue, async red, async+EF green, the other corrections their own), one
line style per seed. Diverged runs are drawn (up to their last finite point) with "(DIVERGED)" in the legend.

Uses matplotlib's Agg backend (no display needed). Writes, per tag, one PNG per optimizer
(``val_loss_<optimizer>.png``, ``train_loss_<optimizer>.png``) and a grid of all of them (``val_loss_grid.png``).
A tag with one point per run (a shortened run validates once) is drawn as dots; the training loss then shows the curves.
"""

from __future__ import annotations

import re
from pathlib import Path

from lightning_async.compare.events import ASYNC, ASYNC_EF, SYNC, VAL_LOSS
from lightning_async.compare.rows import Row
from lightning_async.identity import EF, KNOWN_CORRECTIONS, correction_category

STYLES = ("-", "--", ":", "-.")
_OTHER_COLORS = ("tab:olive", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:cyan")
COLORS = {
    SYNC: "tab:blue", ASYNC: "tab:red", ASYNC_EF: "tab:green",
    **{correction_category(c): color for c, color in zip([c for c in KNOWN_CORRECTIONS if c != EF], _OTHER_COLORS)},
}


def category_color(category: str) -> str:
    """The colour of a category's curves (grey for one without its own)."""
    return COLORS.get(category, "tab:gray")


def _shown(rows: list[Row]) -> list[str]:
    """The categories that have runs in ``rows``, in column order."""
    return [c for c in dict.fromkeys(c for r in rows for c in r.categories) if any(r.runs.get(c) for r in rows)]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_") or "run"


def _draw(ax, rows: list[Row], tag: str) -> bool:
    drawn = False
    seen_labels: set[str] = set()
    for row in rows:
        for category in row.categories:
            runs = sorted(row.runs.get(category, []), key=lambda r: (r.identity.seed is None, r.identity.seed or 0))
            for i, run in enumerate(runs):
                points = run.series(tag)
                if not points:
                    continue
                steps, values = zip(*points)
                label = category if len(rows) == 1 else f"{row.label}: {category}"
                if len(runs) > 1:
                    label += f" s{run.identity.seed}"
                if run.diverged:
                    label += " (DIVERGED)"
                ax.plot(
                    steps, values, color=category_color(category), linestyle=STYLES[i % len(STYLES)],
                    marker="o" if len(steps) < 30 else None, markersize=3, linewidth=1.4,
                    label=None if label in seen_labels else label,
                )
                seen_labels.add(label)
                drawn = True
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(tag)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def write_plots(rows: list[Row], output: Path, tag: str = VAL_LOSS) -> list[Path]:
    """One PNG per optimizer plus a grid; returns the files written (none if no run logged ``tag``)."""
    plt = _pyplot()
    output.mkdir(parents=True, exist_ok=True)
    optimizers = list(dict.fromkeys(r.optimizer for r in rows))
    written: list[Path] = []
    panels = []
    for optimizer in optimizers:
        group = [r for r in rows if r.optimizer == optimizer]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        if _draw(ax, group, tag):
            ax.set_title(f"{optimizer}: {tag} ({' / '.join(_shown(group))})")
            fig.tight_layout()
            path = output / f"{tag.replace('/', '_')}_{_safe(optimizer)}.png"
            fig.savefig(path, dpi=110)
            written.append(path)
            panels.append((optimizer, group))
        plt.close(fig)
    if len(panels) > 1:
        cols = min(3, len(panels))
        nrows = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
        for ax, (optimizer, group) in zip(axes.flat, panels):
            _draw(ax, group, tag)
            ax.set_title(optimizer)
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        legend = " / ".join(f"{c} ({category_color(c).removeprefix('tab:')})" for c in _shown(rows))
        fig.suptitle(f"{tag}: {legend}")
        fig.tight_layout()
        path = output / f"{tag.replace('/', '_')}_grid.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
