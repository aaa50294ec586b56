"""The SmolLM2-style decoder: public shapes, parameter counts, causality, tying and pipeline units."""

from __future__ import annotations

import pytest
import torch

from lightning_async.lm import CausalLM
from lightning_async.models import MODEL_CONFIGS, SmolLM2, count_parameters, model_config
from lightning_async.models.objective import next_token_loss, split_next_token


def test_public_shapes_have_the_published_parameter_counts():
    # HuggingFaceTB/SmolLM2-135M and -360M (tied embeddings, vocabulary 49152).
    assert count_parameters(model_config("smollm2-135m")) == 134_515_008
    assert count_parameters(model_config("smollm2-360m")) == 361_821_120
    assert count_parameters(model_config("tiny")) < 2_000_000


def test_smollm2_135m_shape_matches_the_model_card():
    cfg = MODEL_CONFIGS["smollm2-135m"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_size) == (576, 30, 9, 3, 1536)
    assert (cfg.vocab_size, cfg.rms_eps, cfg.rope_theta, cfg.tie_embeddings) == (49152, 1e-5, 100000.0, True)


def tiny(**overrides) -> SmolLM2:
    torch.manual_seed(0)
    return SmolLM2(model_config("tiny", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=64, **overrides))


def test_forward_shape_and_tied_head():
    model = tiny()
    logits = model(torch.randint(0, 257, (3, 11)))
    assert logits.shape == (3, 11, 257)
    assert model.head.proj.weight is model.embed.weight
    untied = tiny(tie_embeddings=False)
    assert untied.head.proj.weight is not untied.embed.weight


def test_attention_is_causal():
    model = tiny().eval()
    x = torch.randint(0, 257, (1, 12))
    changed = x.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 257
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_pipeline_units_compose_to_the_forward_pass():
    model = tiny().eval()
    x = torch.randint(0, 257, (2, 9))
    names = [name for name, _ in model.pipeline_units()]
    assert names == ["embed", "blocks.0", "blocks.1", "head"]
    h = x
    for _, unit in model.pipeline_units():
        h = unit(h)
    assert torch.equal(h, model(x))


def test_objective_shifts_targets_by_one():
    batch = torch.arange(10).view(2, 5)
    inputs, targets = split_next_token(batch)
    assert torch.equal(inputs, batch[:, :-1]) and torch.equal(targets, batch[:, 1:])
    logits = torch.full((2, 4, 10), -1e4)
    logits.scatter_(2, targets.unsqueeze(-1), 1e4)
    assert next_token_loss(logits, targets).item() == pytest.approx(0.0, abs=1e-6)


def test_bad_configs_name_the_problem():
    with pytest.raises(ValueError, match="Unknown model config 'gpt5'.*tiny"):
        model_config("gpt5")
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        model_config("tiny", hidden_size=130)
    with pytest.raises(ValueError, match="not divisible by num_kv_heads"):
        model_config("tiny", num_kv_heads=3)


@pytest.mark.slow
def test_causal_lm_learns_a_repeating_sequence():
    torch.manual_seed(0)
    module = CausalLM(vocab_size=257, model_overrides=dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=64))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    batch = torch.arange(17).repeat(4, 1) % 7
    first = None
    for _ in range(30):
        loss = module._loss(batch)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first


def test_rope_tables_are_computed_once_per_forward_and_once_per_stage_and_microbatch(monkeypatch):
    from lightning_async.models import smollm2
    from lightning_async.pipeline.stage import PieceModule
    from _pipeline_harness import rank_runtime

    calls = []
    original = smollm2.rotary_tables
    monkeypatch.setattr(smollm2, "rotary_tables", lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs))
    model = tiny().eval()
    x = torch.randint(0, 257, (4, 9))
    expected = model(x)
    assert len(calls) == 1  # not once per block
    stage = PieceModule(model.pipeline_units())
    assert stage.takes_context == [False, True, True, False]
    calls.clear()
    assert torch.equal(stage(x, model.pipeline_context(x)), expected) and len(calls) == 1
    calls.clear()
    h = x
    for _, unit in model.pipeline_units():  # without a context each block still computes its own tables
        h = unit(h)
    assert torch.equal(h, expected) and len(calls) == 2
    runtime = rank_runtime(model.pipeline_units(), "1f1b", 2, split_next_token, next_token_loss,
                           context_fn=model.pipeline_context)
    calls.clear()
    runtime.train_batch(torch.randint(0, 257, (4, 10)))
    assert len(calls) == 2  # one per micro-batch on this stage
