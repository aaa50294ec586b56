"""AsyncPP in the real 2BW pipeline (gloo, 2 and 3 processes) follows its single-device rule.

The method is an optimizer (``asyncpp``, NAdamW with beta1 0.99), so the runtime steps it like any other; the oracle
is the harness's ``reference_run`` (``DelayedOptimizer(pairing="2bw")``), which ``tests/optim/test_asyncpp.py`` pins to a
hand-written NAdamW. One spawn per process count runs every scenario.
"""

from __future__ import annotations

import pytest

from _pipeline_harness import pipeline_run, reference_run, spawn

pytestmark = pytest.mark.slow

STEPS = 8
# (stages, micro-batches, gradient clipping, EF strength): AsyncPP alone (the method as published), with clipping,
# and with EF on top (the correction acts on NAdamW's update like on any optimizer's)
SCENARIOS = {
    2: [(2, 2, None, 0.0), (2, 4, 1.0, 1.0)],
    3: [(3, 4, None, 0.0), (3, 4, 0.5, 0.0)],
}


def _scenarios(world: int) -> list:
    return [pipeline_run(stages, "2bw", "asyncpp", ef, STEPS, clip, m=m)[0] for stages, m, clip, ef in SCENARIOS[world]]


@pytest.mark.parametrize("world", [2, 3])
def test_asyncpp_pipeline_equals_single_device_rule(world: int):
    per_rank = spawn(world, _scenarios, world)
    for index, (stages, m, clip, ef) in enumerate(SCENARIOS[world]):
        reference = reference_run("asyncpp", 1, ef, STEPS, clip, microbatches=m)
        weights = {}
        for rank_results in per_rank:
            weights.update(rank_results[index])
        assert set(weights) <= set(reference) and len(weights) >= len(reference) - 1
        worst = max((weights[n] - reference[n]).abs().max().item() for n in weights)
        assert worst < 2e-5, f"{stages} stages, m={m}, clip={clip}, ef={ef}: max |diff| = {worst}"
    sync = reference_run("asyncpp", 0, 0.0, STEPS, SCENARIOS[world][0][2], microbatches=SCENARIOS[world][0][1])
    first = {}
    for rank_results in per_rank:
        first.update(rank_results[0])
    assert max((first[n] - sync[n]).abs().max().item() for n in first if n != "eval_loss") > 1e-4  # negative control
