"""A pipeline checkpoint continues on one device, and a one-device checkpoint on a pipeline (the layout that was missing).

The one-device run is the delay simulation (``DelaySimulation(1)`` + ``ErrorFeedback(1.0)``), which the pipeline
follows step for step (``test_strategy.py``): the conversions of :mod:`lightning_async.pipeline.one_device`
(``lightning-async export CKPT OUT --to one-device|pipeline``) carry both weight versions, the optimizer state by
parameter name, the EF buffer, the step and the data position (the step-4 checkpoints fall mid-epoch).

One spawn of two processes runs every pipeline fit: p=2 (2BW + EF + AdamW, DCP checkpoints at steps 4 and 8), the
continuation of a one-device checkpoint converted for it, and p=2 under 1F1B (synchronous: one weight version). (EF's u_prev is its ``previous_update`` buffer.)
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from _pipeline_harness import as_torchrun, spawn
from lightning_async.export import export_main
from lightning_async.pipeline import distributed_checkpoint as distributed
from lightning_async.pipeline import one_device
from lightning_async.pipeline.checkpoint import consolidate
from test_distributed_checkpoint import StartState
from test_strategy import SHAPE, _max_diff, fit

pytestmark = pytest.mark.slow  # a spawn of two processes

STEPS = 8  # checkpoints at steps 4 and 8 (test_strategy.fit: every 4 steps); resumed runs continue to STEPS
ORACLE = 2e-5  # pipeline vs its one-device simulation over a whole run (test_strategy.py's tolerance)


def _strategy(schedule: str = "2bw"):
    from lightning_async.strategies import AsyncPipelineStrategy

    return AsyncPipelineStrategy(pipeline_parallel_size=2, n_microbatches=2, schedule=schedule, checkpoint_format="dcp")


def _callbacks(pipeline: bool) -> list:
    from lightning_async.callbacks import DelaySimulation, ErrorFeedback

    return [ErrorFeedback(1.0)] if pipeline else [DelaySimulation(1), ErrorFeedback(1.0)]


def _module(**shape):
    from lightning_async.lm import CausalLM

    return CausalLM(vocab_size=257, model_overrides={**SHAPE, **shape}, optimizer="adamw", lr=3e-3)


def _pipeline_fits(tmp: str) -> dict:
    as_torchrun()
    out = {"p2": fit(_strategy(), 2, callbacks=_callbacks(True), ckpt_dir=os.path.join(tmp, "p2"))}
    start = StartState()
    out["from_one_device"] = fit(_strategy(), 2, callbacks=[*_callbacks(True), start],
                                 ckpt_path=os.path.join(tmp, "to-pipeline"))
    out["from_one_device_start"] = (start.weights, start.optimizer)
    out["sync"] = fit(_strategy("1f1b"), 2, ckpt_dir=os.path.join(tmp, "sync"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("layouts"))
    single = fit("auto", 1, callbacks=_callbacks(False), ckpt_dir=os.path.join(tmp, "one"))
    assert export_main([os.path.join(tmp, "one", "step=4.ckpt"), os.path.join(tmp, "to-pipeline"), "--to", "pipeline"]) == 0
    pipeline = spawn(2, _pipeline_fits, tmp, timeout=300)
    assert export_main([os.path.join(tmp, "p2", "step=4.ckpt"), os.path.join(tmp, "to-one-device.ckpt"), "--to",
                        "one-device"]) == 0
    return tmp, single, pipeline


def _merged(per_rank: list, key: str, part: int = 0) -> dict:
    merged = {}
    for rank in per_rank:
        merged.update(rank[key][part])
    return merged


def _saved(path: str, prefix: str) -> dict:
    """The tensors of a DCP checkpoint under ``prefix``, by the rest of their key."""
    keys = distributed.saved_keys(path)
    flat = {k: distributed._empty_like_saved(v) for k, v in keys.items()
            if k.startswith(prefix) and isinstance(v, distributed.dcp.TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        distributed.dcp.load(flat, storage_reader=distributed.dcp.FileSystemReader(path))
    return {k[len(prefix):]: v for k, v in flat.items()}


def _by_name(module) -> list[list[str]]:
    """Every name of each parameter, in the order of the module's optimizer (the one-device state's indices)."""
    names = distributed.parameter_names(module)
    return [names[id(p)] for group in one_device.optimizer_of(module).param_groups for p in group["params"]]


def test_a_pipeline_checkpoint_continues_on_one_device(runs, tmp_path):
    tmp, single, pipeline = runs
    path = os.path.join(tmp, "to-one-device.ckpt")
    continued, _ = fit("auto", 1, callbacks=_callbacks(False), ckpt_path=path)
    assert _max_diff(continued, _merged(pipeline, "p2")) < 1e-6  # the pipeline's own continuation
    assert _max_diff(continued, single[0]) < ORACLE  # the uninterrupted simulation (the pipeline ran 4 steps of it)
    # negative control: without the older 2BW version (the next forward's weights) the run goes elsewhere
    broken = torch.load(path, weights_only=False)
    for ring in broken["optimizer_states"][0]["delay"]["rings"]:
        ring[0] = ring[1].clone()
    torch.save(broken, tmp_path / "one-version.ckpt")
    one_version, _ = fit("auto", 1, callbacks=_callbacks(False), ckpt_path=str(tmp_path / "one-version.ckpt"))
    assert _max_diff(one_version, _merged(pipeline, "p2")) > 1e-4


def test_a_synchronous_pipeline_checkpoint_continues_as_plain_training(runs, tmp_path):
    tmp, _, pipeline = runs
    out = str(tmp_path / "sync.ckpt")
    converted = one_device.to_one_device(os.path.join(tmp, "sync", "step=4.ckpt"), out, _module())
    assert "delay" not in converted["optimizer_states"][0]  # one weight version: no DelaySimulation
    continued, _ = fit("auto", 1, ckpt_path=out)
    assert _max_diff(continued, _merged(pipeline, "sync")) < 1e-6


def test_the_one_device_checkpoint_holds_the_pipelines_state(runs):
    tmp, _, _ = runs
    path = os.path.join(tmp, "p2", "step=4.ckpt")
    converted = torch.load(os.path.join(tmp, "to-one-device.ckpt"), weights_only=False)
    weights, older = consolidate(path), _saved(path, distributed.VERSION)
    state, ef = _saved(path, distributed.OPTIMIZER), _saved(path, distributed.CORRECTION)
    assert converted["state_dict"].keys() == weights.keys()
    assert all(torch.equal(converted["state_dict"][k], weights[k]) for k in weights)
    saved, delay = converted["optimizer_states"][0]["optimizer"], converted["optimizer_states"][0]["delay"]
    assert delay["steps_taken"] == converted["global_step"] == 4 and delay["pairing"] == "2bw"
    for i, names in enumerate(_by_name(_module())):
        name = next(n for n in names if n in older)
        assert torch.equal(delay["rings"][i][0], older[name]) and torch.equal(delay["rings"][i][1], weights[name])
        assert saved["state"][i].keys() == {k.rsplit("/", 1)[1] for k in state if k.rsplit("/", 1)[0] == name}
        assert all(torch.equal(v, state[f"{name}/{k}"]) for k, v in saved["state"][i].items())
        assert torch.equal(delay["correction"]["previous_update"][i], ef[f"previous_update/{name}"])
    assert converted["loops"] == distributed.trainer_state(path)["loops"]  # the step and the data position


def test_a_one_device_checkpoint_continues_on_the_pipeline(runs):
    tmp, single, pipeline = runs
    saved = torch.load(os.path.join(tmp, "one", "step=4.ckpt"), weights_only=False)
    weights, state = _merged(pipeline, "from_one_device_start"), _merged(pipeline, "from_one_device_start", 1)
    assert weights.keys() == saved["state_dict"].keys()
    assert all(torch.equal(weights[k], saved["state_dict"][k]) for k in weights)
    expected = {f"{name}/{key}": value for names, per in zip(_by_name(_module()), saved["optimizer_states"][0]["optimizer"]["state"].values())
                for name in names for key, value in per.items() if torch.is_tensor(value)}
    assert state and all(torch.equal(v, expected[k]) for k, v in state.items())
    assert _max_diff(_merged(pipeline, "from_one_device"), single[0]) < 1e-6  # the uninterrupted one-device run


def _assert_same(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b), where
    elif isinstance(a, dict):
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif not callable(a):
        assert a == b, where


def test_one_device_to_pipeline_and_back_loses_nothing(runs, tmp_path):
    tmp, _, _ = runs
    original = os.path.join(tmp, "one", "step=8.ckpt")
    one_device.to_pipeline(original, str(tmp_path / "pipe"), _module())
    back = one_device.to_one_device(str(tmp_path / "pipe"), str(tmp_path / "back.ckpt"), _module())
    saved = torch.load(original, weights_only=False)
    saved["callbacks"].pop("DelaySimulation")  # (a pipeline run has none)
    for buffer in ("update_history", "updates_seen"):  # EF's buffers of delays > 1: empty here
        assert all(t is None for t in saved["optimizer_states"][0]["delay"]["correction"].pop(buffer))
    _assert_same(saved, back)


def test_a_checkpoint_of_another_model_is_refused(runs, tmp_path, capsys):
    tmp, _, _ = runs
    pipeline, single = os.path.join(tmp, "p2", "step=4.ckpt"), os.path.join(tmp, "one", "step=4.ckpt")
    fix = "convert it with the model it was saved from"
    with pytest.raises(ValueError, match=rf"saved from another model \(no weights for model\.blocks\.4\..*{fix}"):
        one_device.to_one_device(pipeline, str(tmp_path / "x.ckpt"), _module(num_layers=6))
    with pytest.raises(ValueError, match=rf"another model \(shapes differ: model\.embed\.weight \(257, 32\) vs \(257, 48\).*{fix}"):
        one_device.to_pipeline(single, str(tmp_path / "x"), _module(hidden_size=48, num_heads=4, num_kv_heads=2))
    plain = torch.load(single, weights_only=False)
    plain["optimizer_states"] = [plain["optimizer_states"][0]["optimizer"]]
    torch.save(plain, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="without DelaySimulation.*only runs of DelaySimulation\\(delay=1\\)"):
        one_device.to_pipeline(str(tmp_path / "plain.ckpt"), str(tmp_path / "x"), _module())
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "x.ckpt")
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "y.ckpt"), "--to", "one-device"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "checkpoint_format='dcp'" in err
