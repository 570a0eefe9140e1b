"""TRL's policy-term masks: the top-entropy token mask and DeepSeek-V3.2's off-policy sequence mask.

Both need this pass's entropies or log-probs before the loss, so every path makes a first,
gradient-free pass, then reads the masks as importance weights (they multiply the policy term,
never the KL, as in TRL). Checked against the reference (loss, gradient, metrics) on every path,
against what the masks mean (the gradient of a dropped token or row), and across two processes
(the entropy quantile is over every process's active tokens). Stock TRL is the oracle of the
adapter's tests (tests/test_trl_integration.py).
"""

import pytest
import torch
from gloo_ranks import run_ranks
from helpers import assert_close, check_lm_head_against_reference, make_batch

from grpo_kernels import GRPOOptions, grpo_loss, grpo_loss_reference
from grpo_kernels.objective import high_entropy_mask
from grpo_kernels.reference import token_logprobs_and_entropy

TOL = dict(atol=2e-6, rtol=1e-5)
PATHS = [("torch", None), ("triton", True), ("triton", False)]
MASKS = {
    "top_entropy": dict(top_entropy_quantile=0.4),
    "off_policy": dict(off_policy_mask_threshold=0.05),
    "both_with_entropy_bonus": dict(top_entropy_quantile=0.6, off_policy_mask_threshold=0.05, entropy_coef=0.1),
}


def _batch(device, seed, **kwargs):
    """Rows: 0 partly masked, 3 fully masked (make_batch). The sampler's log-probs are the current
    ones plus 0.5 on rows 1 and 3, so their mean KL(sampler || current) is 0.5 (a NaN, unscored,
    counts as no evidence), and 0 on rows 0 and 2."""
    batch = make_batch(device=device, seed=seed, V=600, B=4, T=6, clip_spread=0.6, **kwargs)
    current, _ = token_logprobs_and_entropy(batch["logits"], batch["completion_ids"])
    batch["sampling_logps"] = current + torch.tensor([[0.0], [0.5], [0.0], [0.5]], device=device)
    batch["sampling_logps"][1, 2] = float("nan")
    batch["advantages"] = torch.tensor([0.7, -0.9, -0.4, 1.2], device=device)
    return batch


def _grad(fn, batch, **kwargs):
    logits = batch["logits"].detach().clone().requires_grad_()
    out = fn(logits, **{k: v for k, v in batch.items() if k != "logits"}, **kwargs)
    out.loss.backward()
    return out, logits.grad


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("masks", sorted(MASKS))
@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_masked_loss_matches_the_reference(device, backend, one_pass, masks, level):
    batch = _batch(device, seed=31)
    options = dict(beta=0.04, temperature=0.9, importance_sampling_level=level, **MASKS[masks])
    expected, expected_grad = _grad(grpo_loss_reference, batch, **options)
    out, grad = _grad(grpo_loss, batch, backend=backend, one_pass=one_pass, **options)
    assert_close("loss", expected.loss, out.loss, **TOL)
    assert_close("dlogits", expected_grad, grad, **TOL)
    for name, value in expected.metrics.items():
        assert_close(name, value, out.metrics[name], **TOL)


@pytest.mark.parametrize("backend, one_pass", PATHS)
def test_what_the_masks_drop_gets_no_policy_gradient(device, backend, one_pass):
    """beta = 0, no bonus: a token below the entropy quantile, or a negative-advantage row whose
    sampler drifted past the threshold, has a zero gradient row; the rest do not."""
    batch = _batch(device, seed=32)
    active = batch["completion_mask"] != 0
    _, grad = _grad(grpo_loss, batch, backend=backend, one_pass=one_pass, off_policy_mask_threshold=0.05)
    rows_with_grad = grad.abs().sum((-1, -2)) != 0
    # row 1: advantage < 0 and mean KL 0.5 > 0.05: dropped; rows 0 and 2: KL 0, kept; row 3 is padding
    assert rows_with_grad.tolist() == [True, False, True, False]
    batch["advantages"][1] = 0.3  # a positive advantage keeps a row whatever its KL
    _, grad = _grad(grpo_loss, batch, backend=backend, one_pass=one_pass, off_policy_mask_threshold=0.05)
    assert (grad.abs().sum((-1, -2)) != 0).tolist() == [True, True, True, False]

    _, entropy_grad = _grad(grpo_loss, batch, backend=backend, one_pass=one_pass, top_entropy_quantile=0.5)
    _, full_grad = _grad(grpo_loss, batch, backend=backend, one_pass=one_pass)
    scaled = torch.log_softmax(batch["logits"].float() / 1.0, -1)
    entropy = -(scaled.exp() * scaled).sum(-1)
    kept = high_entropy_mask(entropy, batch["completion_mask"].float(), GRPOOptions(top_entropy_quantile=0.5)) != 0
    token_has_grad = entropy_grad.abs().sum(-1) != 0
    assert torch.equal(token_has_grad, kept & (full_grad.abs().sum(-1) != 0))
    assert 0 < int(kept.sum()) < int(active.sum())


def test_the_options_are_checked():
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \[0, 1\] \(1 keeps every token\), got 1.5"):
        GRPOOptions(top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="top_entropy_quantile < 1 masks tokens by their entropy"):
        GRPOOptions(top_entropy_quantile=0.5, compute_entropy=False)
    with pytest.raises(TypeError, match="off_policy_mask_threshold must be a finite number, got 'x'"):
        GRPOOptions(off_policy_mask_threshold="x")
    batch = make_batch(seed=33)
    with pytest.raises(ValueError, match=r"sampling_logps must have shape \(3, 5\), got \(3,\)"):
        grpo_loss(**batch, sampling_logps=torch.zeros(3), off_policy_mask_threshold=0.1)


def _rank_entropy_mask(rank: int, world: int):
    """Each rank's mask from its half of the rows; the quantile is over both halves' active tokens."""
    g = torch.Generator().manual_seed(7)
    entropy, mask = torch.rand(4, 5, generator=g) * 3, (torch.rand(4, 5, generator=g) > 0.3).float()
    mask[3] = 0  # rank 1 has fewer active tokens than rank 0: the gathered lengths differ
    rows = slice(rank * 2, rank * 2 + 2)
    return high_entropy_mask(entropy[rows], mask[rows], GRPOOptions(top_entropy_quantile=0.3)).tolist()


def test_the_entropy_quantile_is_over_every_process():
    per_rank = run_ranks(_rank_entropy_mask, 2)
    g = torch.Generator().manual_seed(7)
    entropy, mask = torch.rand(4, 5, generator=g) * 3, (torch.rand(4, 5, generator=g) > 0.3).float()
    mask[3] = 0
    single = high_entropy_mask(entropy, mask, GRPOOptions(top_entropy_quantile=0.3))
    assert torch.tensor(per_rank[0] + per_rank[1]).equal(single)
    assert not torch.equal(
        torch.tensor(per_rank[1]), high_entropy_mask(entropy[2:], mask[2:], GRPOOptions(top_entropy_quantile=0.3))
    )


# From hidden states: the same first pass (log-probs and entropies, no logits kept), every lm_head mode
LM_HEAD_PATHS = [("torch", None), ("triton", "recompute"), ("triton", "three_products")]


@pytest.mark.parametrize(
    "options",
    [
        dict(top_entropy_quantile=0.5, entropy_coef=0.1, beta=0.04),
        dict(off_policy_mask_threshold=0.05, beta=0.04),
        dict(top_entropy_quantile=0.7, off_policy_mask_threshold=0.05, importance_sampling_level="sequence"),
        dict(loss_type="vespo", top_entropy_quantile=0.6, entropy_coef=0.05),
    ],
    ids=["entropy_mask_and_bonus", "off_policy", "both_sequence", "vespo"],
)
@pytest.mark.parametrize("backend, lm_head_mode", LM_HEAD_PATHS)
def test_masks_and_bonus_from_hidden_states(device, backend, lm_head_mode, options):
    g = torch.Generator().manual_seed(51)
    hidden = torch.randn(4, 6, 24, generator=g).to(device)
    weight = (0.4 * torch.randn(600, 24, generator=g)).to(device)
    batch = _batch(device, seed=52)
    with torch.no_grad():  # the sampler's log-probs relative to this lm_head's
        current, _ = token_logprobs_and_entropy(hidden @ weight.T, batch["completion_ids"])
        batch["sampling_logps"] = current + torch.tensor([[0.0], [0.5], [0.0], [0.5]], device=device)
    inputs = {k: v for k, v in batch.items() if k != "logits"}
    check_lm_head_against_reference(
        hidden, weight, inputs, backend=backend, lm_head_mode=lm_head_mode, options=options, tol=TOL
    )
