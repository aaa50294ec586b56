"""The GPT-2 example of docs/models.md (``docs/examples/gpt2_units.py``): units written by hand for a model
without a pipeline plan; they reproduce the model's logits, train, and follow the single-device 2BW rule on 2 and
3 stages (scenarios in ``_hf_oracle.py``, in the spawns shared with the MoE tests)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _hf_oracle import GPT2, check_scenarios, gpt2_example, make_gpt2, reference, spawn_results  # noqa: E402
from lightning_async.models.hf import HFCausalLM  # noqa: E402
from lightning_async.pipeline.partition import partition_units  # noqa: E402
from lightning_async.pipeline.stage import build_stage  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def ids() -> torch.Tensor:
    return torch.randint(0, 257, (3, 16), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_example_units_reproduce_gpt2s_logits(attn):
    module = make_gpt2(attn_implementation=attn)
    names = [name for name, _ in module.pipeline_units()]
    assert names == ["model.transformer.wte", "model.transformer.wpe", *(f"model.transformer.h.{i}" for i in range(4)),
                     "model.transformer.ln_f", "model.lm_head"]
    assert names == [name for name, _ in HFCausalLM.pipeline_units(module)]  # what the built-in layout derives
    for name, unit in module.pipeline_units():  # every unit's weights keep Hugging Face's names
        for pname, p in unit.named_parameters():
            assert module.get_parameter(f"{name}.{pname}") is p
    with torch.no_grad():
        assert (module(ids()) - module.model(input_ids=ids()).logits).abs().max().item() <= 1e-6


def test_a_unit_that_forgets_the_positions_is_refused():
    example = gpt2_example()

    class WithoutPositions(example.GPT2CausalLM):
        def pipeline_units(self):
            return [(n, u) for n, u in super().pipeline_units() if n != "model.transformer.wpe"]

    with pytest.raises(ValueError, match="units of GPT2LMHeadModel do not reproduce its forward pass"):
        WithoutPositions(dict(GPT2))


def test_the_tied_head_is_shared_by_the_first_and_last_stage():
    units = make_gpt2().pipeline_units()
    split = partition_units(units, 3, "uniform")
    first, tied_first = build_stage(units, split, 0)
    last, tied_last = build_stage(units, split, 2)
    assert len(tied_first) == len(tied_last) == 1
    assert first.get_parameter(tied_first[0]) is last.get_parameter(tied_last[0])


@pytest.mark.slow
def test_the_example_script_trains(capsys):
    losses = gpt2_example().main(steps=20)
    assert losses[-1] < losses[0] - 1.0
    assert "model.transformer.wpe" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_gpt2_pipeline_follows_the_single_device_rule(stages):
    per_rank, _ = spawn_results(stages)
    results = check_scenarios(stages, per_rank, {"gpt2"})
    assert len(results) == 2
    for label, worst in results:
        assert worst < 1e-5, f"{label}: max |diff| = {worst}"
    plain = reference("gpt2", "1f1b", "adamw", 0.0)  # negative control: the delay shows in the weights
    delayed = reference("gpt2", "2bw", "adamw", 0.0)
    assert max((plain[n] - delayed[n]).abs().max().item() for n in plain) > 1e-4
