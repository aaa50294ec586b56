"""``HFCausalLM``: Hugging Face causal LMs as pipeline modules, on one device and under the pipeline; export.

Tiny random configs built here (hidden 64, 4 layers); nothing is downloaded.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_async.callbacks import DelaySimulation, ErrorFeedback  # noqa: E402
from lightning_async.export import export_main  # noqa: E402
from lightning_async.models.hf import DecoderLayerUnit, HFCausalLM  # noqa: E402
from lightning_async.optim import build_optimizer  # noqa: E402
from lightning_async.optim.lr_schedules import warmup_cosine  # noqa: E402
from lightning_async.pipeline.partition import partition_units  # noqa: E402
from lightning_async.pipeline.stage import build_stage  # noqa: E402
from test_callbacks import (  # noqa: E402
    CLIP, KWARGS, LRS, STEPS, TRAIN, VOCAB, WEIGHT_DECAY, make_trainer, max_diff, train_loader, weights,
)
from test_delay import reference_delayed  # noqa: E402

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LLAMA = dict(SHAPE, model_type="llama")
QWEN2_TIED = dict(SHAPE, model_type="qwen2", tie_word_embeddings=True)
CONFIGS = {
    "llama": LLAMA,
    "qwen2-tied": QWEN2_TIED,
    "mistral": dict(SHAPE, model_type="mistral"),
    "qwen3": dict(SHAPE, model_type="qwen3"),
    "qwen2-sliding": dict(SHAPE, model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2),
}

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden"),
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),
]


def make_hf(config: dict = LLAMA, seed: int = 0, **kwargs) -> HFCausalLM:
    torch.manual_seed(seed)
    return HFCausalLM(dict(config), **kwargs)


def ids(rows: int = 3, length: int = 16, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


# ---- the units -----------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_units_compose_to_the_models_own_logits(name, attn):
    module = make_hf(CONFIGS[name], attn_implementation=attn)
    units = module.pipeline_units()
    names = [n for n, _ in units]
    assert names == ["model.model.embed_tokens", *(f"model.model.layers.{i}" for i in range(4)), "model.model.norm", "model.lm_head"]
    assert all(isinstance(u, DecoderLayerUnit) for _, u in units[1:5])
    for unit_name, unit in units:  # each unit's module is the one under its name: pruning replaces it there
        inner = unit.layer if isinstance(unit, DecoderLayerUnit) else unit
        assert module.get_submodule(unit_name) is inner
        assert dict(unit.named_parameters()) == dict(inner.named_parameters())  # a stage names weights as the model
    x = ids()
    with torch.no_grad():
        expected = module.model(input_ids=x).logits
        assert (module(x) - expected).abs().max().item() <= 1e-6
    masks = module.pipeline_context(x)["attention_masks"]
    if attn == "sdpa" and name != "qwen2-sliding":
        assert masks == {"full_attention": None}  # SDPA's is_causal: no mask tensor


def test_tied_embedding_stays_one_weight_shared_by_the_first_and_last_stage():
    module = make_hf(QWEN2_TIED)
    units = module.pipeline_units()
    assert units[0][1].weight is units[-1][1].weight
    for stages in (2, 3):
        split = partition_units(units, stages, "uniform")
        first, tied_first = build_stage(units, split, 0)
        last, tied_last = build_stage(units, split, stages - 1)
        assert len(tied_first) == len(tied_last) == 1
        assert first.get_parameter(tied_first[0]) is last.get_parameter(tied_last[0]) is module.model.lm_head.weight
    untied = make_hf(LLAMA).pipeline_units()
    assert build_stage(untied, partition_units(untied, 2, "uniform"), 0)[1] == []


def test_hyperparameters_hold_the_config_and_vocab_comes_from_the_data():
    module = make_hf(dict(LLAMA, vocab_size=100), vocab_size=300)
    assert module.model.config.vocab_size == 300 and module.model.lm_head.out_features == 300
    assert module.hparams["model"]["model_type"] == "llama" and module.hparams["model"]["vocab_size"] == 300
    assert module.max_seq_len == 64
    rebuilt = HFCausalLM(module.hparams["model"])
    assert rebuilt.model.config.to_diff_dict() == module.model.config.to_diff_dict()


# ---- loading -------------------------------------------------------------------------------------
def test_from_pretrained_directory_and_config_json(tmp_path):
    source = make_hf(LLAMA)
    source.model.save_pretrained(tmp_path / "model")
    loaded = HFCausalLM(str(tmp_path / "model"), vocab_size=VOCAB)
    assert max_diff(weights(loaded), weights(source)) == 0.0
    assert loaded.hparams["pretrained_from"] == str(tmp_path / "model")
    assert loaded.hparams["model"]["model_type"] == "llama"  # a checkpoint rebuilds it without the directory
    padded = HFCausalLM(str(tmp_path / "model"), vocab_size=VOCAB - 10)  # a padded embedding is fine...
    rebuilt = HFCausalLM(**{k: v for k, v in padded.hparams.items() if k != "pretrained_from"})  # ...and rebuilds
    assert rebuilt.model.lm_head.weight.shape == padded.model.lm_head.weight.shape == (VOCAB, 64)
    with pytest.raises(ValueError, match=r"tokenizer has 300 tokens but the pretrained model at .* embeds only 257"):
        HFCausalLM(str(tmp_path / "model"), vocab_size=300)
    make_hf(QWEN2_TIED).model.save_pretrained(tmp_path / "tied")
    tied = HFCausalLM(str(tmp_path / "tied")).model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # the tie survives loading
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    from_json = HFCausalLM(str(tmp_path / "config.json"))
    assert from_json.model.config.hidden_size == 64 and type(from_json.model).__name__ == "LlamaForCausalLM"


def test_missing_path_is_named_at_construction(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*no such model directory or config JSON file"):
        HFCausalLM(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*has no config.json"):
        HFCausalLM(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="needs its model_type"):
        HFCausalLM({"hidden_size": 64})


def test_model_without_plan_or_layout_says_how_to_provide_units():
    mpt = dict(model_type="mpt", vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
    with pytest.raises(ValueError, match=r"MptForCausalLM has no pipeline plan.*Subclass HFCausalLM and override pipeline_units\(\)"):
        HFCausalLM(mpt, attn_implementation="eager")


@pytest.mark.parametrize("fields", [
    dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    dict(model_type="phi", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    dict(model_type="gptj", n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8, bos_token_id=0, eos_token_id=0),
], ids=["gpt-neox", "phi", "gpt-j"])
def test_families_with_a_pipeline_plan_derive_their_units(fields):
    """The layout table of docs/models.md: these families' plans give units that reproduce their logits."""
    module = make_hf(dict(fields, vocab_size=VOCAB, max_position_embeddings=64))
    names = [n for n, _ in module.pipeline_units()]
    assert sum(isinstance(u, DecoderLayerUnit) for _, u in module.pipeline_units()) == 2 and len(names) == 6
    module.eval()
    with torch.no_grad():
        assert (module(ids()) - module.model(input_ids=ids()).logits).abs().max().item() <= 1e-6


def test_granites_multipliers_are_applied_by_the_units():
    # Granite multiplies the embeddings in the base model's forward and divides the logits in the head's
    granite = dict(SHAPE, model_type="granite", embedding_multiplier=2.0, logits_scaling=4.0)
    module = make_hf(granite)
    module.eval()
    with torch.no_grad():
        assert (module(ids()) - module.model(input_ids=ids()).logits).abs().max().item() <= 1e-6


class WithoutFinalNorm(HFCausalLM):
    def pipeline_units(self):
        return [(name, unit) for name, unit in super().pipeline_units() if not name.endswith(".norm")]


def test_overridden_units_are_checked_against_the_forward_too():
    with pytest.raises(ValueError, match=r"units of LlamaForCausalLM do not reproduce its forward pass.*"
                                         r"between model\.model\.layers\.3 and model\.lm_head"):
        WithoutFinalNorm(dict(LLAMA))


# ---- training on one device ----------------------------------------------------------------------
def hf_reference_of(make, optimizer: str, delay: int, lam: float) -> list[dict[str, torch.Tensor]]:
    """x(0..STEPS) of the delayed rule from test_delay's independent loop, with the schedule Lightning runs;
    ``make()`` builds the module (the same initial weights every call)."""
    stepper = make()
    opt = build_optimizer(optimizer, stepper.named_parameters(), lr=LRS[optimizer], weight_decay=WEIGHT_DECAY, **KWARGS.get(optimizer, {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, STEPS, 0.1, 0.1))
    return reference_delayed(make(), stepper, opt, TRAIN, delay, lam, "2bw", sched, clip=CLIP)


def hf_reference(optimizer: str, delay: int, lam: float, config: dict) -> list[dict[str, torch.Tensor]]:
    return hf_reference_of(lambda: make_hf(config), optimizer, delay, lam)


@pytest.mark.parametrize(("optimizer", "lam", "config"), [("adamw", 1.0, LLAMA), ("muon", 0.0, QWEN2_TIED)], ids=["adamw-ef-llama", "muon-qwen2-tied"])
def test_delay_simulation_follows_the_delayed_rule(optimizer, lam, config):
    module = make_hf(config, optimizer=optimizer, lr=LRS[optimizer], weight_decay=WEIGHT_DECAY, optimizer_kwargs=KWARGS.get(optimizer))
    callbacks = [DelaySimulation(1)] + ([ErrorFeedback(lam)] if lam else [])
    make_trainer(callbacks).fit(module, train_loader())
    expected = hf_reference(optimizer, 1, lam, config)
    got = weights(module)
    assert max_diff(got, expected[-1]) <= 1e-6
    assert max_diff(got, hf_reference(optimizer, 0, 0.0, config)[-1]) > 1e-4  # negative control: the delay matters


# ---- export --------------------------------------------------------------------------------------
def logits_of_directory(path, x: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(input_ids=x).logits


def test_export_of_a_lightning_checkpoint_file(tmp_path):
    module = make_hf(QWEN2_TIED)
    trainer = make_trainer([], max_steps=3)
    trainer.fit(module, train_loader())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert export_main([str(tmp_path / "last.ckpt"), str(tmp_path / "hf")]) == 0
    with torch.no_grad():
        expected = module(ids())
    assert (logits_of_directory(tmp_path / "hf", ids()) - expected).abs().max().item() <= 1e-6
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # the tied weight saved once


@pytest.mark.parametrize("tied", [True, False])
def test_export_of_a_causal_lm_checkpoint_as_llama(tied, tmp_path):
    from lightning_async.lm import CausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=128, tie_embeddings=tied)
    module = CausalLM(vocab_size=VOCAB, model_overrides=shape)
    trainer = make_trainer([], max_steps=3)  # trained: the norms are no longer all ones
    trainer.fit(module, train_loader())
    trainer.save_checkpoint(tmp_path / "ours.ckpt")
    assert export_main([str(tmp_path / "ours.ckpt"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    with torch.no_grad():
        expected = module(ids())
    assert (logits_of_directory(tmp_path / "hf", ids()) - expected).abs().max().item() <= 1e-6


def save_checkpoint_with_data(module, data_hparams: dict, path) -> None:
    """A Lightning-style checkpoint file of ``module`` as a run with a data module of ``data_hparams`` writes it."""
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "datamodule_hyper_parameters": data_hparams}, path)


@pytest.mark.parametrize("kind", ["hf", "bpe"])
def test_export_writes_the_runs_tokenizer(kind, tmp_path, capsys):
    from transformers import AutoTokenizer

    from lightning_async.data import TextDataModule
    from lightning_async.data.tokenizer import train_bpe

    text = "the quick brown fox jumps over the lazy dog. " * 200
    if kind == "hf":
        train_bpe([text], vocab_size=300).save(str(tmp_path / "tokenizer.json"))
        data_hparams = {"tokenizer": "hf", "tokenizer_path": str(tmp_path / "tokenizer.json")}
    else:
        (tmp_path / "corpus.txt").write_text(text)
        data_hparams = {"source": "text", "path": str(tmp_path / "corpus.txt"), "tokenizer": "bpe", "bpe_vocab_size": 300,
                        "cache_dir": str(tmp_path / "cache"), "progress": False}
    trained = TextDataModule(**data_hparams).tokenizer  # (the BPE trains here, as in the run, and is cached)
    module = make_hf(LLAMA, vocab_size=trained.vocab_size)
    save_checkpoint_with_data(module, data_hparams, tmp_path / "run.ckpt")
    assert export_main([str(tmp_path / "run.ckpt"), str(tmp_path / "out")]) == 0
    assert "AutoTokenizer.from_pretrained" in capsys.readouterr().out
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    sample = "the lazy fox jumps quickly"
    assert exported.encode(sample, add_special_tokens=False) == trained.encode(sample).tolist()
    assert exported.eos_token == trained.eod_token and exported.decode(trained.encode(sample)) == sample


def test_export_with_the_byte_tokenizer_says_how_to_encode(tmp_path, capsys):
    save_checkpoint_with_data(make_hf(LLAMA), {"tokenizer": "byte"}, tmp_path / "run.ckpt")
    assert export_main([str(tmp_path / "run.ckpt"), str(tmp_path / "out")]) == 0
    assert "byte-level, no files to write" in capsys.readouterr().out
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    save_checkpoint_with_data(make_hf(LLAMA), {"tokenizer": "hf", "tokenizer_path": str(tmp_path / "gone.json")}, tmp_path / "bad.ckpt")
    assert export_main([str(tmp_path / "bad.ckpt"), str(tmp_path / "out2")]) == 0  # the model is written; the note says why not the tokenizer
    out = capsys.readouterr().out
    assert "tokenizer: NOT written" in out and "gone.json" in out and (tmp_path / "out2" / "config.json").exists()


def test_export_refuses_other_checkpoints_with_a_clear_message(tmp_path, capsys):
    torch.save({"state_dict": {"layer.weight": torch.zeros(2, 2)}, "hyper_parameters": {}}, tmp_path / "other.ckpt")
    assert export_main([str(tmp_path / "other.ckpt"), str(tmp_path / "out")]) == 2
    assert "holds neither an HFCausalLM nor a CausalLM" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "nothing does not exist" in capsys.readouterr().err


# ---- the pipeline oracle -------------------------------------------------------------------------
# One spawn per stage count runs every scenario: (model, schedule, optimizer, EF strength, clip, activation
# checkpointing).
# Across a spawn each model meets AdamW and Muon, one with EF and one without. Clipping is always on: 1.0 is
# below these models' gradient norms (1.07-2.03 over the 10 batches), so it acts on every step (checked
# below). A lower threshold is not a better test: with 0.5, AdamW turns the last-bit difference of the global
# norm's summation order into 4e-5 on a few embedding rows of the Llama, in the single-device reference itself.
ORACLE_STEPS = 10
ORACLE_SCENARIOS = {
    2: [
        ("llama", "2bw", "adamw", 0.0, 1.0, False),
        ("llama", "2bw", "muon", 1.0, 1.0, False),
        ("qwen2-tied", "2bw", "adamw", 1.0, 1.0, False),
        ("qwen2-tied", "2bw", "muon", 0.0, 1.0, False),
        ("qwen2-tied", "1f1b", "adamw", 0.0, 1.0, False),  # sync_pipe's schedule: plain training
    ],
    3: [
        ("llama", "2bw", "adamw", 1.0, 1.0, False),
        ("llama", "2bw", "muon", 0.0, 1.0, False),
        ("qwen2-tied", "2bw", "adamw", 0.0, 1.0, False),
        ("qwen2-tied", "2bw", "muon", 1.0, 1.0, True),  # with activation checkpointing
        ("llama", "1f1b", "muon", 0.0, 1.0, False),
    ],
}
MICROBATCHES = 4  # divides the harness's batches (8 rows, one shrunk to 4) and is >= the stage count


def oracle_workload(name: str):
    from functools import partial

    from _pipeline_harness import Workload, eval_batch, make_batches

    return Workload(partial(make_hf, CONFIGS[name]), make_batches, eval_batch)


def _oracle_scenarios(stages: int) -> list:
    from _pipeline_harness import pipeline_run

    return [
        pipeline_run(stages, schedule, opt, ef, ORACLE_STEPS, clip, m=MICROBATCHES, workload=oracle_workload(name),
                     activation_checkpointing=recompute)
        for name, schedule, opt, ef, clip, recompute in ORACLE_SCENARIOS[stages]
    ]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def oracle_results(request):
    from _pipeline_harness import spawn

    stages = request.param
    return stages, spawn(stages, _oracle_scenarios, stages, timeout=600)


@pytest.mark.slow
def test_pipeline_follows_the_single_device_rule(oracle_results):
    from _pipeline_harness import reference_run
    from test_pipeline_oracle import _merge

    stages, per_rank = oracle_results
    for index, (name, schedule, opt, ef, clip, _) in enumerate(ORACLE_SCENARIOS[stages]):
        delay = 1 if schedule == "2bw" else 0
        reference = reference_run(opt, delay, ef, ORACLE_STEPS, clip, microbatches=MICROBATCHES, workload=oracle_workload(name))
        got = _merge(per_rank, index)
        assert set(got) <= set(reference) and len(got) >= len(reference) - 1  # a tied head may appear once
        worst = max((got[n] - reference[n]).abs().max().item() for n in got)
        assert worst < 1e-5, f"{name}, {stages} stages, {schedule}/{opt}/ef={ef}/clip={clip}: max |diff| = {worst}"
        if index == 0:  # negative controls: the plain run is not the delayed one, and clipping acts
            plain = reference_run(opt, 0, 0.0, ORACLE_STEPS, clip, microbatches=MICROBATCHES, workload=oracle_workload(name))
            assert max((got[n] - plain[n]).abs().max().item() for n in got) > 1e-4
            unclipped = reference_run(opt, delay, ef, ORACLE_STEPS, None, microbatches=MICROBATCHES, workload=oracle_workload(name))
            assert max((got[n] - unclipped[n]).abs().max().item() for n in got) > 1e-4
        losses = [rank_results[index][1] for rank_results in per_rank]
        assert all(loss == losses[0] for loss in losses) and all(x is None or 3.0 < x < 7.0 for x in losses[0])


# ---- the command line, checkpoints and export ----------------------------------------------------
def fit_from_the_cli(tmp_path, *extra: str, recipe: str = "hf-llama-tiny"):
    """``lightning-async fit`` with the quick start and an HF model recipe; returns the run directory (the recipe
    and the run's label name it: ``runs/<recipe>/<label>/version_0``, as the README's ``export`` command expects)."""
    from test_cli import REPO, SMALL_DATA, run_cli

    proc = run_cli(
        tmp_path, "fit", "--config", str(REPO / "recipes/quickstart.yaml"), "--config", str(REPO / f"recipes/models/{recipe}.yaml"),
        *extra, "--trainer.max_steps", "8", "--trainer.val_check_interval", "8", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "true",
        "--data.cache_dir", str(tmp_path / "cache"), *SMALL_DATA,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = sorted((tmp_path / "runs" / recipe).glob("*/version_0"))
    assert len(found) == 1, sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "runs").glob("*/*/*"))
    return found[0]


def check_export(checkpoint, state_dict: dict, hparams: dict, out_dir) -> None:
    """The exported directory (``lightning-async export``) gives the logits of the module rebuilt from the
    checkpoint, to 1e-6."""
    from lightning_async.cli import main

    assert main(["export", str(checkpoint), str(out_dir)]) == 0
    module = HFCausalLM(hparams["model"], aux_loss_microbatches=hparams.get("aux_loss_microbatches"))
    module.load_state_dict(state_dict)
    with torch.no_grad():
        expected = module(ids())
    assert (logits_of_directory(out_dir, ids()) - expected).abs().max().item() <= 1e-6


@pytest.mark.slow
def test_cli_fit_checkpoint_and_export(tmp_path):
    from test_cli import read_scalars

    run_dir = fit_from_the_cli(tmp_path)
    losses = read_scalars(run_dir, "train/loss")
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    checkpoint = run_dir / "checkpoints/last.ckpt"  # the recipe keeps the last checkpoint under this name
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["last.ckpt"]
    saved = torch.load(checkpoint, weights_only=False)
    check_export(checkpoint, saved["state_dict"], saved["hyper_parameters"], tmp_path / "hf")


@pytest.mark.slow
def test_cli_pipeline_fit_checkpoint_and_export(tmp_path):
    """2 stages under async_pipe (gloo): the stage files' hyperparameters rebuild the config for export."""
    from test_cli import REPO, read_scalars

    from lightning_async.pipeline.checkpoint import consolidate, stage_files

    run_dir = fit_from_the_cli(tmp_path, "--config", str(REPO / "recipes/pipeline/async.yaml"))
    assert json.loads((run_dir / "DONE").read_text())["mode"] == "async_pipe"
    losses = read_scalars(run_dir, "train/loss")  # 2BW reports each batch's loss one step later
    assert len(losses) == 7 and losses[-1] < losses[0] - 0.5, losses
    checkpoint = run_dir / "checkpoints/last.ckpt"
    assert checkpoint.is_dir() and len(stage_files(checkpoint)) == 2
    hparams = torch.load(stage_files(checkpoint)[-1], weights_only=False)["hyper_parameters"]
    check_export(checkpoint, consolidate(checkpoint), hparams, tmp_path / "hf")
