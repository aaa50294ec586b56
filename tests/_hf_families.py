"""Tiny random configs of the Hugging Face decoder families ``HFCausalLM`` claims (transformers 5.x), for the
family sweep of ``tests/models/test_hf_families.py``: two decoder layers, hidden 32, vocabulary 257, no dropout or router noise (so a
pipeline run and its single-device reference draw no random numbers), one spawn running a 2-stage 2BW run of
every family, and its reference: the plain Hugging Face model trained through its own forward (:func:`sweep_reference`)."""

from __future__ import annotations

VOCAB = 257
SHAPE = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=None, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)

FAMILIES: dict[str, dict] = {
    "llama": dict(SHAPE, model_type="llama"),
    "mistral": dict(SHAPE, model_type="mistral"),
    "qwen2": dict(SHAPE, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(SHAPE, model_type="qwen3"),
    "gemma": dict(SHAPE, model_type="gemma", head_dim=8),
    "gemma2": dict(SHAPE, model_type="gemma2", head_dim=8, sliding_window=4, final_logit_softcapping=0.5),  # a cap the tiny logits reach
    "gemma3": dict(SHAPE, model_type="gemma3_text", head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "cohere": dict(SHAPE, model_type="cohere", logit_scale=0.5),
    "cohere2": dict(SHAPE, model_type="cohere2", logit_scale=0.5, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(SHAPE, model_type="granite", embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0),
    "phi": dict(SHAPE, model_type="phi"),
    "phi3": dict(SHAPE, model_type="phi3"),
    "olmo": dict(SHAPE, model_type="olmo"),
    "olmo2": dict(SHAPE, model_type="olmo2"),
    "olmo3": dict(SHAPE, model_type="olmo3", sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "stablelm": dict(SHAPE, model_type="stablelm"),
    "smollm3": dict(SHAPE, model_type="smollm3"),
    "starcoder2": dict(SHAPE, model_type="starcoder2"),
    "glm4": dict(SHAPE, model_type="glm4"),
    "glm": dict(SHAPE, model_type="glm"),
    "gpt_neox": dict(SHAPE, model_type="gpt_neox"),
    "gptj": dict(model_type="gptj", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4),
    "gpt2": dict(model_type="gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": dict(model_type="opt", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0),
    "falcon": dict(model_type="falcon", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "bloom": dict(model_type="bloom", vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4),
    "mixtral": dict(SHAPE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1),
    "qwen2_moe": dict(SHAPE, **MOE, model_type="qwen2_moe", moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(SHAPE, **MOE, model_type="qwen3_moe", moe_intermediate_size=32),
    "olmoe": dict(SHAPE, **MOE, model_type="olmoe"),
}
FAMILIES.update({
    "deepseek_v3": dict(SHAPE, model_type="deepseek_v3", num_key_value_heads=4,  # MLA: no grouped keys
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8),
    "gpt_oss": dict(SHAPE, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=4,
                    output_router_logits=True, router_aux_loss_coef=0.1),
})
FAMILIES.update({  # variants whose forward takes another path
    "falcon-alibi": dict(FAMILIES["falcon"], alibi=True),
    "falcon-new-arch": dict(FAMILIES["falcon"], new_decoder_architecture=True, num_kv_heads=2),
    "opt-projected": dict(FAMILIES["opt"], word_embed_proj_dim=16),
    "opt-post-norm": dict(FAMILIES["opt"], do_layer_norm_before=False),
})


SWEEP_STEPS = 3
SWEEP_MICROBATCHES = 2
SWEEP_CLIP = 1.0


def make_family(name: str, seed: int = 0, microbatches: int | None = None, **kwargs):
    """``HFCausalLM`` of family ``name`` (same weights every call); a mixture of experts attaches its router losses
    per micro-batch of ``microbatches``, as under the pipeline."""
    import torch

    from lightning_async.models.hf import HFCausalLM

    torch.manual_seed(seed)
    module = HFCausalLM(dict(FAMILIES[name]), **kwargs)
    if module.moe is not None and microbatches:
        module.moe.loss.one_forward_per_microbatch(microbatches)
    return module


def sweep_workload(name: str):
    from functools import partial

    from _pipeline_harness import Workload, eval_batch, make_batches

    return Workload(partial(make_family, name, microbatches=SWEEP_MICROBATCHES), make_batches, eval_batch)


def sweep_runs(names: list[str]) -> list:
    """Inside a 2-process gloo group: a 2-stage 2BW AdamW run of each family (clipping at 1.0)."""
    from _pipeline_harness import pipeline_run

    return [pipeline_run(2, "2bw", "adamw", 0.0, SWEEP_STEPS, SWEEP_CLIP, m=SWEEP_MICROBATCHES, workload=sweep_workload(name))
            for name in names]


def dropout_modes_under_async_pipe() -> list[tuple[int, bool, bool]]:
    """Inside a 2-process gloo group: a 2-step ``async_pipe`` fit (with validation) of a GPT-2 with dropout, as
    torchrun starts ranks; ``(block, grad enabled, dropout in train mode)`` for each kind of forward a block's
    dropout saw on this rank."""
    import lightning as L
    import torch
    from _pipeline_harness import as_torchrun
    from test_strategy import TinyData

    from lightning_async.models.hf import HFCausalLM
    from lightning_async.strategies import AsyncPipelineStrategy

    as_torchrun()
    L.seed_everything(0)
    module = HFCausalLM(dict(FAMILIES["gpt2"], resid_pdrop=0.3), lr=1e-3)
    seen = set()
    for i, block in enumerate(module.model.transformer.h):
        block.mlp.dropout.register_forward_pre_hook(lambda mod, args, i=i: seen.add((i, torch.is_grad_enabled(), mod.training)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=AsyncPipelineStrategy(n_microbatches=2), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=1, val_check_interval=1, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=TinyData())
    return sorted(seen)


def sweep_spawn(names: list[str]) -> dict:
    """One spawn for the sweep: every family's 2BW run, then the dropout modes under ``async_pipe``."""
    return {"sweep": sweep_runs(names), "modes": dropout_modes_under_async_pipe()}


def own_forward_model(name: str):
    """Family ``name``'s Hugging Face model (the weights of :func:`make_family`) trained through **its own forward**
    (``model(input_ids=...)``), none of our units or context: the sweep's reference. The module keeps the model
    under ``model``, so its parameter names are ``HFCausalLM``'s. Its forward returns ``(logits, router losses)``:
    for a mixture of experts with router losses on, the documented per-layer objective (docs/models.md, Example 4;
    Hugging Face's own ``aux_loss`` pools every layer's router logits, which no pipeline stage holds) computed
    from the router logits the model's forward returns; ``None`` otherwise and in evaluation."""
    import torch

    from lightning_async.models.moe import balance_and_z_losses

    module = make_family(name)

    class OwnForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = module.model
            self.moe = module.moe  # (a dataclass, not a module: no parameters of its own)

        def forward(self, input_ids):
            out = self.model(input_ids=input_ids, use_cache=False)
            moe = self.moe
            if moe is None or not moe.loss.active or not torch.is_grad_enabled():
                return out.logits, None
            routers = out.router_logits
            assert len(routers) == moe.loss.moe_layers, (name, len(routers), moe.loss.moe_layers)
            losses = [moe.loss.layer_loss(*balance_and_z_losses(r.reshape(-1, r.shape[-1]), moe.top_k)[:2]) for r in routers]
            return out.logits, sum(losses)

    return OwnForward()


def own_forward_loss(output, targets):
    """The next-token loss of :func:`own_forward_model`'s output, plus its router losses when it has them."""
    from lightning_async.models.objective import next_token_loss

    logits, router = output
    loss = next_token_loss(logits, targets)
    return loss if router is None else loss + router


def own_forward_workload(name: str):
    from functools import partial

    from _pipeline_harness import Workload, eval_batch, make_batches

    return Workload(partial(own_forward_model, name), make_batches, eval_batch, loss=own_forward_loss)


def train_on_one_device(workload, delay: int = 1, clip: float | None = SWEEP_CLIP) -> dict:
    """``workload`` trained on one device by the sweep's rule: ``DelayedOptimizer(AdamW, delay=1, pairing="2bw")``
    on the sweep's batches and micro-batches, clipping at ``clip`` (``delay=0``: plain training, a control)."""
    from _pipeline_harness import reference_run

    return reference_run("adamw", delay, 0.0, SWEEP_STEPS, clip, microbatches=SWEEP_MICROBATCHES, workload=workload)


def sweep_reference(name: str, delay: int = 1, clip: float | None = SWEEP_CLIP) -> dict:
    """The single-device rule the sweep's run of ``name`` must follow: the plain Hugging Face model, through its own
    forward (:func:`own_forward_model`), trained by :func:`train_on_one_device`."""
    return train_on_one_device(own_forward_workload(name), delay, clip)


ROUTED = dict(output_router_logits=True, router_aux_loss_coef=0.1)
FAMILIES.update({  # families whose plan (or the common or GPT-2 layout) needs nothing more
    name: dict(SHAPE, head_dim=8, model_type=name)
    for name in ["nemotron", "exaone4", "helium", "ministral", "apertus", "arcee", "hunyuan_v1_dense", "internlm3", "ernie4_5",
                 "vaultgemma"]
})
FAMILIES.update({
    "seed_oss": dict(SHAPE, head_dim=8, model_type="seed_oss", attention_dropout=0.0, residual_dropout=0.0),
    "gpt_bigcode": dict(SHAPE, model_type="gpt_bigcode", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    **{name: dict(SHAPE, **ROUTED, head_dim=8, model_type=name)
       for name in ["granitemoe", "granitemoeshared", "cohere2_moe", "phimoe"]},
    "phimoe": dict(SHAPE, **ROUTED, head_dim=8, model_type="phimoe", router_jitter_noise=0.0, input_jitter_noise=0.0),  # no noise
    "jetmoe": dict(SHAPE, head_dim=8, model_type="jetmoe"),  # two routers per layer: without router losses (see the test)
})


def forward_difference(name: str) -> float:
    """Max |units - Hugging Face logits| of family ``name`` on one device, over SDPA and eager attention."""
    import torch

    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    worst = 0.0
    for attn in ("sdpa", "eager"):
        module = make_family(name, attn_implementation=attn)
        module.eval()
        with torch.no_grad():
            worst = max(worst, (module(x) - module.model(input_ids=x).logits).abs().max().item())
    return worst


def print_measurements() -> None:
    """``| config | class | forward | 2BW |`` rows of docs/models.md's family table, measured as the tests do."""
    import torch
    from _pipeline_harness import spawn

    torch.set_num_threads(1)
    names = list(FAMILIES)
    per_rank = spawn(2, sweep_runs, names, timeout=900)
    for index, name in enumerate(names):
        expected = sweep_reference(name)
        got = {k: v for rank in per_rank for k, v in rank[index][0].items()}
        worst = max((got[n] - expected[n]).abs().max().item() for n in got)
        print(f"| {name} | {type(make_family(name).model).__name__} | {forward_difference(name):.0e} | {worst:.0e} |")


if __name__ == "__main__":  # python tests/_hf_families.py (from the repository root)
    import sys
    import warnings

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    warnings.filterwarnings("ignore")
    print_measurements()
