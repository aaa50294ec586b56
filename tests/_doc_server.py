"""A warm interpreter for tests/cli/test_docs.py: ``python tests/_doc_server.py`` (started by the test, one per run).

Importing ``lightning_async.cli`` (torch, Lightning, torchmetrics, transformers) costs about 7 s of CPU, more than a
2-step fit itself, and the documentation has some 40 commands. This process imports it once; each request forks a
child that runs one command the way a user's process does:

* ``{"entry": "cli", "args": [...]}``: the console script ``lightning-async ARGS`` (``sys.argv[0]`` is its path,
  so Lightning's launcher re-executes ``lightning-async ARGS`` for the other ranks of a pipeline: new processes);
* ``{"entry": "snippet", "args": [SNIPPET]}``: ``python tests/_doc_snippet.py SNIPPET``.

The child has the server's working directory and environment (the test's), stdin from /dev/null, stdout and stderr
into the request's ``output`` file, a process group of its own (a timeout kills it with its ranks), and it ends
with ``sys.exit`` through the interpreter's normal shutdown: atexit handlers and C++ destructors run, so a process
that aborts at exit ("terminate called ...") does so here too.

Protocol: one JSON request per line on stdin; on stdout, ``{"pid": N}`` when the child starts and
``{"returncode": N}`` when it ends (negative: killed by that signal).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

SNIPPET_RUNNER = Path(__file__).with_name("_doc_snippet.py")


def run_child(request: dict, replies) -> None:
    """In the forked child: run the request's command and leave through ``sys.exit`` (never returns)."""
    os.setsid()
    replies.close()
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    if request["entry"] == "cli":
        from lightning_async.cli import main

        sys.argv = [shutil.which("lightning-async") or "lightning-async", *request["args"]]
        sys.exit(main())
    sys.path.insert(0, str(SNIPPET_RUNNER.parent))
    from _doc_snippet import main as run_snippet

    sys.argv = [str(SNIPPET_RUNNER), *request["args"]]
    run_snippet(request["args"][0])
    sys.exit(0)


def serve() -> None:
    import lightning_async.training_cli  # noqa: F401  (the import every child shares: torch, Lightning)

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else this process prints goes to stderr, not into the replies
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request, replies)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
