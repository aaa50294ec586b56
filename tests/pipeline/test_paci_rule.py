"""PACI's single-device rule (lightning_async/pipeline/paci.py) against a hand-written loop of the rule.

The loop below writes the rule out stage by stage with plain autograd: micro-batch j's forward on stage s at the
weights before the last update when j < p - 1 - s (else the current ones), the loss scaled 1/m, then the backward
from the last stage, each stage recomputed from the input it received at the current weights and fed the gradient
of the stage after it; the gradients summed over the batch, one optimizer step. PaciRule builds one autograd graph
instead (a custom Function for the stale forwards), so the two share no code but the partition of the units.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import subprocess
import sys

import pytest
import torch
import yaml
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader

from lightning_async.callbacks import DelaySimulation, ErrorFeedback
from lightning_async.lm import CausalLM
from lightning_async.optim import build_optimizer
from lightning_async.optim.lr_schedules import warmup_cosine
from test_callbacks import EpochSampler  # (tests/callbacks is on sys.path: tests/conftest.py)
from lightning_async.pipeline import paci
from lightning_async.pipeline.paci import PaciRule, check_paci, reads_previous
from lightning_async.pipeline.partition import partition_units
from lightning_async.pipeline.profiles import describe, stage_delays, unit_delays
from lightning_async.pipeline.schedules import spec
from workload import SHAPE, make_batches

STEPS, BATCH, WIDTH, TOL = 6, 6, 5, 1e-6

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x)) + x


class Tiny(nn.Module):
    """Four units with the pipeline contract: batches are (x, y), the loss a mean square."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(4))

    def pipeline_units(self):
        return [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]

    @staticmethod
    def pipeline_split_batch(batch):
        return batch

    @staticmethod
    def pipeline_loss(output, target):
        return (output - target).pow(2).mean()


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)) for _ in range(n)]


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
}


def by_hand(stages: int, m: int, optimizer: str, stale: bool = True, backward_at_forward: bool = False,
            make=Tiny, data=None, schedule=None, replicas: int = 1):
    """The rule written out; ``stale=False``: every forward current (synchronous training with micro-batches);
    ``backward_at_forward``: the backward at the forward's version instead (a weight stash, not PACI). ``make()`` is
    a module with the pipeline contract (a weight shared by two units, tied embeddings, is one weight here).
    ``replicas``: the micro-batches are the replicas' in turn, ``m / replicas`` each, each replica's first read old."""
    model = make()
    units = dict(model.pipeline_units())
    split = partition_units(model.pipeline_units(), stages)
    params = dict(model.named_parameters())  # one name per weight
    canonical = {id(p): n for n, p in params.items()}
    names = [sorted({canonical[id(p)] for u in stage for p in units[u].parameters()}) for stage in split]
    opt = OPTIMIZERS[optimizer](list(params.values())) if isinstance(optimizer, str) else optimizer(model)
    sched = schedule(opt) if schedule else None
    context_fn = getattr(model, "pipeline_context", None)

    def stage_fn(s: int, x: torch.Tensor, weights: dict, context) -> torch.Tensor:
        for u in split[s]:
            local = {n: weights[canonical[id(p)]] for n, p in units[u].named_parameters(remove_duplicate=False)}
            kwargs = {"context": context} if "context" in inspect.signature(units[u].forward).parameters else {}
            x = functional_call(units[u], local, (x,), kwargs)
        return x

    previous = {n: p.detach().clone() for n, p in params.items()}  # W(-1) = W(0)
    history = []
    for batch in data or batches():
        x, y = model.pipeline_split_batch(batch)
        current = {n: p.detach().clone() for n, p in params.items()}
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m))):
            context = context_fn(xj) if context_fn else None
            received, read, h = [], [], xj
            for s in range(stages):
                version = previous if stale and j % (m // replicas) < stages - 1 - s else current
                received.append(h)
                read.append(version)
                with torch.no_grad():
                    h = stage_fn(s, h, {n: version[n] for n in names[s]}, context)
            cotangent = None
            for s in reversed(range(stages)):
                x_in = received[s].detach().requires_grad_(s > 0)
                at = read[s] if backward_at_forward else current
                w = {n: at[n].clone().requires_grad_(True) for n in names[s]}
                out = stage_fn(s, x_in, w, context)
                if s == stages - 1:
                    out = model.pipeline_loss(out, yj) / m
                wrt = ([x_in] if s > 0 else []) + list(w.values())
                found = torch.autograd.grad(out, wrt, cotangent)
                if s > 0:
                    cotangent, found = found[0], found[1:]
                for n, g in zip(w, found):
                    grads[n] += g
        previous = current
        for n, p in params.items():
            p.grad = grads[n]
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history


def by_rule(stages: int, m: int, optimizer: str, stale: bool = True):
    model = Tiny()
    rule = PaciRule(model.pipeline_units(), stages, m)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    history, losses = [], []
    for batch in batches():
        loss, _ = rule.batch_loss(model, batch, stale=stale)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history, rule, losses


def gap(a: list[dict], b: list[dict]) -> float:
    return max((x[n] - y[n]).abs().max().item() for x, y in zip(a, b) for n in x)


def test_which_version_each_forward_reads():
    # stage s of p: the first p - 1 - s micro-batches of a batch read the previous version
    assert [[reads_previous(s, j, 4) for j in range(5)] for s in range(4)] == [
        [True, True, True, False, False], [True, True, False, False, False],
        [True, False, False, False, False], [False] * 5]
    assert stage_delays("paci", 4, 1) == [1, 1, 1, 0] and describe("paci", 4, 1) == "paci-4"
    assert check_paci(4, None) == 8 and check_paci(3, 2) == 2


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stages,m", [(2, 2), (3, 2), (3, 3)])
def test_rule_follows_the_hand_written_loop(stages, m, optimizer):
    expected = by_hand(stages, m, optimizer)
    got, rule, _ = by_rule(stages, m, optimizer)
    assert gap(got, expected) < TOL
    # negative controls: synchronous training and a weight stash (backward at the forward's version) are other rules
    assert gap(got, by_hand(stages, m, optimizer, stale=False)) > 1e-4
    assert gap(got, by_hand(stages, m, optimizer, backward_at_forward=True)) > 1e-4


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_one_stage_or_every_forward_current_is_synchronous_training(optimizer):
    sync = by_hand(3, 3, optimizer, stale=False)
    assert gap(by_rule(1, 3, optimizer)[0], sync) < TOL
    assert gap(by_rule(3, 3, optimizer, stale=False)[0], sync) < TOL
    assert gap(by_hand(1, 3, optimizer), sync) < TOL  # (the loop's own control: one stage is never stale)


def test_previous_version_is_kept_only_for_the_stale_stages():
    _, rule, _ = by_rule(3, 3, "adamw")
    model = Tiny()
    split = partition_units(model.pipeline_units(), 3)
    units = dict(model.pipeline_units())
    stale = sum(p.numel() for stage in split[:-1] for u in stage for p in units[u].parameters())
    assert sum(t.numel() for t in rule.previous_weights()) == stale < sum(p.numel() for p in model.parameters())


def test_checkpoint_of_the_previous_version_resumes_exactly():
    model, data = Tiny(), batches()
    rule = PaciRule(model.pipeline_units(), 3, 3)
    opt = OPTIMIZERS["adamw"](list(model.parameters()))
    saved = None
    for t, batch in enumerate(data):
        if t == 3:  # through torch.save, as a checkpoint
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rule": rule.state_dict()}, buffer)
            saved = buffer.getvalue()
        loss, _ = rule.batch_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    state = torch.load(io.BytesIO(saved))
    resumed = Tiny(seed=5)
    resumed.load_state_dict(state["model"])
    rule2 = PaciRule(resumed.pipeline_units(), 3, 3)
    rule2.load_state_dict(state["rule"])
    opt2 = OPTIMIZERS["adamw"](list(resumed.parameters()))
    opt2.load_state_dict(state["opt"])
    for batch in data[3:]:
        loss, _ = rule2.batch_loss(resumed, batch)
        loss.backward()
        opt2.step()
        opt2.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    with pytest.raises(ValueError, match="Resume with the same delay settings"):
        PaciRule(resumed.pipeline_units(), 2, 3).load_state_dict(state["rule"])


class DroppedBlock(Block):
    def forward(self, x):
        return torch.nn.functional.dropout(torch.tanh(self.linear(x)), 0.3, self.training) + x


class Dropped(Tiny):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(DroppedBlock(WIDTH) for _ in range(4))


def _gradients_with_equal_versions(stale: bool, autocast: bool, dropout: bool) -> list[torch.Tensor]:
    """Batch 1's gradients when the previous version equals the current one (3 stages, 3 micro-batches)."""
    model, (first, second) = (Dropped() if dropout else Tiny()), batches(2)
    rule = PaciRule(model.pipeline_units(), 3, 3)
    rule.batch_loss(model, first)  # no update follows: the previous version kept is the current one
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, _ = rule.batch_loss(model, second, stale=stale)
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("autocast,dropout", [(True, False), (False, True), (True, True)])
def test_recompute_replays_the_forwards_random_state_and_autocast(autocast, dropout, monkeypatch):
    """With equal versions the recomputed backward is ordinary backprop, bit for bit: the same dropout masks, the
    same bf16 casts (and, as in a pipeline stage, each micro-batch casts the weights itself: gradients of shared
    bf16 casts would be summed in bf16)."""
    plain = _gradients_with_equal_versions(False, autocast, dropout)
    assert all(torch.equal(a, b) for a, b in zip(_gradients_with_equal_versions(True, autocast, dropout), plain))
    monkeypatch.setattr(paci._State, "restored", lambda self: contextlib.nullcontext())  # control: no replay
    unreplayed = _gradients_with_equal_versions(True, autocast, dropout)
    assert max((a - b).abs().max().item() for a, b in zip(unreplayed, plain)) > 1e-3


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match=r"n_microbatches >= stages - 1.*at least 3"):
        check_paci(4, 2)
    with pytest.raises(ValueError, match="needs the number of stages"):
        check_paci(None, 4)
    with pytest.raises(ValueError, match="a rule per micro-batch, not a delay per unit"):
        unit_delays(Tiny().pipeline_units(), "paci", 2, delay=1)
    model = Tiny()
    with pytest.raises(ValueError, match="not divisible|multiple of 4"):
        PaciRule(model.pipeline_units(), 2, 4).batch_loss(model, batches(1)[0])
    with pytest.raises(ValueError, match="Cannot split 4 pipeline units into 5 stages"):
        PaciRule(model.pipeline_units(), 5, 8)


# ---- through Lightning: DelaySimulation(profile="paci") ------------------------------------------------------
LM_STEPS, LM_LR = 8, 3e-3
LM_OVERRIDES = {k: v for k, v in SHAPE.items() if k != "vocab_size"}  # 4 units: embed, 2 blocks, head (tied)


def make_lm(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(vocab_size=SHAPE["vocab_size"], model_overrides=LM_OVERRIDES, optimizer="adamw", lr=LM_LR,
                    weight_decay=0.1)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(callbacks: list, data: list, **kwargs) -> CausalLM:
    module = make_lm()
    options = dict(accelerator="cpu", devices=1, max_steps=len(data), logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    Trainer(callbacks=callbacks, **{**options, **kwargs}).fit(module, DataLoader(data, batch_size=None))
    return module


@pytest.mark.parametrize("stages,m", [(3, 2), (4, 4)])
@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_fit_through_the_callback_follows_the_hand_written_loop(stages, m):
    """A tied embedding (stage 0 reads it stale, the head current, in the same micro-batch), RoPE context, Lightning's
    warmup-cosine schedule: the fit equals the hand-written loop."""
    data = make_batches(LM_STEPS)
    callback = DelaySimulation(profile="paci", stages=stages, n_microbatches=m)
    module = fit([callback], data)
    got = dict(module.named_parameters())

    def hand(**kwargs) -> float:
        final = by_hand(
            stages, m, lambda model: build_optimizer("adamw", model.named_parameters(), lr=LM_LR, weight_decay=0.1),
            make=make_lm, data=data, **kwargs,
            schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, LM_STEPS, 0.1, 0.1)),
        )[-1]
        return max((got[n] - w).abs().max().item() for n, w in final.items())

    assert hand() < 1e-5  # (about 1e-7)
    assert hand(stale=False) > 1e-4 and hand(backward_at_forward=True) > 1e-4  # (about 1e-2)
    assert "training_step" not in vars(module)  # the callback's step is gone after fit
    assert (callback.max_delay, callback.profile_label()) == (1, f"paci-{stages}")
    sync = dict(fit([DelaySimulation(delay=0)], data).named_parameters())
    assert max((got[n] - sync[n]).abs().max().item() for n in got) > 1e-4


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_the_callback_simulates_paci_over_replicas():
    """``replicas=2``: each replica's first micro-batches read old weights, as the pipeline over 2 replicas does
    (``PaciRule(replicas=2)``); it differs from one replica's rule, and it is recorded as ``paci-3x2``."""
    stages, m, data = 3, 4, make_batches(LM_STEPS)
    callback = DelaySimulation(profile="paci", stages=stages, n_microbatches=m, replicas=2)
    got = dict(fit([callback], data).named_parameters())

    def hand(replicas: int) -> float:
        final = by_hand(stages, m, lambda model: build_optimizer("adamw", model.named_parameters(), lr=LM_LR,
                                                                  weight_decay=0.1), make=make_lm, data=data,
                        replicas=replicas,
                        schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                            opt, lambda s: warmup_cosine(s, LM_STEPS, 0.1, 0.1)))[-1]
        return max((got[n] - w).abs().max().item() for n, w in final.items())

    assert hand(2) < 1e-5 and hand(1) > 1e-4
    assert callback.profile_label() == "paci-3x2" and spec("paci").recorded_delay(3, replicas=2) == (1, "paci-3x2")
    with pytest.raises(ValueError, match="replicas=3 does not divide them"):
        DelaySimulation(profile="paci", stages=3, n_microbatches=4, replicas=3)
    with pytest.raises(ValueError, match="replicas is the 'paci' profile's setting"):
        DelaySimulation(profile="pipedream", stages=3, replicas=2)


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_loss_goes_down_through_the_callback():
    losses = Losses()
    fit([DelaySimulation(profile="paci", stages=4), losses], make_batches(4, batch_size=8) * 6)
    first, last = sum(losses.losses[:4]) / 4, sum(losses.losses[-4:]) / 4
    assert last < first - 0.3, losses.losses  # (5.55 -> 5.05)


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_callback_refusals_name_the_fix():
    with pytest.raises(ValueError, match="'paci' delay profile needs the number of stages"):
        DelaySimulation(profile="paci")
    with pytest.raises(ValueError, match=r"at least 3 \(e\.g\. --delay\.n_microbatches 8\)"):
        DelaySimulation(profile="paci", stages=4, n_microbatches=2)
    with pytest.raises(ValueError, match="n_microbatches is the 'paci' profile's setting.*Remove n_microbatches"):
        DelaySimulation(profile="pipedream", stages=4, n_microbatches=8)
    with pytest.raises(ValueError, match=r"DelaySimulation \(delay profile paci-5\): Cannot split 4 pipeline units"):
        DelaySimulation(profile="paci", stages=5).check_profile(make_lm())
    data = make_batches(2)
    with pytest.raises(ValueError, match="Set trainer.accumulate_grad_batches to 1"):
        fit([DelaySimulation(profile="paci", stages=2)], data, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="ErrorFeedback corrects a delayed optimizer's update.*method to none"):
        fit([DelaySimulation(profile="paci", stages=2), ErrorFeedback(1.0)], data)
    with pytest.raises(ValueError, match="multiple of 3"):
        fit([DelaySimulation(profile="paci", stages=2, n_microbatches=3)], data)




@pytest.mark.filterwarnings("ignore:.*does not have many workers")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_through_the_callback_is_exact(tmp_path):
    """A checkpoint is a drain, as on the pipeline: the rule forgets its previous version there (the batch after reads
    the current weights everywhere), so the checkpoint needs none and resuming ends on the fit that saved it, while
    a fit that never drained differs."""
    data = make_batches(LM_STEPS)
    options = dict(accelerator="cpu", devices=1, max_steps=LM_STEPS, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)

    def run(module, callbacks, ckpt_path=None, **kwargs) -> dict:
        trainer = Trainer(callbacks=[DelaySimulation(profile="paci", stages=3, n_microbatches=2), *callbacks],
                          **{**options, **kwargs})
        trainer.fit(module, DataLoader(data, batch_size=None, sampler=EpochSampler(len(data))), ckpt_path=ckpt_path)
        return dict(module.named_parameters())

    undrained = run(make_lm(), [], enable_checkpointing=False)
    whole = run(make_lm(), [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)])
    ckpt = next(tmp_path.glob("*step=4.ckpt"))
    assert torch.load(ckpt, weights_only=False)["paci"]["previous"] is None
    resumed = run(make_lm(seed=3), [ModelCheckpoint(dirpath=tmp_path / "again", every_n_train_steps=4, save_top_k=-1)],
                  ckpt_path=ckpt)
    assert all(torch.equal(p, whole[n]) for n, p in resumed.items())
    assert any(not torch.equal(p, undrained[n]) for n, p in resumed.items())


@pytest.mark.slow  # runs the command (README.md, Tests)
def test_recipe_through_the_cli(tmp_path):
    small = ["--data.max_chars", "400000", "--data.val_batches", "2", "--data.progress", "false",
             "--data.cache_dir", str(tmp_path / "cache"), "--trainer.enable_progress_bar", "false"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lightning_async.cli", "fit", "--config", "quickstart",
                               "--config", "delay/paci-4", *args, *small], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))

    proc = cli("--trainer.max_steps", "3", "--trainer.val_check_interval", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    identity = yaml.safe_load((tmp_path / "runs/quickstart/delayed-paci-4-adamw/version_0/hparams.yaml").read_text())
    assert (identity["mode"], identity["delay"], identity["delay_profile"]) == ("delayed", 1, "paci-4")
    refused = cli("--config", "corrections/ef", "--trainer.max_steps", "1")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "error: DelayCorrection('ef') corrects a delayed optimizer's update; PACI's rule (profile 'paci') has none to "
        "correct. Set correction.method to none (or use another delay profile).")
