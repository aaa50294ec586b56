"""The package's modules import one way: no import circle anywhere in ``lightning_async``, counting
imports inside functions (a lazy import is still an arrow). ``lm -> models``, ``strategies -> callbacks ->
pipeline -> optim``, ``tools -> compare -> identity`` (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_async"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from a.b import c`` counts ``a.b`` and ``a.b.c`` when those are
    modules: importing a module runs its packages' ``__init__``). The top-level package is left out: every import
    passes through its ``__init__`` (the public facade), so counting it would join every module into one circle."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for full in found:
                parts = full.split(".")
                targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & set(modules)
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # loaded before it anyway
        graph[name] = targets - {name} - own_packages
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_sees_a_lazy_import_circle():
    graph = {"p.lm": {"p.models"}, "p.models": {"p.models.hf"}, "p.models.hf": {"p.lm"}, "p.other": set()}
    assert cycles(graph) == [{"p.lm", "p.models", "p.models.hf"}]


def test_no_import_circle_through_lm_or_models():
    graph = import_graph()
    assert "lightning_async.lm" in graph["lightning_async.training_cli"]  # the graph is read (a sanity check)
    ours = [c for c in cycles(graph) if any(m == "lightning_async.lm" or m.startswith("lightning_async.models") for m in c)]
    assert ours == []


def test_no_import_circle_anywhere_in_the_package():
    graph = import_graph()
    assert "lightning_async.callbacks.delay" in graph["lightning_async.strategies.async_pipe"]  # the graph is read
    assert cycles(graph) == []


def test_the_strategy_is_one_class_under_both_names():
    from lightning_async import AsyncPipelineStrategy as top_level
    from lightning_async.strategies import AsyncPipelineStrategy, AsyncPipelineStrategy

    assert AsyncPipelineStrategy is AsyncPipelineStrategy and top_level is AsyncPipelineStrategy


def test_the_aliases_kept_for_one_release_are_gone_in_0_2():
    """The names that 0.2.0 renamed or moved are gone (CHANGELOG.md, "Migrating from 0.1"): importing
    one fails instead of reaching the new object."""
    import importlib.util

    from lightning_async.pipeline import memory, stage, timeline, timing

    assert importlib.util.find_spec("lightning_async.optim.schedules") is None  # optim.lr_schedules
    assert importlib.util.find_spec("lightning_async.deprecated_cli") is None  # the CLI's error_feedback: section
    assert not hasattr(stage, "StageModule") and hasattr(stage, "PieceModule")
    for old in ("simulate", "simulate_lists", "SimResult", "WEIGHT_GRAD_SHARE", "peak_activation_bytes",
                "schedule_memory", "render_timeline"):
        assert not hasattr(timing, old), old
    moved = ["WEIGHT_GRAD_SHARE", "inflight_and_versions", "peak_activation_bytes", "schedule_memory"]
    assert all(hasattr(memory, name) for name in moved) and hasattr(timeline, "render_timeline")
    assert set(timing.__all__) == {"DeadlockError", "ScheduleTiming", "predict", "time_action_lists", "time_schedule"}
