"""``benchmarks/one_gpu_paths.py`` (the GPU session's check of every one-device code path) keeps working: its main
on the CPU, two paths, a few steps; and it fails when the forward stops reading the batch's weight version."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import one_gpu_paths  # noqa: E402
from lightning_async.pipeline.weight_swap import WeightSwap  # noqa: E402

ARGS = ["--device", "cpu", "--steps", "4", "--threads", "1"]


def test_the_swap_and_fused_2bw_paths_pass_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "one_gpu_paths.json"
    assert one_gpu_paths.main([*ARGS, "--paths", "swap", "2bw-fused", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["process_group"] == "gloo"
    swap, fused = result["rows"]
    assert (swap["path"], swap["status"], fused["path"], fused["status"]) == ("swap", "PASS", "2bw-fused", "PASS")
    assert fused["max_diff"] <= fused["tolerance"] == one_gpu_paths.FP32_TOLERANCE
    assert fused["control_diff"] >= one_gpu_paths.CONTROL_FACTOR * fused["tolerance"]  # 2BW is not plain training
    assert "fused kernel calls 8" in fused["notes"]  # (4 batches, each stepped once: 2 param groups)
    report = fused["memory_report"]
    assert report["weight_versions"] == 2 * report["parameters"] and report["optimizer_state"] >= 2 * report["parameters"]
    assert "2/2 PASS" in capsys.readouterr().out


def test_a_forward_that_ignores_the_batchs_weight_version_fails(tmp_path, monkeypatch):
    """Negative control: with the swap a no-op every forward reads the module's own parameters (the newest
    weights) instead of the version its batch must read; both paths must fail and the exit status say so."""
    monkeypatch.setattr(WeightSwap, "using", lambda self, weights: contextlib.nullcontext())
    out = tmp_path / "broken.json"
    assert one_gpu_paths.main([*ARGS, "--paths", "swap", "2bw-adamw", "--json", str(out)]) == 1
    assert [r["status"] for r in json.loads(out.read_text())["rows"]] == ["FAIL", "FAIL"]
