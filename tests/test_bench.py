"""``benchmarks/_bench.py``'s pure helpers: the interleaved order of rounds, medians / minimum of rounds, JSON."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import _bench  # noqa: E402


def test_fixed_order_runs_every_variant_once_per_round():
    assert list(_bench.interleaved(("a", "b", "c"), 2)) == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    assert list(_bench.interleaved({"x": 1, "y": 2}, 1)) == [(0, "x"), (0, "y")]  # a dict's keys, in order
    assert list(_bench.interleaved("ab", 0)) == []


def test_alternate_order_reverses_every_odd_round():
    got = [name for _, name in _bench.interleaved(("eager", "compiled"), 3, "alternate")]
    assert got == ["eager", "compiled", "compiled", "eager", "eager", "compiled"]


def test_shuffled_order_is_the_seeded_cumulative_shuffle():
    """Round ``r`` shuffles the previous round's order with ``random.Random(r)`` (what the scripts did by hand)."""
    names = [f"v{k}" for k in range(6)]
    expected, order = [], list(names)
    for r in range(5):
        random.Random(r).shuffle(order)
        expected += [(r, name) for name in order]
    got = list(_bench.interleaved(names, 5, "shuffle"))
    assert got == expected
    for r in range(5):
        assert sorted(name for k, name in got if k == r) == names  # each variant once a round
    assert len({tuple(n for k, n in got if k == r) for r in range(5)}) > 1  # and the order does change


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="order must be one of"):
        list(_bench.interleaved("ab", 1, "random"))


def test_medians_minimum_and_paired_ratio_of_rounds():
    samples = {"a": [3.0, 1.0, 2.0], "b": [4.0, 8.0, 6.0, 2.0]}
    assert _bench.medians(samples) == {"a": 2.0, "b": 5.0}
    assert _bench.fastest(samples) == {"a": 1.0, "b": 2.0}
    # per round 2, 0.25, 0.5: the median of the ratios, not the ratio of the medians (4 / 2 = 2)
    assert _bench.paired_median([2.0, 1.0, 3.0], [1.0, 4.0, 6.0]) == 0.5
    with pytest.raises(ValueError, match="differ in length"):
        _bench.paired_median([1.0, 2.0], [1.0])


def test_write_json_makes_the_folder(tmp_path):
    path = tmp_path / "runs" / "deeper" / "out.json"
    _bench.write_json(str(path), {"rows": [{"x": 1.5}], "name": "t"})
    assert json.loads(path.read_text()) == {"rows": [{"x": 1.5}], "name": "t"}
    assert path.read_text().startswith('{\n "rows"')  # indent 1, as the scripts wrote it


def test_common_arguments():
    p = _bench.parser("First paragraph.\n\nThe rest.")
    assert p.description == "First paragraph."
    _bench.add_device(p, "cpu", choices=["cpu", "cuda"])
    _bench.add_json(p)
    _bench.add_rounds(p, 3, "rounds")
    assert vars(p.parse_args([])) == {"device": "cpu", "json": None, "rounds": 3}
    assert vars(p.parse_args(["--rounds", "5", "--json", "x.json"]))["rounds"] == 5
    assert _bench.parser("A.\n\nB.", whole=True).description == "A.\n\nB."
