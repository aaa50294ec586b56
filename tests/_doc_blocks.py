"""The fenced blocks of README.md and docs/*.md, read the way tests/cli/test_docs.py runs them.

A block's kind comes from its info string and its first line:

* ``session``: any block whose first line starts with ``$ ``: commands, each followed by the output it prints;
* ``shell`` (``bash``, ``sh``, ``shell``, ``console``): one command per line (``\\`` continues a line, ``#`` starts a
  comment);
* ``python``: a script;
* ``yaml``: a recipe or study file (parsed, not run);
* ``text``: anything else (trees, tables, formulas, printed output): not run.

A marker comment on the line before the opening fence changes what happens to it:
``<!-- doc-test: skip (REASON) -->`` (not run, reported as skipped with the reason) or
``<!-- doc-test: definitions in PATH -->`` (a sketch: every ``class`` and ``def`` in it must exist in PATH, a file
of the repository, with the same parameters; PATH may add parameters with defaults).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<what>.*?)\s*-->")
SKIP = re.compile(r"^skip \((?P<reason>.+)\)$")
DEFINITIONS = re.compile(r"^definitions in (?P<path>\S+)$")
SHELL_INFO = {"bash", "sh", "shell", "console"}
DEFINITION = re.compile(r"^(?P<indent> *)(?:(?:async )?def (?P<def>\w+)\((?P<params>.*)|class (?P<class>\w+)\b)")


def documents() -> list[Path]:
    """README.md, then docs/*.md in name order: the order the test runs them in."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    text: str
    marker: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        if first.startswith("$ "):
            return "session"
        language = self.info.split()[0].lower() if self.info.strip() else ""
        if language in SHELL_INFO:
            return "shell"
        return language if language in ("python", "yaml") else "text"

    @property
    def skip_reason(self) -> str | None:
        match = SKIP.match(self.marker or "")
        return match["reason"] if match else None

    @property
    def definitions_file(self) -> Path | None:
        match = DEFINITIONS.match(self.marker or "")
        return REPO / match["path"] if match else None


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the ``doc-test`` marker of the line before it."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = i + 1
        while end < len(lines) and not re.match(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        marker = MARKER.search(lines[i - 1]) if i > 0 else None
        text = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[i + 1:end])
        blocks.append(Block(path, i + 1, opening["info"].strip(), text, marker["what"] if marker else None))
        i = end + 1
    return blocks


def strip_comment(line: str) -> str:
    """``line`` without a shell comment (a ``#`` at the start of a word, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def logical_lines(text: str) -> list[str]:
    """The lines of a shell text with ``\\`` continuations joined."""
    joined, pending = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            joined.append(pending + line)
            pending = ""
    if pending:
        joined.append(pending)
    return joined


def shell_commands(text: str) -> list[str]:
    """The commands of a ``shell`` block, without comments and blank lines."""
    commands = [strip_comment(line).strip() for line in logical_lines(text)]
    return [" ".join(command.split()) for command in commands if command]


def session_steps(text: str) -> list[tuple[str, list[str]]]:
    """The ``(command, expected output lines)`` of a ``session`` block; blank output lines are dropped."""
    steps: list[tuple[str, list[str]]] = []
    for line in logical_lines(text):
        if line.startswith("$ "):
            steps.append((" ".join(strip_comment(line[2:]).split()), []))
        elif line.strip() and steps:
            steps[-1][1].append(line.rstrip())
    return steps


# ---- sketches: definitions checked against the file they come from ---------------------------------
@dataclass(frozen=True)
class Definition:
    owner: str | None  # the enclosing class, None at the top level
    name: str
    params: tuple[str, ...] | None  # None for a class
    defaults: int = 0  # how many of the params have defaults


def _parameter_names(params: str) -> tuple[tuple[str, ...], int]:
    """The names in the text after a ``def``'s opening parenthesis, up to the one that closes it (annotations,
    defaults and ``*``/``/`` markers dropped), and how many have defaults."""
    depth, pieces, current = 0, [], ""
    for char in params:
        depth += char in "([{"
        depth -= char in ")]}"
        if depth < 0:
            break
        if char == "," and depth == 0:
            pieces.append(current)
            current = ""
        else:
            current += char
    pieces.append(current)
    names = [re.split(r"[:=]", piece)[0].strip().lstrip("*") for piece in pieces]
    return tuple(name for name in names if name and name != "/"), sum("=" in piece for piece in pieces)


def sketch_definitions(text: str) -> list[Definition]:
    """The classes and functions a (possibly incomplete) Python text defines, read line by line."""
    found, classes = [], []  # classes: (indent, name) of the enclosing classes
    for line in text.splitlines():
        match = DEFINITION.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        classes = [(i, name) for i, name in classes if i < indent]
        owner = classes[-1][1] if classes else None
        if match["class"]:
            found.append(Definition(owner, match["class"], None))
            classes.append((indent, match["class"]))
        else:
            names, defaults = _parameter_names(match["params"])
            found.append(Definition(owner, match["def"], names, defaults))
    return found


def file_definitions(path: Path) -> list[Definition]:
    """The classes and functions of a Python file, with their enclosing class."""
    found = []

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                found.append(Definition(owner, child.name, None))
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                every = [*args.posonlyargs, *args.args, *([args.vararg] if args.vararg else []), *args.kwonlyargs,
                         *([args.kwarg] if args.kwarg else [])]
                defaults = len(args.defaults) + sum(d is not None for d in args.kw_defaults)
                found.append(Definition(owner, child.name, tuple(a.arg for a in every), defaults))
                visit(child, owner)

    visit(ast.parse(path.read_text()), None)
    return found


def _matches(sketch: Definition, real: Definition) -> bool:
    if sketch.name != real.name or (sketch.params is None) != (real.params is None):
        return False
    if sketch.owner is not None and sketch.owner != real.owner:
        return False
    if sketch.params is None:
        return True
    extra = len(real.params) - len(sketch.params)
    return real.params[:len(sketch.params)] == sketch.params and 0 <= extra <= real.defaults


def definition_mismatches(text: str, path: Path) -> list[str]:
    """Each class or ``def`` of ``text`` that ``path`` does not define with the same parameters."""
    real = file_definitions(path)
    problems = []
    for sketch in sketch_definitions(text):
        if not any(_matches(sketch, candidate) for candidate in real):
            what = f"class {sketch.name}" if sketch.params is None else f"def {sketch.name}({', '.join(sketch.params)})"
            where = f" in class {sketch.owner}" if sketch.owner else ""
            same_name = [d for d in real if d.name == sketch.name]
            found = "; it has " + ", ".join(f"{d.owner or ''}.{d.name}{d.params or ''}" for d in same_name) if same_name else ""
            problems.append(f"{what}{where} is not in {path.relative_to(REPO)}{found}")
    return problems
