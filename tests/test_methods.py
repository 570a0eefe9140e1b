"""SFT, RFT and DPO on the fused kernels against their plain references; the reward-model loss."""

import pytest
import torch
from helpers import assert_close, make_batch

from grpo_kernels import methods as family

BACKENDS = ["torch", "triton"]
TOL = dict(atol=1e-6, rtol=1e-5)


def _grad(fn, logits, *args, **kwargs):
    leaf = logits.detach().clone().requires_grad_()
    out = fn(leaf, *args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strided", [False, True])
def test_sft_matches_reference(device, backend, strided):
    b = make_batch(device=device, seed=1, strided=strided)
    args = (b["logits"], b["completion_ids"], b["completion_mask"])
    expected, expected_grad = _grad(family.sft_loss_reference, *args, temperature=0.8)
    loss, grad = _grad(family.sft_loss, *args, temperature=0.8, backend=backend)
    assert_close("loss", expected, loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rft_matches_reference_and_ignores_rejected_completions(device, backend):
    b = make_batch(device=device, seed=2)
    rewards = torch.tensor([1.0, 0.0, 1.0], device=device)
    args = (b["logits"], b["completion_ids"], b["completion_mask"], rewards)
    expected, expected_grad = _grad(family.rft_loss_reference, *args)
    loss, grad = _grad(family.rft_loss, *args, backend=backend)
    assert_close("loss", expected, loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)
    assert torch.count_nonzero(grad[1]) == 0  # GC = 0: an incorrect completion teaches nothing
    with pytest.raises(ValueError, match="rewards must be \\[B\\] of 0 / 1"):
        family.rft_loss(
            b["logits"], b["completion_ids"], b["completion_mask"], torch.tensor([1.0, 0.5, 0.0], device=device)
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_dpo_matches_reference_and_its_gradient_coefficient(device, backend):
    b = make_batch(B=4, device=device, seed=3)
    b["completion_mask"][3] = 1  # make_batch masks its last row fully; keep every pair scored here
    args = (b["logits"], b["completion_ids"], b["completion_mask"], b["ref_logps"])
    expected, expected_grad = _grad(family.dpo_loss_reference, *args, beta=0.5)
    loss, grad = _grad(family.dpo_loss, *args, beta=0.5, backend=backend)
    assert_close("loss", expected, loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)
    # The table's GC: d loss / d logp_t = -beta * sigmoid(beta (R- - R+)) / (B |o+|) on chosen tokens.
    from grpo_kernels.reference import token_logprobs_and_entropy

    lp, _ = token_logprobs_and_entropy(b["logits"], b["completion_ids"])
    lp = lp.requires_grad_()
    mask = b["completion_mask"].float()
    dpo, _ = family.dpo_from_logps(lp, b["ref_logps"], mask, 0.5)
    (g,) = torch.autograd.grad(dpo, lp)
    R = ((lp - b["ref_logps"]) * mask).sum(-1) / mask.sum(-1)
    coef = 0.5 * torch.sigmoid(0.5 * (R[2:] - R[:2]))
    expected_g_chosen = -(coef / (2 * mask[:2].sum(-1))).unsqueeze(-1) * mask[:2]
    assert_close("GC on chosen", expected_g_chosen, g[:2], atol=1e-7, rtol=1e-5)
    expected_g_rejected = (coef / (2 * mask[2:].sum(-1))).unsqueeze(-1) * mask[2:]
    assert_close("GC on rejected", expected_g_rejected, g[2:], atol=1e-7, rtol=1e-5)


def test_dpo_needs_pairs():
    b = make_batch(B=3)
    with pytest.raises(ValueError, match=r"dpo_loss needs logits \[2B, T, V\]"):
        family.dpo_loss(b["logits"], b["completion_ids"], b["completion_mask"], b["ref_logps"])


def test_reward_model_loss_is_bradley_terry_and_stable():
    g = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(16, generator=g), torch.randn(16, generator=g)
    expected = -torch.log(torch.sigmoid(chosen - rejected)).mean()
    assert_close("plain formula", expected, family.reward_model_loss(chosen, rejected), atol=1e-6, rtol=1e-6)
    margin = torch.full((16,), 0.5)
    expected_margin = -torch.log(torch.sigmoid(chosen - rejected - margin)).mean()
    assert_close("margin", expected_margin, family.reward_model_loss(chosen, rejected, margin), atol=1e-6, rtol=1e-6)
    big = torch.tensor([1e4])
    assert family.reward_model_loss(big, -big).item() == 0.0
    assert family.reward_model_loss(-big, big).item() == pytest.approx(2e4)
    r = torch.tensor([5e3], requires_grad=True)
    family.reward_model_loss(-r, r).backward()
    assert torch.isfinite(r.grad).all() and r.grad.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="same shape"):
        family.reward_model_loss(torch.zeros(2), torch.zeros(3))


def _tiny_reward_model(tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


@pytest.mark.parametrize("with_margin", [False, True])
def test_the_centering_term_is_trls_reward_trainers(tmp_path, with_margin):
    """center_rewards_coefficient is TRL's RewardConfig option: the loss is TRL RewardTrainer.compute_loss's."""
    pytest.importorskip("trl", reason="the trl extra is not installed")
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from grpo_kernels.training.tasks import compare

    tokenizer = compare.build_tokenizer()
    trainer = RewardTrainer(
        model=_tiny_reward_model(tokenizer),
        processing_class=tokenizer,
        args=RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=0.01, report_to=[], use_cpu=True),
        train_dataset=Dataset.from_list([{"chosen": "9.9", "rejected": "9.11"}]),
    )
    g = torch.Generator().manual_seed(0)
    chosen, rejected = 3.0 + torch.randn(8, generator=g), 2.0 + torch.randn(8, generator=g)
    margin = torch.rand(8, generator=g) if with_margin else None

    class Scores(torch.nn.Module):  # stands for the model: TRL chunks the logits into chosen, rejected
        def forward(self, **_):
            return type("Out", (), {"logits": torch.cat([chosen, rejected])[:, None]})()

    inputs = {
        "input_ids": torch.ones(16, 2, dtype=torch.long),
        "attention_mask": torch.ones(16, 2, dtype=torch.long),
        **({"margin": margin} if with_margin else {}),
    }
    expected = trainer.compute_loss(Scores(), inputs)
    got = family.reward_model_loss(chosen, rejected, margin, center_rewards_coefficient=0.01)
    assert_close("TRL's reward loss", expected, got, atol=1e-6, rtol=1e-6)
    assert got > family.reward_model_loss(chosen, rejected, margin)  # the term is there
    with pytest.raises(ValueError, match="center_rewards_coefficient must be >= 0 or None, got -0.1"):
        family.reward_model_loss(chosen, rejected, center_rewards_coefficient=-0.1)


def test_the_reward_models_training_centers_its_scores(monkeypatch):
    """train_reward_model passes its center_rewards_coefficient (default 0.01) to the loss."""
    from grpo_kernels.training import reward_model
    from grpo_kernels.training.tasks import compare

    seen = []
    loss = family.reward_model_loss

    def spy(chosen, rejected, margin=None, center_rewards_coefficient=None):
        seen.append(center_rewards_coefficient)
        return loss(chosen, rejected, margin, center_rewards_coefficient)

    monkeypatch.setattr(reward_model, "reward_model_loss", spy)
    tokenizer = compare.build_tokenizer()
    model = _tiny_reward_model(tokenizer)
    pairs = [{"prompt": "Which is bigger? 9.11 or 9.9 \nAnswer: ", "chosen": "9.9", "rejected": "9.11"}]
    reward_model.train_reward_model(model, tokenizer, pairs, steps=1, batch_size=2)
    reward_model.train_reward_model(model, tokenizer, pairs, steps=1, batch_size=2, center_rewards_coefficient=None)
    assert seen == [0.01, None]


def test_reward_model_learns_preferences_and_scores_completions():
    import importlib.util
    import pathlib

    from grpo_kernels.training.reward_model import RewardModelReward, train_reward_model
    from grpo_kernels.training.tasks import compare

    spec = importlib.util.spec_from_file_location(
        "reward_model_grpo", pathlib.Path(__file__).parents[1] / "examples" / "reward_model_grpo.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokenizer = compare.build_tokenizer()
    model = example.build_reward_model(tokenizer, seed=0)
    pairs = example.pairs(compare.make_rows(2000, held_out=False, seed=0))
    losses = train_reward_model(model, tokenizer, pairs, steps=40, batch_size=32)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10  # the Bradley-Terry loss goes down
    scores = RewardModelReward(model, tokenizer)(["Which is bigger? 9.11 or 9.9 \nAnswer: "] * 2, ["9.9", "9.11"])
    assert len(scores) == 2 and all(0.0 < s < 1.0 for s in scores)
