"""Units written by hand, on GPT-2: what ``HFCausalLM``'s built-in GPT-2 layout derives, spelled out.

``GPT2LMHeadModel`` has no pipeline plan; ``HFCausalLM`` knows its layout (``lightning_async.models.hf_layouts``),
and a model it does not know needs ``pipeline_units()`` written once, like this. GPT-2's forward is
``wte(ids) + wpe(positions)`` -> dropout -> ``h.N`` -> ``ln_f`` -> ``lm_head`` (tied to ``wte``). Units must be
modules under their own paths (the other stages replace them by placeholders; the parameter names stay Hugging
Face's), so the learned positions become a unit of their own after the token embedding: ``PositionsAdded``, a
view of ``wpe`` that adds the positions (from the context) and applies the embedding dropout. The blocks are
``DecoderLayerUnit``s (their mask comes from ``pipeline_context``, which needs nothing GPT-2-specific).
``HFCausalLM`` checks at construction that these units reproduce the model's logits.

    python docs/examples/gpt2_units.py          # builds a tiny GPT-2, checks the units, trains 30 steps on 1 device

Tested against the single-device 2BW rule on 2 and 3 stages (``tests/models/test_gpt2_units.py``).
"""

from __future__ import annotations

import torch

from lightning_async.models.hf import DecoderLayerUnit, HFCausalLM, PositionsAdded


class GPT2CausalLM(HFCausalLM):
    """``HFCausalLM`` for GPT-2: token embedding, positions, each block, final norm, head."""

    def pipeline_units(self):
        gpt2 = self.model.transformer
        return [
            ("model.transformer.wte", gpt2.wte),
            ("model.transformer.wpe", PositionsAdded(gpt2.wpe, gpt2.drop)),
            *((f"model.transformer.h.{i}", DecoderLayerUnit(block)) for i, block in enumerate(gpt2.h)),
            ("model.transformer.ln_f", gpt2.ln_f),
            ("model.lm_head", self.model.lm_head),
        ]


TINY_GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=4, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=0)


def main(steps: int = 30) -> list[float]:
    """Train a tiny GPT-2 on random-but-repeating byte sequences for ``steps`` steps; returns the losses."""
    torch.manual_seed(0)
    module = GPT2CausalLM(TINY_GPT2, vocab_size=257, lr=3e-3)
    print("units:", [name for name, _ in module.pipeline_units()])
    optimizer = module.configure_optimizers()["optimizer"]
    data = torch.randint(0, 257, (8, 9)).repeat(1, 4)  # [8, 36]: each row repeats a 9-token pattern
    losses = []
    for _ in range(steps):
        inputs, targets = module.pipeline_split_batch(data)
        loss = module.pipeline_loss(module(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


if __name__ == "__main__":
    main()
