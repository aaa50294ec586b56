"""The pipeline oracle for the mixture-of-experts models and the GPT-2 example (``docs/examples/gpt2_units.py``):
their configs, and one spawn per stage count that runs every scenario (shared by ``test_moe.py`` and
``test_gpt2_units.py``; each spawn runs once per session, whichever test asks first).

A scenario trains ``ORACLE_STEPS`` batches on the real ``PipelineRuntime`` (gloo processes); the test compares
every weight with ``reference_run``, the single-device 2BW rule on the same micro-batches. An MoE's router losses
are attached per micro-batch in both (``RouterLoss.one_forward_per_microbatch``). The 2-stage spawn also fits a
Mixtral through Lightning's ``async_pipe`` (as torchrun starts ranks) with a TensorBoard logger, for the
strategy-level checks (the micro-batch scaling set in ``setup``, the expert statistics of both stages).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import torch

from lightning_async.models.hf import HFCausalLM

VOCAB = 257
EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# a coefficient large enough that the router losses move the weights well past the tolerance
MIXTRAL = dict(SHAPE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
               router_aux_loss_coef=0.1)
QWEN2_MOE = dict(SHAPE, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, mlp_only_layers=[0], output_router_logits=True, router_aux_loss_coef=0.1)
MOE_CONFIGS = {"mixtral": MIXTRAL, "qwen2-moe": QWEN2_MOE}
GPT2 = dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

ORACLE_STEPS = 6  # batch 5 is the harness's half-size batch: a shape change mid-run
MICROBATCHES = 4
# (workload, schedule, optimizer, EF strength, activation checkpointing); clipping at 1.0 in every scenario
ORACLE_SCENARIOS = {
    2: [
        ("mixtral", "2bw", "adamw", 0.0, False),
        ("mixtral", "2bw", "adamw", 1.0, False),
        ("mixtral-coef0", "2bw", "adamw", 0.0, False),
        ("qwen2-moe", "2bw", "muon", 1.0, False),
        ("qwen2-moe", "2bw", "adamw", 0.0, True),
        ("gpt2", "2bw", "adamw", 1.0, False),
        ("gpt2", "1f1b", "muon", 0.0, False),
    ],
    3: [
        ("mixtral", "2bw", "adamw", 1.0, False),
        ("mixtral", "2bw", "muon", 0.0, False),
        ("qwen2-moe", "2bw", "adamw", 0.0, False),
        ("qwen2-moe", "2bw", "adamw", 1.0, False),
        ("gpt2", "2bw", "adamw", 0.0, False),
        ("gpt2", "2bw", "muon", 1.0, True),
    ],
}
LIGHTNING_FIT_STEPS = 4
LIGHTNING_MICROBATCHES = 2


def make_moe(config: dict, seed: int = 0, **kwargs) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM(dict(config), **kwargs)


@functools.cache
def gpt2_example():
    """The module ``docs/examples/gpt2_units.py`` (the documented GPT-2 units), imported from its file."""
    spec = importlib.util.spec_from_file_location("gpt2_units", EXAMPLES / "gpt2_units.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_gpt2(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return gpt2_example().GPT2CausalLM(dict(GPT2), **kwargs)


def _per_microbatch(make) -> HFCausalLM:
    module = make()
    module.moe.loss.one_forward_per_microbatch(MICROBATCHES)  # each forward is one of the runtime's micro-batches
    return module


MAKERS = {
    "mixtral": lambda: _per_microbatch(partial(make_moe, MIXTRAL)),
    "mixtral-coef0": lambda: _per_microbatch(partial(make_moe, dict(MIXTRAL, router_aux_loss_coef=0.0))),
    "qwen2-moe": lambda: _per_microbatch(partial(make_moe, QWEN2_MOE)),
    "gpt2": make_gpt2,
}


def workload(name: str):
    from _pipeline_harness import Workload, eval_batch, make_batches

    return Workload(MAKERS[name], make_batches, eval_batch)


def reference(name: str, schedule: str, optimizer: str, ef: float, clip: float | None = 1.0):
    from _pipeline_harness import reference_run

    delay = 1 if schedule == "2bw" else 0
    return reference_run(optimizer, delay, ef if delay else 0.0, ORACLE_STEPS, clip, microbatches=MICROBATCHES, workload=workload(name))


def _scenarios(stages: int) -> list:
    from _pipeline_harness import pipeline_run

    return [
        pipeline_run(stages, schedule, opt, ef, ORACLE_STEPS, 1.0, m=MICROBATCHES, workload=workload(name),
                     activation_checkpointing=recompute)
        for name, schedule, opt, ef, recompute in ORACLE_SCENARIOS[stages]
    ]


def lightning_fit(strategy, devices: int, log_dir: str | None = None, callbacks=()) -> dict[str, torch.Tensor]:
    """A Mixtral fitted through Lightning for ``LIGHTNING_FIT_STEPS`` steps; its state dict (this rank's part)."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger
    from test_strategy import TinyData

    L.seed_everything(0)
    module = HFCausalLM(dict(MIXTRAL), aux_loss_microbatches=LIGHTNING_MICROBATCHES, lr=3e-3)
    logger = TensorBoardLogger(log_dir, name="moe", version="run") if log_dir else False
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=LIGHTNING_FIT_STEPS, logger=logger,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        limit_val_batches=0, gradient_clip_val=1.0, log_every_n_steps=1,
    )
    trainer.fit(module, datamodule=TinyData())
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _two_stage_spawn(log_dir: str) -> dict:
    from _pipeline_harness import as_torchrun

    from lightning_async.strategies import AsyncPipelineStrategy

    out = {"oracle": _scenarios(2)}
    as_torchrun()  # Lightning runs on a fresh default group, as under torchrun
    out["lightning"] = lightning_fit(AsyncPipelineStrategy(n_microbatches=LIGHTNING_MICROBATCHES), 2, log_dir)
    return out


@functools.cache
def spawn_results(stages: int) -> tuple[list, str]:
    """Every rank's results of the ``stages``-stage spawn (run once per session), and the 2-stage Lightning fit's
    TensorBoard run directory."""
    from _pipeline_harness import spawn

    log_dir = tempfile.mkdtemp(prefix="lightning-async-moe-")
    atexit.register(shutil.rmtree, log_dir, ignore_errors=True)
    if stages == 2:
        return spawn(2, _two_stage_spawn, log_dir, timeout=900), os.path.join(log_dir, "moe", "run")
    return [{"oracle": rank} for rank in spawn(stages, _scenarios, stages, timeout=900)], log_dir


def merged_weights(per_rank: list, index: int) -> dict[str, torch.Tensor]:
    merged = {}
    for rank in per_rank:
        merged.update(rank["oracle"][index][0])
    return merged


def check_scenarios(stages: int, per_rank: list, names: set[str]) -> list[tuple[str, float]]:
    """Compare each scenario of ``names`` with its single-device reference; returns ``(label, max |diff|)``."""
    results = []
    for index, (name, schedule, opt, ef, recompute) in enumerate(ORACLE_SCENARIOS[stages]):
        if name not in names:
            continue
        expected = reference(name, schedule, opt, ef)
        got = merged_weights(per_rank, index)
        assert set(got) <= set(expected) and len(got) >= len(expected) - 1  # a tied head may appear once
        worst = max((got[n] - expected[n]).abs().max().item() for n in got)
        results.append((f"{name}, {stages} stages, {schedule}/{opt}/ef={ef}/recompute={recompute}", worst))
        losses = [rank["oracle"][index][1] for rank in per_rank]
        assert all(loss == losses[0] for loss in losses) and all(x is None or 3.0 < x < 7.0 for x in losses[0])
    return results
