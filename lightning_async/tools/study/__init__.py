"""``lightning-async study``: run a matrix of trainings (optimizers x modes x lrs x seeds), then compare.

A study YAML (see ``recipes/study/*.yaml`` and ``docs/compare.md``)::

    name: quickstart                     # default: the file's stem
    base: [quickstart]                   # recipes every run starts from (later ones win): names or paths
    optimizers: [adamw, muon]            # each adds the recipe optimizers/<name> if it exists
    optimizer_recipes: study/nano        # optional: a recipe folder whose <name>.yaml (if any) follows
                                         # optimizers/<name> (settings tuned for this study)
    modes: [sync, delayed, delayed-ef]   # sync | delayed | delayed-ef | async_pipe | sync_pipe, or
                                         # delayed-<c> / async_pipe-<c> for a recipe corrections/<c>.yaml
    lrs: {adamw: [1e-3, 3e-3]}           # optional: a number, a list, or per optimizer
    seeds: [0, 1]                        # a list, or an int N meaning 0..N-1 (default [0])
    max_steps: 200                       # optional --trainer.max_steps
    lengths: [300, 600, 1200]            # optional ablation of max_steps instead (run names get -n<steps>)
    output: studies/quickstart           # default studies/<name>
    overrides: ["--data.source", "text"] # extra CLI args (a list) or {key: value}
    ef_strengths: [0.5, 1.0]             # optional ablation of the delayed-ef modes
    delays: [1, 2]                       # optional ablation of the delayed modes
    jobs: 2                              # optional: runs trained at the same time (default 1; --jobs N)

Runs go to ``<output>/runs/<run name>/`` (run name ``{optimizer}-{mode}-lr{lr}-s{seed}``, the lr part
only when ``lrs`` is given), the log of each run to ``<output>/logs/<run name>.log``, the report to
``<output>/compare/``. A run whose dir holds ``DONE`` is skipped, and so is one that diverged
(``DIVERGED``, or non-finite loss curves: a result, reported as such, not retried); a dir without
either is a half-finished run: it is removed and the run starts over. So rerunning the same command
after an interruption resumes the study.

While a run trains, ``<output>/runs/<run name>.lock`` holds the pids of the study and of the training
process: a second study on the same output refuses to start while either is alive (and so never
deletes a directory that is still being written), and takes over a lock whose processes are gone.
SIGTERM (or Ctrl-C) stops the study: the signal is passed on to the training's process group, the
study waits for it to end (``STOP_GRACE_S``, then SIGKILL) and exits with 128 + the signal number.

``--jobs N`` trains up to N runs of the matrix at the same time, launched in matrix order, each with
``OMP_NUM_THREADS`` = cores // N unless that is set already; the locks, skips, logs and status lines are
those of one run at a time, ``--fail-fast`` launches no more runs after a failure (the running ones
finish), and a stop reaches every running run.

The function that executes one run is injectable (``run_study(..., runner=...)``): the default
launches ``lightning-async fit ...`` as a subprocess; tests pass a function that writes a fake run.

Modules: :mod:`.spec` (modes, runs), :mod:`.matrix` (the run matrix), :mod:`.parsing` (study files),
:mod:`.locks` (run locks), :mod:`.runner` (executing and stopping runs), :mod:`.outcome` (run states and
results), :mod:`.scheduler` (the runs one or N at a time), :mod:`.loop` (a whole study), :mod:`.cli`.
"""

from lightning_async.tools.study.cli import build_parser, study_from_args, study_main
from lightning_async.tools.study.locks import RunInProgress, RunLock, pid_alive, run_lock
from lightning_async.tools.study.loop import run_study
from lightning_async.tools.study.matrix import Study, default_launcher, validation_interval
from lightning_async.tools.study.outcome import StudyResult, run_outcome, run_state
from lightning_async.tools.study.parsing import (
    STUDY_KEYS,
    check_jobs,
    find_recipes_dir,
    find_study_file,
    load_study,
    parse_set,
    study_from_dict,
    valid_optimizers,
)
from lightning_async.tools.study.runner import (
    RunningProcesses,
    StudyTerminated,
    run_env,
    stop_run,
    stop_runs,
    subprocess_runner,
    synthetic_runner,
    terminate_as_interrupt,
)
from lightning_async.tools.study.spec import MODES, Runner, RunSpec, StudyError, StudyMode, study_mode, valid_modes

__all__ = [
    "MODES",
    "STUDY_KEYS",
    "RunInProgress",
    "RunLock",
    "RunSpec",
    "Runner",
    "RunningProcesses",
    "Study",
    "StudyError",
    "StudyMode",
    "StudyResult",
    "StudyTerminated",
    "build_parser",
    "check_jobs",
    "default_launcher",
    "find_recipes_dir",
    "find_study_file",
    "load_study",
    "parse_set",
    "pid_alive",
    "run_env",
    "run_lock",
    "run_outcome",
    "run_state",
    "run_study",
    "stop_run",
    "stop_runs",
    "study_from_args",
    "study_from_dict",
    "study_main",
    "study_mode",
    "subprocess_runner",
    "synthetic_runner",
    "terminate_as_interrupt",
    "valid_modes",
    "valid_optimizers",
    "validation_interval",
]
