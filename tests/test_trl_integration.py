"""GRPOKernelsTrainer against stock TRL GRPOTrainer: same batch, same weights, same loss and gradients."""

import pathlib

import pytest
import torch
from gloo_ranks import run_ranks

pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")

from datasets import Dataset
from helpers import LOSS_TYPE_REGISTRY, TRL_LOSS_TYPES
from trl import GRPOConfig, GRPOTrainer

from grpo_kernels.integration.trl import GRPOKernelsTrainer
from grpo_kernels.training.tasks import compare

B, G, T = 4, 2, 6


def exact_answer(prompts, completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = compare.build_tokenizer()
    compare.build_model(tokenizer, hidden_size=32, seed=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset():
    rows = compare.make_rows(16, held_out=False, seed=0)
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def _trainer(cls, model_dir, dataset, tmp_path, fused_lm_head=None, **config):
    args = GRPOConfig(
        output_dir=str(tmp_path / cls.__name__),
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=T,
        report_to="none",
        use_cpu=True,
        logging_steps=1,
        max_steps=2,
        bf16=False,
        **config,
    )
    extra = {} if fused_lm_head is None else {"fused_lm_head": fused_lm_head}
    return cls(
        model=model_dir,
        reward_funcs=exact_answer,
        args=args,
        train_dataset=dataset,
        processing_class=compare.build_tokenizer(),
        **extra,
    )


def _batch(trainer, off_policy: bool, beta: float):
    g = torch.Generator().manual_seed(0)
    prompts = [r["prompt"] for r in compare.make_rows(B, held_out=False, seed=1)]
    enc = trainer.processing_class(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    completion_ids = torch.randint(3, 20, (B, T), generator=g)
    lengths = torch.tensor([6, 2, 4, 1])
    completion_mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    batch = {
        "prompt_ids": enc.input_ids,
        "prompt_mask": enc.attention_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum() * 2.0,
    }
    base = -3.0 + 0.1 * torch.randn(B, T, generator=g)
    if off_policy:
        batch["old_per_token_logps"] = base + 0.5 * torch.randn(B, T, generator=g)
    if beta:
        batch["ref_per_token_logps"] = base + 0.3 * torch.randn(B, T, generator=g)
    return batch


def _loss_and_grads(trainer, batch, accumulation):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()], metrics


def assert_same_as_trl(stock, ours, batch, accumulation=1):
    expected_loss, expected_grads, expected_metrics = _loss_and_grads(stock, batch, accumulation)
    loss, grads, metrics = _loss_and_grads(ours, batch, accumulation)
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
    for e, a in zip(expected_grads, grads, strict=True):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-4)
    assert_same_metrics(expected_metrics, metrics)
    return expected_metrics, metrics


CASES = [
    (lt, level, beta, acc)
    for lt in TRL_LOSS_TYPES
    for level in ("token", "sequence")
    for beta, acc in ((0.0, 1), (0.04, 2))
    if level in LOSS_TYPE_REGISTRY[lt].levels
]  # vespo makes its own sequence weight from token ratios


# the default (the fused lm_head) on every case, the logits path on the token level's
PATH_CASES = [(*case, None) for case in CASES] + [(*case, False) for case in CASES if case[1] == "token"]


@pytest.mark.parametrize("loss_type, level, beta, accumulation, fused_lm_head", PATH_CASES)
def test_same_loss_gradients_and_metrics_as_trl(
    model_dir, dataset, tmp_path, loss_type, level, beta, accumulation, fused_lm_head
):
    config = dict(
        loss_type=loss_type,
        beta=beta,
        importance_sampling_level=level,
        temperature=0.9,
        gradient_accumulation_steps=accumulation,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        use_bias_correction_kl=beta > 0 and level == "token",
    )
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, fused_lm_head=fused_lm_head, **config)
    assert ours.fused_lm_head is (fused_lm_head is None)
    assert_same_as_trl(stock, ours, _batch(stock, off_policy=True, beta=beta), accumulation)


def assert_same_metrics(expected_metrics, metrics):
    """Every metric stock TRL logged from the loss, under its name, with its value (TRL's own bookkeeping, such as
    the step time and the token count, is left out)."""
    loss_metrics = (
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "cispo_clip_ratio",
        "vespo/phi_seq_mean",
        "policy_loss",
        "entropy_coef",
        "aux_loss",
    )
    assert {k for k in expected_metrics if k in loss_metrics} == {k for k in metrics if k in loss_metrics}
    for key in loss_metrics:
        if key in expected_metrics:
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6, nan_ok=True), key


def test_on_policy_batch_matches_trl(model_dir, dataset, tmp_path):
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path)
    batch = _batch(stock, off_policy=False, beta=0.0)
    assert_same_as_trl(stock, ours, batch)


@pytest.mark.parametrize(
    "loss_type, level, accumulation",
    [("grpo", "token", 2), ("dapo", "token", 2), ("cispo", "token", 1), ("grpo", "sequence", 2)],
)
@pytest.mark.parametrize("fused_lm_head", [False, True])
def test_entropy_bonus_matches_trl(model_dir, dataset, tmp_path, loss_type, level, accumulation, fused_lm_head):
    """TRL's static entropy bonus (entropy_coef): loss - coef * mean entropy, divided by the accumulation
    steps in training whatever the loss type; from logits and from hidden states."""
    config = dict(
        loss_type=loss_type,
        beta=0.04,
        importance_sampling_level=level,
        temperature=0.9,
        gradient_accumulation_steps=accumulation,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        entropy_coef=0.05,
    )
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, fused_lm_head=fused_lm_head, **config)
    assert_same_as_trl(stock, ours, _batch(stock, off_policy=True, beta=0.04), accumulation)


@pytest.mark.parametrize(
    "loss_type, level, masks",
    [
        ("grpo", "token", dict(top_entropy_quantile=0.5)),
        ("dapo", "token", dict(off_policy_mask_threshold=0.05)),
        ("grpo", "sequence", dict(top_entropy_quantile=0.7, off_policy_mask_threshold=0.05, entropy_coef=0.05)),
        ("cispo", "token", dict(top_entropy_quantile=0.6, entropy_coef=0.05)),
    ],
)
@pytest.mark.parametrize("with_sampler", [False, True])
@pytest.mark.parametrize("fused_lm_head", [False, True])
def test_policy_masks_match_trl(model_dir, dataset, tmp_path, loss_type, level, masks, with_sampler, fused_lm_head):
    """TRL's top-entropy mask and off-policy sequence mask (from the sampler's log-probs when the
    batch has them, a NaN among them counting as no evidence; else from the old log-probs), from
    logits and from hidden states."""
    config = dict(
        loss_type=loss_type,
        beta=0.04,
        importance_sampling_level=level,
        temperature=0.9,
        gradient_accumulation_steps=2,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        **masks,
    )
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, fused_lm_head=fused_lm_head, **config)
    batch = _batch(stock, off_policy=True, beta=0.04)
    if with_sampler:
        g = torch.Generator().manual_seed(3)
        batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + 0.4 * torch.randn(B, T, generator=g)
        batch["sampling_per_token_logps"][0, 1] = float("nan")
    assert_same_as_trl(stock, ours, batch, accumulation=2)


@pytest.mark.parametrize("target", [100.0, 0.01])
def test_adaptive_entropy_follows_trl_step_by_step(model_dir, dataset, tmp_path, target):
    """TRL's adaptive rule: the first window is gated off (no measurement yet), each optimizer-step
    boundary moves the coefficient up (entropy at or below the target) or down, and the next window
    applies it; the loss, gradients and controller state match stock TRL after every step."""
    config = dict(
        loss_type="grpo",
        beta=0.04,
        use_adaptive_entropy=True,
        entropy_coef=0.1,
        entropy_target=target,
        entropy_coef_delta=0.05,
        entropy_coef_min=0.02,
        entropy_coef_max=0.3,
    )
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, **config)
    batch = _batch(stock, off_policy=True, beta=0.04)
    for _ in range(3):
        assert_same_as_trl(stock, ours, batch)
        assert ours.entropy_coef == pytest.approx(stock.entropy_coef)
        assert ours._last_world_entropy == pytest.approx(stock._last_world_entropy, rel=1e-5)
    assert stock.entropy_coef == pytest.approx(0.25 if target > 1 else 0.02)  # it moved, both ways covered


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A tiny Mixtral (2 experts, top-1) with a router auxiliary loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp("tiny-mixtral")
    tokenizer = compare.build_tokenizer()
    torch.manual_seed(2)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=64,
        router_aux_loss_coef=0.02,
        output_router_logits=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    MixtralForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("fused_lm_head", [None, False])
def test_moe_router_auxiliary_loss_matches_trl(moe_dir, dataset, tmp_path, fused_lm_head):
    """TRL adds router_aux_loss_coef x the model's load-balancing loss, divided by the accumulation steps: the
    fused lm_head (the default) from the backbone's router logits, the logits path from the model's forward."""
    config = dict(loss_type="dapo", beta=0.04, gradient_accumulation_steps=2)
    stock = _trainer(GRPOTrainer, moe_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, moe_dir, dataset, tmp_path, fused_lm_head=fused_lm_head, **config)
    assert stock.aux_loss_enabled and ours.aux_loss_enabled
    assert ours.fused_lm_head is (fused_lm_head is None)
    expected_metrics, metrics = assert_same_as_trl(stock, ours, _batch(stock, off_policy=True, beta=0.04), 2)
    assert metrics["aux_loss"] == pytest.approx(expected_metrics["aux_loss"], rel=1e-5)


def test_cast_lm_head_to_fp32_is_the_fused_heads_fp32_precision(model_dir, dataset, tmp_path):
    """With TRL's cast_lm_head_to_fp32 on a bf16 model, the fused lm_head computes in fp32 (head_precision
    "fp32") and equals stock TRL, whose head runs in fp32 too: the loss, every gradient and the metrics."""
    config = dict(cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": torch.bfloat16})
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, fused_lm_head=True, **config)
    assert ours.grpo_loss.head_precision == "fp32"
    assert_same_as_trl(stock, ours, _batch(stock, off_policy=True, beta=0.0), 1)


def test_unsupported_trl_options_raise(model_dir, dataset, tmp_path):
    with pytest.raises(ValueError, match=r"does not support use_adaptive_entropy with top_entropy_quantile < 1"):
        _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, use_adaptive_entropy=True, top_entropy_quantile=0.5)


def test_short_train_runs(model_dir, dataset, tmp_path):
    trainer = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, beta=0.04)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any("clip_ratio/region_mean" in entry for entry in trainer.state.log_history)


@pytest.mark.parametrize("shape", ["token", "sequence"])
def test_vllm_importance_sampling_correction_matches_trl(model_dir, dataset, tmp_path, shape):
    config = dict(beta=0.04, loss_type="dapo")
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, **config)
    batch = _batch(stock, off_policy=True, beta=0.04)
    g = torch.Generator().manual_seed(5)
    batch["importance_sampling_ratio"] = 0.5 + torch.rand((B, T) if shape == "token" else (B, 1), generator=g)
    for trainer in (stock, ours):  # what TRL sets when it samples with vLLM
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    assert_same_as_trl(stock, ours, batch)


def test_vespo_folds_the_vllm_ratio_into_its_weight_as_trl(model_dir, dataset, tmp_path):
    """VESPO takes the rollout ratio into phi(w) instead of multiplying the loss (TRL needs a token mode)."""
    config = dict(beta=0.04, loss_type="vespo", vllm_importance_sampling_mode="token_truncate")
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, **config)
    batch = _batch(stock, off_policy=True, beta=0.04)
    g = torch.Generator().manual_seed(6)
    ratio = 0.7 + 0.6 * torch.rand(B, T, generator=g)
    # padding carries a ratio of 1 (equal old and sampler log-probs there), as TRL's batches do
    batch["importance_sampling_ratio"] = torch.where(batch["completion_mask"].bool(), ratio, 1.0)
    for trainer in (stock, ours):  # what TRL sets when it samples with vLLM
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    assert_same_as_trl(stock, ours, batch)


def _trl_rank(rank, world, model_dir, loss_type):
    import tempfile

    import torch.distributed as dist

    rows = compare.make_rows(16, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = _trainer(GRPOKernelsTrainer, model_dir, dataset, pathlib.Path(tempfile.mkdtemp()), loss_type=loss_type)
    stock = _trainer(GRPOTrainer, model_dir, dataset, pathlib.Path(tempfile.mkdtemp()), loss_type=loss_type)
    assert trainer.accelerator.num_processes == world
    batch = _batch(trainer, off_policy=True, beta=0.0)
    half = B // world
    local = {k: (v[rank * half : (rank + 1) * half] if v.dim() > 0 else v) for k, v in batch.items()}
    # stock TRL on the same two processes: the same local loss and gradients, the same gathered metrics
    # (clip_ratio/low_min and high_max over both ranks' sequences)
    assert_same_as_trl(stock, trainer, local)
    _, grads, _ = _loss_and_grads(trainer, local, 1)
    for g in grads:
        dist.all_reduce(g)
        g /= world
    return grads


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_two_processes_match_one_process_on_the_trl_path(model_dir, dataset, tmp_path, loss_type):
    """dapo's num_items_in_batch / num_processes and grpo's per-sequence means across 2 gloo ranks; each rank's
    loss, gradients and gathered metrics equal stock TRL's on the same two ranks."""
    per_rank = run_ranks(_trl_rank, 2, model_dir, loss_type)
    single = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, loss_type=loss_type)
    _, expected, _ = _loss_and_grads(single, _batch(single, off_policy=True, beta=0.0), 1)
    for grads in per_rank:
        for e, a in zip(expected, grads, strict=True):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])  # fused_lm_head=True as the default (auto) resolves it
def test_fused_lm_head_option_matches_trl(model_dir, dataset, tmp_path, loss_type):
    config = dict(loss_type=loss_type, beta=0.04, **({"epsilon_high": 5.0} if loss_type == "cispo" else {}))
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    args = GRPOConfig(
        output_dir=str(tmp_path / "fused"),
        per_device_train_batch_size=B,
        num_generations=G,
        max_completion_length=T,
        report_to="none",
        use_cpu=True,
        bf16=False,
        **config,
    )
    ours = GRPOKernelsTrainer(
        model=model_dir,
        reward_funcs=exact_answer,
        args=args,
        train_dataset=dataset,
        processing_class=compare.build_tokenizer(),
        fused_lm_head=True,
    )
    batch = _batch(stock, off_policy=True, beta=0.04)
    assert_same_as_trl(stock, ours, batch)


def _varied_reward(prompts, completions, **_):
    """A reward that differs within a group (a completion's length mod 3), so that the first step's
    advantages, and with them every gradient compared below, are not zero."""
    return [float(len(c) % 3) for c in completions]


def _ddp_train_rank(rank, world, model_dir):
    """One optimizer step of GRPOKernelsTrainer.train() as accelerate runs it on 2 processes (the model wrapped
    in DistributedDataParallel), with the fused lm_head and without: the gradients at the optimizer step."""
    import tempfile

    from transformers import TrainerCallback

    rows = compare.make_rows(16, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    class GradientsAtStep(TrainerCallback):
        def __init__(self):
            self.grads = None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = [p.grad.detach().clone() for p in unwrapped(model).parameters()]

    def unwrapped(model):
        return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model

    results = {}
    for fused in (False, True):
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=B,
            num_generations=G,
            max_completion_length=T,
            report_to="none",
            use_cpu=True,
            logging_steps=1,
            max_steps=1,
            bf16=False,
            beta=0.04,
            seed=7,
            save_strategy="no",
        )
        callback = GradientsAtStep()
        trainer = GRPOKernelsTrainer(
            model=model_dir,
            reward_funcs=_varied_reward,
            args=args,
            train_dataset=dataset,
            processing_class=compare.build_tokenizer(),
            fused_lm_head=fused,
            callbacks=[callback],
        )
        trainer.train()
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        loss = next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)
        results[fused] = (loss, callback.grads)
    return results


def test_fused_lm_head_trains_under_ddp_as_accelerate_launches_it(model_dir):
    """2 gloo ranks, the model wrapped in DDP by accelerate: the fused lm_head runs inside the wrapper's forward
    (no get_decoder on the wrapper), and the first step's loss and all-reduced gradients are the logits path's."""
    for results in run_ranks(_ddp_train_rank, 2, model_dir, timeout=600):
        (loss, grads), (fused_loss, fused_grads) = results[False], results[True]
        assert sum(float(g.abs().sum()) for g in grads) > 0, "a zero gradient would make the comparison vacuous"
        assert fused_loss == pytest.approx(loss, rel=1e-4, abs=1e-6)
        for e, a in zip(grads, fused_grads, strict=True):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-4)


def _fsdp2_adapter_rank(rank, world, model_dir):
    """The adapter's fused lm_head loss (its hidden-state pass and loss, as compute_loss runs them) on a model
    sharded with FSDP2's fully_shard (every decoder layer and the root), against the same trainer unsharded."""
    import tempfile

    from torch.distributed.fsdp import fully_shard

    rows = compare.make_rows(16, held_out=False, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    reference = _trainer(
        GRPOKernelsTrainer, model_dir, dataset, pathlib.Path(tempfile.mkdtemp()), fused_lm_head=False, beta=0.04
    )
    sharded = _trainer(
        GRPOKernelsTrainer, model_dir, dataset, pathlib.Path(tempfile.mkdtemp()), fused_lm_head=True, beta=0.04
    )
    batch = _batch(reference, off_policy=True, beta=0.04)  # the same batch on both ranks
    expected_loss, expected_grads, _ = _loss_and_grads(reference, batch, 1)
    for layer in sharded.model.model.layers:
        fully_shard(layer)
    fully_shard(sharded.model)
    sharded.model.train()
    sharded.current_gradient_accumulation_steps = 1
    loss = sharded.compute_loss(sharded.model, dict(batch))
    loss.backward()
    grads = [p.grad.full_tensor() for p in sharded.model.parameters()]
    return loss.detach(), expected_loss, grads, expected_grads


def test_fused_lm_head_under_fsdp2_through_the_adapter(model_dir):
    for loss, expected_loss, grads, expected_grads in run_ranks(_fsdp2_adapter_rank, 2, model_dir, timeout=600):
        torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-5)
        assert len(grads) == len(expected_grads)
        for e, a in zip(expected_grads, grads, strict=True):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("fused_lm_head", [None, False])
def test_a_tool_mask_runs_on_the_models_tokens_alone(model_dir, dataset, tmp_path, fused_lm_head, monkeypatch):
    """TRL's tool mask (0 at a tool's output tokens) multiplies the completion mask, as stock TRL's loss does: with
    most tokens a tool's, our loss runs on the model's tokens alone (the active-token compaction: nothing to set),
    and equals stock TRL's loss, gradients and metrics, from hidden states and from logits."""
    from grpo_kernels import inputs as call_inputs

    compacted, real = [], call_inputs.active_tokens

    def counted(*args, **kwargs):
        active = real(*args, **kwargs)
        compacted.append(active is not None)
        return active

    monkeypatch.setattr(call_inputs, "active_tokens", counted)
    config = dict(beta=0.04, temperature=0.9)
    stock = _trainer(GRPOTrainer, model_dir, dataset, tmp_path, **config)
    ours = _trainer(GRPOKernelsTrainer, model_dir, dataset, tmp_path, fused_lm_head=fused_lm_head, **config)
    batch = _batch(stock, off_policy=True, beta=0.04)
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[0, 1:5] = tool_mask[2, 1:4] = 0  # the model's 13 tokens become 6 of 24: a tool answered in between
    batch["tool_mask"] = tool_mask
    assert_same_as_trl(stock, ours, batch)
    assert any(compacted), "the tool-masked call did not run on its active tokens"
