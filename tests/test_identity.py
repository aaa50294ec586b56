"""``lightning_async.identity``: the one schema of a run's identity (what runs write, what compare reads)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_async.identity import (
    ASYNC,
    ASYNC_EF,
    DEFAULT_STRENGTHS,
    IDENTITY_KEYS,
    KNOWN_CORRECTIONS,
    NO_CORRECTION,
    SYNC,
    IdentityError,
    MissingIdentity,
    RunIdentity,
    classify,
    correction_category,
    correction_order,
    mode_word,
    run_label,
)

IDENTITIES = [
    RunIdentity("adamw", "sync", seed=0, lr=1e-3),
    RunIdentity("adamw", "delayed", seed=1, lr=3e-3),
    RunIdentity("muon", "delayed", ef_strength=0.5, delay=2, seed=2, lr=0.02),
    RunIdentity("soap", "async_pipe", correction="nesterov", correction_strength=0.9, delay_profile="pipedream-4"),
    RunIdentity("adan", "delayed", correction="dc-asgd", correction_strength=2.0, delay=3, delay_profile="[3, 2, 1]"),
    RunIdentity("lion", "sync_pipe", seed=None, lr=None),
    RunIdentity("adamw", "sync_pipe", schedule="zbv", seed=0),
]


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: f"{i.optimizer}-{i.mode}-{i.correction}")
def test_record_round_trip(identity: RunIdentity) -> None:
    record = identity.as_record()
    assert tuple(record) == IDENTITY_KEYS
    assert RunIdentity.from_mapping(record) == identity
    assert RunIdentity.from_mapping(record).as_record() == record


def test_record_of_an_ef_run_names_the_correction() -> None:
    record = RunIdentity("adamw", "delayed", ef_strength=1.0, seed=0, lr=1e-3).as_record()
    assert record == {"optimizer": "adamw", "mode": "delayed", "schedule": None, "ef_strength": 1.0, "correction": "ef",
                      "correction_strength": 1.0, "delay": 1, "delay_profile": "uniform", "seed": 0, "lr": 1e-3}
    # naming the correction alone fills ef_strength in: both spellings are one identity
    named = RunIdentity("adamw", "delayed", correction="ef", correction_strength=1.0, seed=0, lr=1e-3)
    assert named.as_record() == record


def test_old_records_without_the_new_keys() -> None:
    """hparams.yaml of runs made before corrections existed: optimizer, mode, ef_strength, delay, seed, lr."""
    old_ef = RunIdentity.from_mapping({"optimizer": "adamw", "mode": "delayed", "ef_strength": 0.5, "delay": 1,
                                       "seed": 3, "lr": 0.001})
    assert (old_ef.correction, old_ef.correction_strength, old_ef.delay_profile) == ("ef", 0.5, "uniform")
    assert old_ef.category == ASYNC_EF and old_ef.ef_strength == 0.5
    plain = RunIdentity.from_mapping({"optimizer": "adamw", "mode": "delayed", "ef_strength": 0.0})
    assert (plain.correction, plain.correction_strength, plain.delay, plain.category) == ("none", 0.0, 1, ASYNC)
    bare = RunIdentity.from_mapping({"optimizer": "muon", "mode": "sync"})
    assert (bare.delay, bare.ef_strength, bare.correction, bare.seed, bare.lr) == (0, 0.0, "none", None, None)
    assert bare.category == SYNC


@pytest.mark.parametrize("correction", KNOWN_CORRECTIONS)
@pytest.mark.parametrize("mode", ["delayed", "async_pipe"])
def test_category_of_each_correction(mode: str, correction: str) -> None:
    identity = RunIdentity("adamw", mode, correction=correction, correction_strength=1.0)
    expected = "async+EF" if correction == "ef" else f"async+{correction}"
    assert identity.category == expected == correction_category(correction)
    assert identity.corrected
    # strength 0 switches a correction off: the run is plain async; a sync run stays sync
    assert RunIdentity("adamw", mode, correction=correction, correction_strength=0.0).category == ASYNC
    assert RunIdentity("adamw", "sync", correction=correction, correction_strength=1.0).category == SYNC


def test_classify_and_order() -> None:
    assert classify("sync_pipe", "nesterov", 1.0) == SYNC
    assert classify("delayed") == ASYNC and classify("delayed", "ef", 0.5) == ASYNC_EF
    assert classify("async_pipe", "weight-prediction") == "async+weight-prediction"
    with pytest.raises(IdentityError, match="correction must be a name"):
        classify("delayed", 1.0)  # the old classify(mode, ef_strength) would be misread: refused instead
    assert correction_order(["nesterov", NO_CORRECTION, "ef", "nesterov", "dc-asgd"]) == ["ef", "nesterov", "dc-asgd"]


def test_known_corrections_are_the_correction_family() -> None:
    """identity.py lists the names itself (it imports no torch): they must stay those of optim.corrections."""
    import inspect

    from lightning_async.optim import corrections

    assert set(KNOWN_CORRECTIONS) == set(corrections.CORRECTIONS)
    assert NO_CORRECTION == corrections.NO_CORRECTION
    for name, cls in corrections.CORRECTIONS.items():
        assert DEFAULT_STRENGTHS[name] == inspect.signature(cls).parameters["strength"].default, name


def test_errors_say_what_is_wrong() -> None:
    with pytest.raises(MissingIdentity, match="missing optimizer, mode") as info:
        RunIdentity.from_mapping({"seed": 1, "optimizer": ""})
    assert info.value.missing == ["optimizer", "mode"]
    with pytest.raises(IdentityError, match="unknown mode 'turbo'; expected one of sync, sync_pipe, delayed"):
        RunIdentity.from_mapping({"optimizer": "adamw", "mode": "turbo"})
    with pytest.raises(IdentityError, match="unknown correction 'nesterovv'; expected one of none, ef, adaptive-ef"):
        RunIdentity.from_mapping({"optimizer": "adamw", "mode": "delayed", "correction": "nesterovv"})
    with pytest.raises(IdentityError, match="ef_strength 1 contradicts correction 'nesterov'"):
        RunIdentity("adamw", "delayed", ef_strength=1.0, correction="nesterov")
    with pytest.raises(IdentityError, match="ef_strength 1 contradicts correction 'ef' of strength 0.5"):
        RunIdentity("adamw", "delayed", ef_strength=1.0, correction="ef", correction_strength=0.5)
    with pytest.raises(IdentityError, match="strengths must be >= 0"):
        RunIdentity("adamw", "delayed", correction="nesterov", correction_strength=-1.0)
    with pytest.raises(IdentityError, match="delay must be >= 0"):
        RunIdentity("adamw", "delayed", delay=-1)


def test_raw_numbers_are_read_leniently() -> None:
    identity = RunIdentity.from_mapping({"optimizer": "adamw", "mode": "delayed", "seed": "4", "lr": "3e-3",
                                         "delay": 2.0, "correction": "nesterov", "correction_strength": "0.5"})
    assert (identity.seed, identity.lr, identity.delay, identity.correction_strength) == (4, 0.003, 2, 0.5)
    odd = RunIdentity.from_mapping({"optimizer": "adamw", "mode": "sync", "seed": True, "lr": [1e-3, 1e-4],
                                    "ef_strength": float("nan")})
    assert (odd.seed, odd.lr, odd.ef_strength) == (None, None, 0.0)
    unnamed = RunIdentity.from_mapping({"optimizer": "x", "mode": "delayed", "correction": "dc-asgd"})
    assert unnamed.correction_strength == 2.0  # DelayCompensation's default strength


def test_the_schema_imports_no_framework() -> None:
    """identity.py must load without torch or Lightning (tools read runs on machines without them)."""
    path = Path(__file__).resolve().parents[1] / "lightning_async" / "identity.py"
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('identity', {str(path)!r})\n"
        "module = sys.modules['identity'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert module.RunIdentity('a', 'delayed', ef_strength=1.0).category == 'async+EF'\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'lightning_async'))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("record, schedule, label", [
    ({"optimizer": "adamw", "mode": "sync"}, None, "sync-adamw"),
    ({"optimizer": "muon", "mode": "delayed", "ef_strength": 1.0}, None, "delayed-ef-muon"),
    ({"optimizer": "adamw", "mode": "delayed", "delay": 3, "delay_profile": "pipedream-4"}, None, "delayed-pipedream-4-adamw"),
    ({"optimizer": "adamw", "mode": "delayed", "delay": 2}, None, "delayed-d2-adamw"),
    ({"optimizer": "adamw", "mode": "async_pipe"}, "2bw", "2bw-async-adamw"),
    ({"optimizer": "adamw", "mode": "async_pipe", "correction": "ef"}, "2bw", "2bw-async-ef-adamw"),
    ({"optimizer": "adamw", "mode": "async_pipe", "correction": "ef", "correction_strength": 0}, "2bw", "2bw-async-adamw"),
    ({"optimizer": "adamw", "mode": "sync_pipe"}, "1f1b", "1f1b-sync-adamw"),
    ({"optimizer": "My Opt/x", "mode": "sync_pipe"}, "zbv", "zbv-sync-my-opt-x"),
    # the recorded schedule names the folder when the caller does not; an old record without it: the default
    ({"optimizer": "adamw", "mode": "sync_pipe", "schedule": "GPipe"}, None, "gpipe-sync-adamw"),
    ({"optimizer": "adamw", "mode": "sync_pipe"}, None, "1f1b-sync-adamw"),
])
def test_run_label_names_mode_schedule_correction_and_optimizer(record, schedule, label) -> None:
    assert run_label(RunIdentity.from_mapping(record), schedule) == label


@pytest.mark.parametrize("record, schedule_name, mode", [
    ({"optimizer": "adamw", "mode": "sync"}, "one device", "sync"),
    ({"optimizer": "adamw", "mode": "delayed"}, "one device", "async"),
    ({"optimizer": "adamw", "mode": "delayed", "schedule": "2bw"}, "one device", "async"),  # no pipeline, no schedule
    ({"optimizer": "adamw", "mode": "sync_pipe", "schedule": "1f1b"}, "1f1b", "sync"),
    ({"optimizer": "adamw", "mode": "async_pipe", "schedule": "2bw"}, "2bw", "async"),
    ({"optimizer": "adamw", "mode": "async_pipe"}, "pipeline", "async"),  # written by 0.1: no schedule recorded
])
def test_the_words_a_user_reads_for_schedule_and_mode(record, schedule_name, mode) -> None:
    """One vocabulary: the schedule (the pipeline's, or one device) and the mode, sync or async, whatever the
    recorded ``mode`` value (``sync_pipe``, ``async_pipe``, ``delayed`` stay readable as 0.1 wrote them)."""
    identity = RunIdentity.from_mapping(record)
    assert (identity.schedule_name, identity.mode_word) == (schedule_name, mode)
    assert identity.mode == record["mode"] and mode_word(record["mode"]) == mode
    assert identity.as_record()["schedule"] == (None if schedule_name in ("one device", "pipeline") else schedule_name)
    with pytest.raises(IdentityError, match="unknown mode"):
        mode_word("sync-pipe")
