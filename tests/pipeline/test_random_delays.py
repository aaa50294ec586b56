"""Under NCCL's matching rules, ranks delayed at random points neither hang nor change the result by one bit.

Every send/receive group and every collective the runtime issues (the loss reduction, the tied-weight sum and the
global norm for clipping, the replicas' gradient average) is preceded, on a random third of the calls, by a sleep of
up to 2 ms, drawn from a generator seeded per rank, so the ranks reach each operation in ever-changing relative
orders. Under ``transport="nccl-rules"`` (tag 0, messages matched in posting order, as on NCCL) a wait cycle across
the point-to-point traffic and the collectives would hang (the spawn's timeout), and a mismatched message would
train wrong; so every jittered run must finish with exactly the weights of the same run without delays (which the
oracle matrix pins to the one-device rule; here, after 200 steps of AdamW with clipping, rounding has moved both a
few 1e-3 from it, so that comparison is loose).
"""

from __future__ import annotations

import functools
import random
import time

import pytest
import torch
import torch.distributed as dist

from _pipeline_harness import in_world, pipeline_run, reference_run, spawn
from lightning_async.pipeline import p2p

pytestmark = pytest.mark.slow

STEPS, M = 200, 2  # (M: micro-batches per replica; the workload's batches have 4 rows)
# (stages, replicas, schedule, clip): 2BW with clipping (the held-back norm and tied-sum reductions), 1F1B, and two
# replicas (the data-parallel gradient average between the point-to-point groups)
SCENARIOS = [(2, 1, "2bw", 1.0), (2, 1, "1f1b", None), (2, 2, "2bw", 1.0)]


JITTER = {"share": 0.0, "slept": 0}  # the share of calls delayed (0: the control run), the delays made


def _jittered(fn, rng: random.Random):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if JITTER["share"] and rng.random() < JITTER["share"]:
            time.sleep(rng.random() * 0.002)
            JITTER["slept"] += 1
        return fn(*args, **kwargs)

    return call


def _run_all() -> list:
    import os

    os.environ["SPAWN_RANK"] = str(dist.get_rank())
    rng = random.Random(1000 + dist.get_rank())
    for name in ("exchange", "receive", "prepost"):
        setattr(p2p.StageTransport, name, _jittered(getattr(p2p.StageTransport, name), rng))
    dist.all_reduce = _jittered(dist.all_reduce, rng)  # (the runtime calls it through the module: loss, norm, tied, dp)
    dist.destroy_process_group()  # each scenario gets its own default group
    out = []
    for stages, replicas, schedule, clip in SCENARIOS:
        run = functools.partial(pipeline_run, transport="nccl-rules")
        pair = []
        for share in (0.0, 0.3):
            JITTER["share"] = share
            result = in_world(stages * replicas, run, stages, schedule, "adamw", 0.0, STEPS, clip, M)
            pair.append(None if result is None else result[0])
        out.append(pair)
    return out + [JITTER["slept"]]


def test_random_delays_finish_and_stay_exact():
    per_rank = spawn(4, _run_all, timeout=600)
    assert all(ranks[-1] > 300 for ranks in per_rank[:2])  # every rank of the 2-stage runs was delayed often
    for index, (stages, replicas, schedule, clip) in enumerate(SCENARIOS):
        reference = reference_run("adamw", 1 if schedule == "2bw" else 0, 0.0, STEPS, clip, M * replicas)
        for replica in range(replicas):
            control, jittered = {}, {}
            for rank in range(replica * stages, (replica + 1) * stages):
                control.update(per_rank[rank][index][0])
                jittered.update(per_rank[rank][index][1])
            assert control.keys() == jittered.keys()
            changed = [n for n in control if not torch.equal(control[n], jittered[n])]
            assert not changed, f"{schedule}, {stages} stages x {replicas}: random delays changed {changed}"
            worst = max((control[n] - reference[n]).abs().max().item() for n in control)
            assert worst < 2e-2, f"{schedule}, {stages} stages x {replicas}: max |diff| from the rule = {worst}"
