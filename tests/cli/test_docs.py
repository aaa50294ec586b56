"""Every command and snippet of README.md and docs/*.md, run as written: docs that drift fail here.

What happens to a fenced block (``tests/_doc_blocks.py`` reads them; one test per block, ``README.md:34``):

* ``bash``/``sh`` blocks: each command runs in bash and must exit 0; ``$ `` blocks (any info string): each
  ``$`` command must exit 0 and print the lines under it, exactly and in that order (other lines may come between);
* ``python`` blocks: each runs as a script file in its own process (``tests/_doc_snippet.py``; a file, because a
  pipeline snippet with ``devices=2`` is re-executed by Lightning on its other rank) and must exit 0;
* ``yaml`` blocks must parse; ``<!-- doc-test: definitions in PATH -->`` sketches (the contract, excerpts of tested
  examples) must define only what PATH defines, with the same parameters;
* plain blocks are text, not run; one that holds ``lightning-async`` commands fails (label it ``bash``), one that
  holds other commands (benchmarks: minutes of measurement) is reported as skipped;
* ``<!-- doc-test: skip (REASON) -->`` before a fence: not run, reported as skipped with the reason. Used only for
  what cannot run here: GPUs, the ``../shared`` corpora a fresh clone lacks, templates with your own paths.

No output ``terminate called ...`` (a process aborted at exit) is accepted from anything.

**As a user does.** All documents run, README.md first and then docs/ by name, each block in document order, in
one temporary working copy (``runs/``, ``studies/``, ``.cache/`` shared: a fit followed by ``lightning-async export
runs/...`` works as written). Recipes resolve by name from the installed package. Files the docs treat as your own
are placeholders made there: ``my_recipe.yaml`` and ``my_model.yaml`` (the quick start's recipe), ``my_data.yaml``
(a ``text`` source over ``my_corpus.txt``, standard-library sources), ``path/to/smollm2-135m`` and
``path/to/model_dir`` (a tiny random Llama saved with ``save_pretrained``) and ``path/to/config.json`` (its config).
``pip install`` is not run (the suite runs in the installed package); the extras it names must exist in setup.cfg.
A command run before (the same text, e.g. the quick start in README.md and docs/quickstart.md) is not run again:
its result (exit status and output) is reused. Running one block alone (``-k "models.md:120"``) first runs the
blocks before it in its document.

**Shortened by one rule** (``lightning_async/run_limits.py``): ``LIGHTNING_ASYNC_MAX_STEPS=2`` makes every
Trainer of every command (``fit``, the runs of ``study`` and ``probe``, every pipeline rank) and of every Python
snippet train 2 steps and validate once; ``LIGHTNING_ASYNC_MAX_RUNS=2`` makes a ``study`` or ``probe`` train the
first 2 runs of its matrix (seed 0: sync and delayed of the first optimizer).

**Fast** (the suite's CI has 2 cores): a command that the documents repeat runs once (above); ``lightning-async
ARGS`` (no shell syntax) and the Python snippets run in a child forked from ``tests/_doc_server.py``, which has
imported ``lightning_async.cli`` once (the import is ~7 s of CPU, more than a 2-step fit); the child runs the console
script's ``main`` with the same ``sys.argv``, working directory and environment and exits as a user's process does.
Processes the commands start themselves (a study's runs, a pipeline's other ranks) are ordinary new processes.
Every process gets ``OMP_NUM_THREADS=1`` (tiny models: one thread is fastest, and a busy machine's
oversubscription slowed a 2-step fit several times over).
The seconds of every command are written to ``doc-commands.tsv`` in the working copy (``--basetemp`` to keep it).

Our own extractor rather than Sybil, pytest-examples or mktestdocs: those run Python examples in the test
process; here every block is a subprocess in a shared working copy (shell commands with their printed output,
scripts that Lightning re-executes on other ranks), and sketches are checked against the files they come from.
With Sybil that would be a custom parser and evaluator for every kind of block, i.e. this code plus a dependency.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from _doc_blocks import (
    REPO,
    Block,
    definition_mismatches,
    documents,
    read_blocks,
    session_steps,
    shell_commands,
)

from lightning_async.run_limits import MAX_RUNS_VARIABLE, MAX_STEPS_VARIABLE

pytestmark = pytest.mark.slow  # about 40 commands and snippets, each a process

MAX_STEPS, MAX_RUNS = 2, 2
TIMEOUT_S = 1800  # one command, on a loaded 2-core machine
DOC_SERVER = Path(__file__).resolve().parents[1] / "_doc_server.py"
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
SHELL_SYNTAX = re.compile(r"[;&|<>$`*?~(){}\[\]\\]")  # (outside quotes) a command that needs bash
ABORT = "terminate called"  # a process that aborted (std::terminate) at exit, even if the command exited 0
COMMAND_LINE = re.compile(r"^(\w+=\S* )*(python3?|bash|torchrun|srun|lightning-async|pip) ")
PIPELINE_EXAMPLE_MODEL = {  # the stand-in for a downloaded model directory: a tiny Llama (vocab >= 257 bytes)
    "model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
}


# ---- what each block is --------------------------------------------------------------------------
ALL_BLOCKS = [block for path in documents() for block in read_blocks(path)]


def plain_commands(block: Block) -> list[str]:
    return [line for line in block.text.splitlines() if COMMAND_LINE.match(line.strip())]


def what_to_do(block: Block) -> str | None:
    """``run``, ``parse``, ``definitions``, ``skip``, ``plain-commands`` or None (text: nothing to test)."""
    if block.skip_reason:
        return "skip"
    if block.definitions_file:
        return "definitions"
    if block.kind in ("shell", "session", "python"):
        return "run"
    if block.kind == "yaml":
        return "parse"
    return "plain-commands" if plain_commands(block) else None


def block_params():
    return [pytest.param(block, id=block.where) for block in ALL_BLOCKS if what_to_do(block) is not None]


# ---- the working copy ----------------------------------------------------------------------------
@dataclass
class Outcome:
    returncode: int
    output: str
    seconds: float
    where: str  # the block that ran it first

    def problem(self, command: str) -> str | None:
        if self.returncode != 0:
            return f"`{command}` exited {self.returncode} (run at {self.where}); its output ends:\n{self.output[-3000:]}"
        if ABORT in self.output:
            before = self.output[:self.output.index(ABORT)].splitlines()[-20:]
            return (f"`{command}` printed {ABORT!r} (a process aborted at exit; run at {self.where}); the lines before "
                    "it and the message:\n" + "\n".join(before) + "\n" + self.output[self.output.index(ABORT):][:500])
        return None


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines not found, in order, among the lines of ``output`` (compared without trailing spaces)."""
    lines, position, missing = [line.rstrip() for line in output.splitlines()], 0, []
    for line in expected:
        try:
            position = lines.index(line, position) + 1
        except ValueError:
            missing.append(line)
    return missing


def extras_problems(command: str) -> list[str]:
    """``pip install -e ".[a,b]"`` is not run; the extras it names must be in setup.cfg."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    known = set(config["options.extras_require"])
    problems = []
    for target in shlex.split(command)[2:]:
        extras = re.search(r"\[(.*)\]", target)
        for extra in extras[1].split(",") if extras else []:
            if extra.strip() not in known:
                problems.append(f"`{command}`: setup.cfg has no extra {extra.strip()!r} (it has {sorted(known)})")
    return problems


@dataclass
class WorkingCopy:
    """One user's working directory: every document's blocks run here, in order."""

    root: Path
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    results: dict[str, list[str]] = field(default_factory=dict)  # block -> its problems
    seconds: dict[str, float] = field(default_factory=dict)
    server: subprocess.Popen | None = None  # tests/_doc_server.py, once started

    def __post_init__(self) -> None:
        quickstart = (REPO / "recipes/quickstart.yaml").read_text()
        self.write("my_recipe.yaml", "# stands for your recipe: the quick start's\n" + quickstart)
        self.write("my_model.yaml", "# stands for your model recipe: the quick start's\n" + quickstart)
        self.write("my_data.yaml", "# stands for your data: a text file\n"
                   "data:\n  source: text\n  path: my_corpus.txt\n  seq_len: 128\n  batch_size: 16\n")
        self.write("my_corpus.txt", corpus_text(400_000))
        self.environment = {
            **{k: v for k, v in os.environ.items() if k != "LIGHTNING_ASYNC_TRACEBACK"},
            MAX_STEPS_VARIABLE: str(MAX_STEPS), MAX_RUNS_VARIABLE: str(MAX_RUNS),
            "PATH": os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",  # tiny models: one thread per process is fastest and immune to oversubscription
        }

    def write(self, name: str, text: str) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def model_directories(self) -> None:
        """``path/to/smollm2-135m``, ``path/to/model_dir`` and ``path/to/config.json``: a tiny random Llama."""
        if (self.root / "path/to/model_dir").is_dir():
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**PIPELINE_EXAMPLE_MODEL)
        model = AutoModelForCausalLM.from_config(config)
        for name in ("smollm2-135m", "model_dir"):
            model.save_pretrained(self.root / "path/to" / name)
        config.to_json_file(self.root / "path/to/config.json")

    def execute(self, argv: list[str]) -> tuple[int, str]:
        proc = subprocess.run(argv, cwd=self.root, env=self.environment, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
        return proc.returncode, proc.stdout

    def forked(self, entry: str, args: list[str]) -> tuple[int, str]:
        """``(exit status, output)`` of ``lightning-async ARGS`` (``entry="cli"``) or of a snippet
        (``"snippet"``), run by the warm interpreter of ``tests/_doc_server.py`` (started on first use)."""
        if self.server is None:
            self.server = subprocess.Popen([sys.executable, str(DOC_SERVER)], cwd=self.root, env=self.environment,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # (unbuffered: select sees every reply)
        output = self.root / ".doc-output.txt"
        self.server.stdin.write(json.dumps({"entry": entry, "args": args, "output": str(output)}).encode() + b"\n")
        pid = self.reply("pid", TIMEOUT_S)
        try:
            returncode = self.reply("returncode", TIMEOUT_S)
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            returncode = self.reply("returncode", 60)
        return returncode, output.read_text(errors="replace")

    def reply(self, key: str, timeout: float) -> int:
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no {key} from tests/_doc_server.py within {timeout} s")
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/_doc_server.py exited ({self.server.wait()}) before replying")
        return json.loads(line)[key]

    def close(self) -> None:
        slowest = sorted(self.outcomes.items(), key=lambda item: -item[1].seconds)
        self.write("doc-commands.tsv", "".join(f"{o.seconds:.1f}\t{o.where}\t{c}\n" for c, o in slowest))
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(timeout=60)

    def command(self, command: str, where: str) -> Outcome:
        """The outcome of a shell command, run once per working copy: ``lightning-async ARGS`` without shell syntax
        in the warm interpreter (the same ``main``, argv, environment and exit), anything else in bash."""
        if command not in self.outcomes:
            start = time.perf_counter()
            args = shlex.split(command)
            if args[0] == "lightning-async" and not SHELL_SYNTAX.search(QUOTED.sub("", command)):
                returncode, output = self.forked("cli", args[1:])
            else:
                returncode, output = self.execute(["bash", "-c", command])
            self.outcomes[command] = Outcome(returncode, output, time.perf_counter() - start, where)
        return self.outcomes[command]

    def prepared(self, command: str) -> tuple[str | None, list[str], str | None]:
        """``(what to run, problems, why nothing runs)``: ``pip install`` parts are checked, not run."""
        problems, kept = [], []
        for part in command.split(" && "):
            if part.startswith("pip install"):
                problems += extras_problems(part)
            else:
                kept.append(part)
        if any(part.startswith(("python -m pytest", "pytest")) for part in kept):
            return None, problems, "the test suite itself, which this test is part of"
        return (" && ".join(kept) or None), problems, ("only `pip install`" if not kept else None)

    def run_block(self, block: Block) -> tuple[list[str], str | None]:
        """``(problems, why nothing ran)`` of one block; the reason is ``None`` when something ran."""
        if "path/to/" in block.text:
            self.model_directories()
        if block.kind == "python":
            snippet = self.root / ".doc-snippets" / f"{block.path.stem}_{block.line}.py"
            snippet.parent.mkdir(exist_ok=True)
            snippet.write_text(block.text + "\n")
            start = time.perf_counter()
            returncode, output = self.forked("snippet", [str(snippet)])
            problem = Outcome(returncode, output, time.perf_counter() - start, block.where).problem(f"python {block.where}")
            return [problem] if problem else [], None
        problems, not_run = [], []
        steps = session_steps(block.text) if block.kind == "session" else [(c, []) for c in shell_commands(block.text)]
        for written, expected in steps:
            command, pip_problems, why = self.prepared(written)
            problems += pip_problems
            if command is None:
                not_run.append(f"`{written}` not run: {why}")
                continue
            outcome = self.command(command, block.where)
            problem = outcome.problem(command)
            if problem:
                problems.append(problem)
            elif expected:
                problems += [f"`{command}` did not print (in this order): {line!r}"
                             for line in missing_lines(expected, outcome.output)]
        return problems, ("; ".join(not_run) if len(not_run) == len(steps) else None)

    def run_through(self, block: Block) -> tuple[list[str], str | None]:
        """Run the blocks of ``block``'s document up to it that did not run yet; ``block``'s ``run_block`` result
        (with a problem added when an earlier block of the document failed)."""
        earlier_failures = []
        for earlier in read_blocks(block.path):
            if earlier.line > block.line:
                break
            if what_to_do(earlier) != "run":
                continue
            if earlier.where not in self.results:
                start = time.perf_counter()
                self.results[earlier.where] = self.run_block(earlier)
                self.seconds[earlier.where] = time.perf_counter() - start
            if earlier.line < block.line and self.results[earlier.where][0]:
                earlier_failures.append(earlier.where)
        problems, not_run = self.results[block.where]
        if problems and earlier_failures:
            problems = problems + [f"(earlier blocks of the document failed too: {', '.join(earlier_failures)})"]
        return problems, not_run


def corpus_text(size: int) -> str:
    """About ``size`` characters of this interpreter's standard-library sources (deterministic)."""
    stdlib, text = Path(sysconfig.get_paths()["stdlib"]), []
    for path in sorted(stdlib.glob("*.py")):
        text.append(path.read_text(errors="replace"))
        if sum(map(len, text)) >= size:
            break
    return "\n".join(text)[:size]


@pytest.fixture(scope="module")
def working_copy(tmp_path_factory):
    copy = WorkingCopy(tmp_path_factory.mktemp("working-copy"))
    yield copy
    copy.close()


# ---- the tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", block_params())
def test_block(block: Block, request) -> None:
    action = what_to_do(block)
    if action == "skip":
        pytest.skip(f"{block.where}: {block.skip_reason}")
    if action == "plain-commands":
        lines = plain_commands(block)
        cli = [line for line in lines if "lightning-async" in line]
        assert not cli, f"{block.where}: commands in a plain block, label it ```bash (or give a skip marker): {cli}"
        pytest.skip(f"{block.where}: benchmark commands in a plain block, not run: {lines[0].strip()}")
    if action == "parse":
        assert isinstance(yaml.safe_load(block.text), dict), f"{block.where}: not a YAML mapping"
        return
    if action == "definitions":
        assert block.definitions_file.is_file(), f"{block.where}: no file {block.definitions_file}"
        assert not definition_mismatches(block.text, block.definitions_file), definition_mismatches(
            block.text, block.definitions_file)
        return
    problems, not_run = request.getfixturevalue("working_copy").run_through(block)
    assert not problems, f"{block.where}:\n" + "\n".join(problems)
    if not_run:
        pytest.skip(f"{block.where}: {not_run}")


def test_every_marker_stands_before_a_fence_and_says_what_to_do() -> None:
    """A marker that is misspelt, or not right above a fence, would silently do nothing."""
    bad = []
    for path in documents():
        lines = path.read_text().splitlines()
        starts = {block.line for block in read_blocks(path)}
        for number, line in enumerate(lines, 1):
            if not (line.strip().startswith("<!--") and "doc-test" in line):
                continue
            block = next((b for b in read_blocks(path) if b.line == number + 1), None)
            if number + 1 not in starts or block is None or not (block.skip_reason or block.definitions_file):
                bad.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not bad, "markers must be `<!-- doc-test: skip (REASON) -->` or `<!-- doc-test: definitions in PATH -->` " \
                    "on the line before a fence:\n" + "\n".join(bad)
