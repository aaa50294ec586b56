"""Mixture of experts: the per-layer router losses (against Hugging Face's loss and an independent formula), the
micro-batch scaling, expert statistics, pickling for the spawn launcher, and the pipeline oracle on 2 and 3
stages (the spawns are shared with the GPT-2 example's tests: ``_hf_oracle.py``).

Tiny random Mixtral and Qwen2-MoE configs (hidden 32, 4 experts, top-2); nothing is downloaded.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from _hf_oracle import (  # noqa: E402
    LIGHTNING_FIT_STEPS, MIXTRAL, MOE_CONFIGS, QWEN2_MOE, VOCAB, check_scenarios, lightning_fit, make_moe, merged_weights,
    reference, spawn_results,
)
from lightning_async.callbacks import DelaySimulation  # noqa: E402
from lightning_async.models.moe_logging import expert_scalars  # noqa: E402
from lightning_async.models.hf import HFCausalLM, MoEDecoderLayerUnit  # noqa: E402
from lightning_async.models.moe import AttachLoss, balance_and_z_losses  # noqa: E402
from lightning_async.pipeline.boundary import split_rows  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden"),
    pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before"),
]
TOL = 1e-6


def batch(rows: int = 4, length: int = 17, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def grads_of(module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def independent_objective(module: HFCausalLM, data: torch.Tensor, chunks: int) -> torch.Tensor:
    """CE + (1/L) sum_l mean over ``chunks`` micro-batches of (aux * balance + z * z-loss), written here from the
    router logits Hugging Face's own forward returns (``output_router_logits=True``), not from our layers."""
    config = module.model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    top_k = config.num_experts_per_tok
    inputs, targets = data[:, :-1], data[:, 1:]
    out = module.model(input_ids=inputs, output_router_logits=True, use_cache=False)
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
    per_layer = []
    for logits in out.router_logits:
        terms = []
        for part in logits.float().chunk(chunks):  # rows are (sequence, position) in batch order
            probs = part.softmax(-1)
            top = probs.topk(top_k, dim=-1).indices.flatten()
            share = torch.zeros(experts).index_add_(0, top, torch.ones(top.numel())) / part.shape[0]
            balance = experts * (share * probs.mean(0)).sum()
            z = torch.logsumexp(part, dim=-1).pow(2).mean()
            terms.append(config.router_aux_loss_coef * balance + getattr(config, "router_z_loss_coef", 0.0) * z)
        per_layer.append(torch.stack(terms).mean())
    return loss + torch.stack(per_layer).mean()


def module_loss(module: HFCausalLM, data: torch.Tensor) -> torch.Tensor:
    inputs, targets = module.pipeline_split_batch(data)
    return module.pipeline_loss(module(inputs), targets)


# ---- the objective ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_one_moe_layer_and_one_microbatch_is_hugging_faces_loss(name):
    """For one MoE layer and one micro-batch the per-layer loss is Hugging Face's global one: same gradients."""
    config = dict(MOE_CONFIGS[name], num_hidden_layers=1, mlp_only_layers=[])
    module = make_moe(config)
    data = batch()[:, :-1]
    reference = module.model(input_ids=data, labels=data, use_cache=False).loss  # CE + coef * aux (HF shifts labels)
    expected = grads_of(module, reference)
    logits = module(data)
    ours = grads_of(module, F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:, 1:].flatten()))
    assert max_diff(ours, expected) <= TOL
    plain = make_moe(dict(config, output_router_logits=False))  # negative control: the aux loss is in the gradient
    logits = plain(data)
    assert max_diff(grads_of(plain, F.cross_entropy(logits[:, :-1].flatten(0, 1), data[:, 1:].flatten())), expected) > 1e-5


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
@pytest.mark.parametrize("z_coef", [0.0, 0.01], ids=["aux", "aux+z"])
def test_per_layer_loss_is_the_documented_objective_on_one_device_and_per_microbatch(name, z_coef):
    """The gradient of the attached losses is that of the formula, whether a forward holds the whole batch cut into
    m micro-batches (one device) or one of m micro-batches whose loss is divided by m (the pipeline's runtime)."""
    m = 2
    config = dict(MOE_CONFIGS[name], router_z_loss_coef=z_coef)
    module = make_moe(config, aux_loss_microbatches=m)
    data = batch()
    expected = grads_of(module, independent_objective(module, data, chunks=m))
    whole = grads_of(module, module_loss(module, data))
    assert max_diff(whole, expected) <= TOL
    module.moe.loss.one_forward_per_microbatch(m)
    per_microbatch = grads_of(module, sum(module_loss(module, part) / m for part in split_rows(data, m)))
    assert max_diff(per_microbatch, expected) <= TOL
    unchunked = grads_of(module, independent_objective(module, data, chunks=1))  # negative control: chunks matter
    assert max_diff(whole, unchunked) > 1e-4


def test_qwen2_moe_counts_only_its_moe_layers():
    module = make_moe(QWEN2_MOE)
    units = dict(module.pipeline_units())
    sparse = [name for name, unit in units.items() if isinstance(unit, MoEDecoderLayerUnit)]
    assert sparse == [f"model.model.layers.{i}" for i in (1, 2, 3)]  # layer 0 is dense (mlp_only_layers)
    assert module.moe.loss.moe_layers == 3 and module.moe.top_k == 2


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_coefficient_zero_trains_the_plain_model(name):
    module = make_moe(dict(MOE_CONFIGS[name], router_aux_loss_coef=0.0))
    data = batch()
    inputs, targets = data[:, :-1], data[:, 1:]
    plain = grads_of(module, F.cross_entropy(module.model(input_ids=inputs).logits.flatten(0, 1), targets.flatten()))
    assert max_diff(grads_of(module, module_loss(module, data)), plain) <= TOL
    weighted = make_moe(MOE_CONFIGS[name])  # negative control: with the coefficient, the gradient moves
    assert max_diff(grads_of(weighted, module_loss(weighted, data)), plain) > 1e-5


def test_attach_loss_adds_the_scaled_gradient_and_passes_the_output():
    out = torch.randn(3, requires_grad=True)
    aux = torch.tensor(2.0, requires_grad=True)
    y = AttachLoss.apply(out, aux * aux, 0.25)
    assert torch.equal(y, out)
    y.sum().backward()
    assert torch.equal(out.grad, torch.ones(3)) and aux.grad.item() == pytest.approx(0.25 * 2 * 2.0)


def test_balance_loss_is_top_k_when_balanced_and_the_load_sees_collapse():
    experts, top_k = 4, 2
    uniform = torch.zeros(8, experts)
    balance, z, tokens = balance_and_z_losses(uniform, top_k)
    assert balance.item() == pytest.approx(top_k) and z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2)
    collapsed = torch.tensor([[5.0, 4.0, 0.0, 0.0]]).repeat(8, 1)
    balance, _, tokens = balance_and_z_losses(collapsed, top_k)
    assert tokens.tolist() == [8, 8, 0, 0] and balance.item() > top_k
    with pytest.raises(ValueError, match=r"batch size must be a multiple of the MoE's aux_loss_microbatches \(3\)"):
        balance_and_z_losses(uniform, top_k, chunks=3)


def test_a_moe_without_output_router_logits_is_warned_about():
    with pytest.warns(UserWarning, match="without router load balancing.*output_router_logits: true"):
        module = make_moe(dict(MIXTRAL, output_router_logits=False))
    assert not module.moe.loss.active


def test_aux_loss_microbatches_must_match_the_pipeline():
    module = make_moe(MIXTRAL, aux_loss_microbatches=2)
    assert module._aux_loss_microbatches(2) == 2
    with pytest.raises(ValueError, match=r"aux_loss_microbatches=2, but this pipeline .* 4 micro-batches.*set aux_loss_microbatches to 4"):
        module._aux_loss_microbatches(4)
    with pytest.raises(ValueError, match="aux_loss_microbatches must be a positive integer"):
        make_moe(MIXTRAL, aux_loss_microbatches=0)


# ---- statistics ------------------------------------------------------------------------------------
def test_statistics_are_recorded_in_training_forwards_only():
    module = make_moe(QWEN2_MOE)
    module.router_statistics.read()
    with torch.no_grad():
        module(batch()[:, :-1])  # evaluation: nothing recorded
    assert module.router_statistics.read() == {}
    module_loss(module, batch())
    module_loss(module, batch(seed=4))
    means = module.router_statistics.read()
    assert sorted(means) == [1, 2, 3]
    assert all(1.0 <= v["load"] <= 2.0 and v["aux_loss"] > 0 for v in means.values())  # load <= E / top_k
    scalars = expert_scalars(means, stage=1)
    assert scalars["experts/stage1/max_load"] == max(v["load"] for v in means.values())
    assert scalars["experts/layer2/aux_loss"] == means[2]["aux_loss"]


# ---- pickling (the spawn launcher) -----------------------------------------------------------------
def test_a_moe_pickles_after_a_forward_that_recorded_router_logits():
    """Hugging Face installs local (unpicklable) capture hooks in a forward with output_router_logits; before the
    fix the spawn launcher died with "Can't pickle local object ...output_capturing_hook"."""
    module = make_moe(MIXTRAL)
    data = batch()[:, :-1]
    first = module.model(input_ids=data, output_router_logits=True).router_logits
    copy = pickle.loads(pickle.dumps(module))
    again = copy.model(input_ids=data, output_router_logits=True).router_logits  # the hooks come back when needed
    assert len(again) == len(first) == 4 and all(torch.equal(a, b) for a, b in zip(again, first))


def test_an_unpicklable_hook_of_ones_own_is_refused_by_name():
    module = make_moe(MIXTRAL)

    def my_hook(mod, args, out):
        return out

    module.model.model.norm.register_forward_hook(my_hook)
    with pytest.raises(TypeError, match=r"'model.norm' has a hook .*my_hook.*start_method='popen'"):
        pickle.dumps(module)


# ---- one device through Lightning ------------------------------------------------------------------
@pytest.mark.slow
def test_delay_simulation_trains_a_moe_by_the_delayed_rule():
    from test_callbacks import LRS, STEPS, TRAIN, WEIGHT_DECAY, make_trainer, train_loader, weights
    from test_callbacks import max_diff as weight_diff
    from test_hf import hf_reference_of

    kwargs = dict(aux_loss_microbatches=2, lr=LRS["adamw"], weight_decay=WEIGHT_DECAY)
    module = make_moe(MIXTRAL, **kwargs)
    make_trainer([DelaySimulation(1)]).fit(module, train_loader())  # (the module's hooks record expert statistics too)
    expected = hf_reference_of(lambda: make_moe(MIXTRAL, **kwargs), "adamw", 1, 0.0)
    assert weight_diff(weights(module), expected[-1]) <= TOL
    assert len(TRAIN) == STEPS


# ---- the pipeline (slow: the spawns of _hf_oracle.py) ----------------------------------------------
MOE_WORKLOADS = {"mixtral", "mixtral-coef0", "qwen2-moe"}


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_moe_pipeline_follows_the_single_device_rule_with_the_same_per_layer_loss(stages):
    per_rank, _ = spawn_results(stages)
    results = check_scenarios(stages, per_rank, MOE_WORKLOADS)
    assert len(results) == (5 if stages == 2 else 4)
    for label, worst in results:
        assert worst < 1e-5, f"{label}: max |diff| = {worst}"
    if stages == 2:  # negative control: the router losses move the weights (coefficient 0 is the plain model)
        with_loss = merged_weights(per_rank, 0)
        plain = reference("mixtral-coef0", "2bw", "adamw", 0.0)
        assert max((with_loss[n] - plain[n]).abs().max().item() for n in with_loss) > 1e-4


@pytest.mark.slow
def test_async_pipe_fit_of_a_moe_equals_the_delay_simulation_and_logs_both_stages_experts():
    """Through Lightning: setup() scales the router losses per micro-batch (the run equals one device's
    DelaySimulation with aux_loss_microbatches = n_microbatches), and each stage logs its own layers' statistics
    into the run directory that compare reads."""
    from lightning_async.compare.events import read_scalars

    per_rank, run_dir = spawn_results(2)
    got = {}
    for rank in per_rank:
        got.update(rank["lightning"])
    expected = lightning_fit("auto", 1, callbacks=[DelaySimulation(1)])
    assert max_diff(got, expected) < 1e-5
    scalars = read_scalars(run_dir)
    steps = [step for step, _ in scalars["train/loss"]]
    for layer in range(4):  # layers 0-1 on stage 0, 2-3 on stage 1 (uniform split of 7 units)
        points = scalars[f"experts/layer{layer}/load"]
        assert len(points) == LIGHTNING_FIT_STEPS and all(1.0 <= value <= 2.0 for _, value in points)
    for stage in (0, 1):  # at the steps Lightning files the loss under (2BW reports step 0's loss late: none there)
        assert [s for s, _ in scalars[f"experts/stage{stage}/aux_loss"]] == list(range(LIGHTNING_FIT_STEPS))
    assert steps == list(range(1, LIGHTNING_FIT_STEPS))


@pytest.mark.slow
def test_the_moe_recipe_fits_a_pipeline_from_the_cli_logs_experts_and_exports(tmp_path, capsys):
    """``--config quickstart --config models/hf-moe-tiny --config pipeline/async``: the loss falls, both stages'
    expert statistics reach TensorBoard (HFCausalLM's own hooks log them), the checkpoint exports."""
    from test_cli import REPO
    from test_hf import check_export, fit_from_the_cli

    from lightning_async.compare.events import read_scalars
    from lightning_async.pipeline.checkpoint import consolidate, stage_files

    run_dir = fit_from_the_cli(tmp_path, "--config", str(REPO / "recipes/pipeline/async.yaml"), "--data.seq_len", "64",
                               recipe="hf-moe-tiny")
    scalars = read_scalars(run_dir)
    losses = [value for _, value in scalars["train/loss"]]
    assert len(losses) == 7 and losses[-1] < losses[0] - 0.5, losses
    assert {f"experts/layer{i}/load" for i in range(4)} | {"experts/stage0/aux_loss", "experts/stage1/aux_loss"} <= set(scalars)
    checkpoint = run_dir / "checkpoints/last.ckpt"
    hparams = torch.load(stage_files(checkpoint)[-1], weights_only=False)["hyper_parameters"]
    capsys.readouterr()
    check_export(checkpoint, consolidate(checkpoint), hparams, tmp_path / "hf")
    assert "byte-level" in capsys.readouterr().out
