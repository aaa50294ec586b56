"""Partitioning the unit sequence into stages."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_async.pipeline.partition import balanced_boundaries, partition_units


def units(sizes: list[int]) -> list[tuple[str, nn.Module]]:
    return [(f"u{i}", nn.Linear(s, 1, bias=False)) for i, s in enumerate(sizes)]


def test_balanced_boundaries_minimise_the_largest_stage():
    assert balanced_boundaries([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_boundaries([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0, 1]
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    starts = balanced_boundaries(costs, 3)
    ends = starts[1:] + [len(costs)]
    worst = max(sum(costs[a:b]) for a, b in zip(starts, ends))
    assert worst == 14  # [3 1 4 1] [5 9] [2 6] is optimal: total 31 over 3 stages cannot go below 14 here


def test_every_method_gives_contiguous_non_empty_stages():
    seq = units([4, 4, 4, 4, 4, 64])
    assert partition_units(seq, 3, "uniform") == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert partition_units(seq, 2, "parameters") == [["u0", "u1", "u2", "u3", "u4"], ["u5"]]
    timed = partition_units(seq, 2, "time", example_input=object(), time_fn=lambda mods, x: [1, 1, 1, 1, 1, 1.5])
    assert timed == [["u0", "u1", "u2"], ["u3", "u4", "u5"]]
    assert partition_units(seq, 3, ["u2", "u5"]) == [["u0", "u1"], ["u2", "u3", "u4"], ["u5"]]


def test_tied_weights_count_once_in_parameter_balance():
    a, b = nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False)
    head = nn.Linear(10, 10, bias=False)
    head.weight = a.weight
    assert partition_units([("a", a), ("b", b), ("head", head)], 2, "parameters") == [["a"], ["b", "head"]]


@pytest.mark.parametrize(
    "stages, method, message",
    [
        (7, "uniform", "Cannot split 6 pipeline units into 7 stages"),
        (2, "random", "Unknown partition method 'random'"),
        (2, "time", "needs an example input"),
        (2, ["nope"], "Unknown pipeline unit"),
        (3, ["u2"], "make 2 stages, but the pipeline has 3"),
    ],
)
def test_bad_partitions_name_the_fix(stages, method, message):
    with pytest.raises(ValueError, match=message):
        partition_units(units([1] * 6), stages, method)


def test_tied_weights_pair_up_in_one_order_and_only_between_first_and_last_stage():
    from torch import nn

    from lightning_async.pipeline.stage import build_stage

    a, b = nn.Linear(2, 2), nn.Linear(3, 3)
    first = nn.ModuleDict({"x": a, "y": b})
    last = nn.ModuleDict({"u": b, "v": a})  # registered in the opposite order
    units = [("first", first), ("mid", nn.Linear(4, 4)), ("last", last)]
    split = [["first"], ["mid"], ["last"]]
    head, tied_head = build_stage(units, split, 0)
    tail, tied_tail = build_stage(units, split, 2)
    assert len(tied_head) == len(tied_tail) == 4  # two weights and two biases
    assert all(head.get_parameter(m) is tail.get_parameter(n) for m, n in zip(tied_head, tied_tail))
    shared_with_middle = [("first", a), ("mid", nn.ModuleDict({"w": a})), ("last", nn.Linear(2, 2))]
    with pytest.raises(ValueError, match=r"'first.weight' is shared by pipeline stages \[0, 1\]; only the first and the last"):
        build_stage(shared_with_middle, split, 0)
    middle_and_last = [("first", nn.Linear(2, 2)), ("mid", a), ("last", nn.ModuleDict({"w": a}))]
    for stage in range(3):  # every stage refuses, before any rank could wait for another
        with pytest.raises(ValueError, match=r"'mid.weight' is shared by pipeline stages \[1, 2\]"):
            build_stage(middle_and_last, split, stage)
